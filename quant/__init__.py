"""4-bit expert weight formats (MXFP4, INT4 group-wise); filled in by the 4-bit issue."""
