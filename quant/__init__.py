"""4-bit expert weight formats: `quant.mxfp4` (OCP MX v1.0 MXFP4, the gpt-oss layout),
`quant.int4` (INT4 group-wise, w4a16) and `quant.packing` (two 4-bit codes per byte).

Imports nothing from `moe_engine` (DESIGN.md section 3); kept free of imports so it stays
cheap to load.
"""
