"""Expert kernels of moe-engine: `kernels.moe.reference` (plain torch, the oracle and CPU path).

Kept free of imports on purpose: `transformers` probes a top-level package named `kernels`
(the Hugging Face hub-kernels package) and this one must stay cheap to import and must not be
mistaken for it.
"""
