"""moe-engine: a serving engine for Mixture-of-Experts models.

`LLM` and `SamplingParams` are the offline API (results are `RequestOutput`s of
`CompletionOutput`s, as vLLM's); `moe-serve` / `moe-client` the served one.
"""

from moe_engine.outputs import CompletionOutput, Logprob, RequestOutput
from moe_engine.request import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from moe_engine.llm import LLM

        return LLM
    raise AttributeError(name)
