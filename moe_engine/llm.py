"""The offline Python API over the same engine core, as vLLM users know it.

llm = LLM(model="/path/to/checkpoint")
outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_engine.config import CacheConfig, EngineConfig, ModelConfig, QuantConfig, SchedulerConfig
from moe_engine.engine.core import EngineCore
from moe_engine.errors import StartupError
from moe_engine.request import FinishReason, SamplingParams


@dataclass
class CompletionOutput:
    """One finished request.

    Attributes:
        request_id: "0", "1", ... in prompt order.
        prompt_token_ids: the prompt as token ids.
        token_ids: generated token ids.
        text: generated text ("" without a tokenizer).
        finish_reason: why it stopped.
        logprobs: per generated token (when asked for).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    logprobs: list = field(default_factory=list)


class LLM:
    """Runs an `EngineCore` in this process until every prompt is done.

    Args:
        model: checkpoint directory (config.json + *.safetensors), or "demo" for the built-in
            demo checkpoint; never fetched from the network.
        dtype: "auto", "bfloat16" or "float32".
        max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory (bytes),
        block_size, num_blocks_override, quantization, quant_group_size,
        enable_prefix_caching: as the `moe-serve` flags of the same names.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | None = None,
        block_size: int = 16,
        num_blocks_override: int | None = None,
        seed: int = 0,
        quantization: str = "none",
        quant_group_size: int = 128,
        enable_prefix_caching: bool = False,
    ) -> None:
        if model == "demo":
            from moe_engine.demo import ensure_demo_checkpoint

            model = str(ensure_demo_checkpoint())
        if not (Path(model) / "config.json").is_file():  # a local directory, never a hub id
            raise StartupError(f"model: no config.json in {str(model)!r}")
        self.engine = EngineCore(
            EngineConfig(
                model=ModelConfig(
                    model=str(model), dtype=dtype, max_model_len=max_model_len, seed=seed
                ),
                cache=CacheConfig(
                    block_size=block_size,
                    kv_cache_memory=kv_cache_memory,
                    num_blocks_override=num_blocks_override,
                    enable_prefix_caching=enable_prefix_caching,
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens
                ),
                quant=QuantConfig(method=quantization, group_size=quant_group_size),
            )
        )
        self._next_id = 0

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (text needs the checkpoint's tokenizer).

        Raises:
            RequestError: a prompt or parameter the engine refuses (nothing is run then, and
                the engine keeps no request of this call).
            ValueError: text prompts for a checkpoint without a tokenizer, or a list of
                sampling params whose length differs from the prompts'.
        """
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(
                f"sampling_params: {len(params_list)} given for {len(prompts)} prompts; give "
                f"one, or one per prompt"
            )
        outputs: dict[str, CompletionOutput] = {}
        order = []
        try:
            for prompt, p in zip(prompts, params_list, strict=True):
                ids = self._encode(prompt)
                rid = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(rid, ids, p)
                outputs[rid] = CompletionOutput(rid, ids)
                order.append(rid)
        except BaseException:
            self.engine.abort_requests(order)  # all or nothing: the engine stays clean
            raise
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                done = outputs[out.request_id]
                done.token_ids.extend(out.new_token_ids)
                done.text += out.new_text
                if out.logprobs:
                    done.logprobs.extend(out.logprobs)
                if out.finished:
                    done.finish_reason = out.finish_reason
        return [outputs[r] for r in order]

    def _encode(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(
                "prompt: text given but the checkpoint has no tokenizer; pass token ids"
            )
        return tok.encode(prompt)
