"""moe-engine: a serving engine for Mixture-of-Experts models.

`LLM` and `SamplingParams` are the offline API; `moe-serve` / `moe-client` the served one.
"""

from moe_engine.request import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from moe_engine.llm import LLM

        return LLM
    raise AttributeError(name)
