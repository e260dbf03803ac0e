"""The offline Python API over the same engine core, as vLLM users know it (`vllm.LLM`).

llm = LLM(model="/path/to/checkpoint")
outs = llm.generate("Hello", SamplingParams(max_tokens=32, temperature=0))
print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from moe_engine._omp import TORCH_LOADED_WITHOUT_WAIT_POLICY
from moe_engine.core.build import build_engine_core
from moe_engine.core.validation import truncate_prompt
from moe_engine.errors import StartupError
from moe_engine.offline.outputs import RequestOutput, RequestOutputBuilder
from moe_engine.offline.weights import WeightUpdateMethods
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    QuantConfig,
    SchedulerConfig,
    parse_bytes,
)
from moe_engine.startup.model_path import resolve_model_dir
from moe_engine.startup.spec_config import (
    DEFAULT_DISABLE_BY_BATCH_SIZE,
    SpeculativeConfig,
    make_speculative_config,
)

#: One prompt: text, token ids, or vLLM's TextPrompt / TokensPrompt dicts.
PromptType = str | Sequence[int] | dict[str, Any]
#: A chat conversation: [{"role": "user", "content": "..."}, ...].
Conversation = list[dict[str, Any]]


logger = logging.getLogger(__name__)

#: Logged by `LLM` on a CPU when torch was imported before moe_engine with no OMP_WAIT_POLICY.
WAIT_POLICY_WARNING = (
    "torch was imported before moe_engine with OMP_WAIT_POLICY unset, so torch's OpenMP "
    "workers in this process spin after every torch op on the cores the engine's kernels use "
    "(mixed-64 measured 27% slower): import moe_engine before torch, or set "
    "OMP_WAIT_POLICY=PASSIVE in the environment")

class LLM(WeightUpdateMethods):
    """Runs an `EngineCore` in this process until every prompt is done.

    Args:
        model: checkpoint directory (config.json + *.safetensors), a Hugging Face hub id
            whose snapshot is in the local hub cache (`~/.cache/huggingface/hub`), or "demo"
            for the built-in demo checkpoint; never fetched from the network.
        dtype: "auto", "bfloat16", "float16" ("half") or "float32" ("float").
        tokenizer: a folder with the tokenizer files to use instead of `model`'s (vLLM's
            `tokenizer`; a hub id in the local hub cache too); None: `model`'s.
        max_model_len, max_num_seqs, max_num_batched_tokens, kv_cache_memory (bytes, or text
            such as "2GiB"),
        block_size, num_blocks_override, quantization, quant_group_size, quantized_layers,
        kernel_backend, enable_prefix_caching, device ("auto", "cpu", "cuda"),
        gpu_memory_utilization (fraction in (0, 1]), enforce_eager (no CUDA graphs),
        cpu_memory_utilization (fraction in (0, 1] of the host's memory, on a CPU),
        speculative_method ("ngram" or None), num_speculative_tokens, ngram_min, ngram_max,
        speculative_disable_by_batch_size, weight_version, seed, scheduling_policy ("fcfs" or
        "priority"), enable_return_routed_experts (then a request with
        `SamplingParams(return_routed_experts=True)` gets `outputs[i].routed_experts`, see
        `CompletionOutput`): as the `moe-serve` flags of the same names. Weight updates:
        `update_weights_from_disk`,
        `init_weight_update_group` / `update_weights_from_distributed` (`llm_weights.py`).

    Raises:
        StartupError: no config.json at `model`, or a configuration the engine refuses.
    """

    def __init__(
        self,
        model: str,
        dtype: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        kv_cache_memory: int | str | None = None,
        block_size: int = 16,
        num_blocks_override: int | None = None,
        seed: int = 0,
        quantization: str = "none",
        quant_group_size: int = 128,
        quantized_layers: str = "experts",
        kernel_backend: str = "auto",
        enable_prefix_caching: bool = False,
        device: str = "auto",
        gpu_memory_utilization: float = 0.9,
        enforce_eager: bool = False,
        cpu_memory_utilization: float = DeviceConfig.cpu_memory_utilization,
        speculative_method: str | None = None,
        num_speculative_tokens: int | None = None,
        ngram_min: int = 1,
        ngram_max: int = 4,
        speculative_disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE,
        weight_version: str = "default",
        tokenizer: str | None = None,
        scheduling_policy: str = SchedulerConfig.policy,
        enable_return_routed_experts: bool = False,
    ) -> None:
        if model == "demo":
            from moe_engine.startup.demo import ensure_demo_checkpoint

            model = str(ensure_demo_checkpoint())
        else:
            try:  # a local directory, or a hub id already in the local hub cache
                model = resolve_model_dir(model)
            except FileNotFoundError as exc:
                raise StartupError(str(exc)) from None
        if not (Path(model) / "config.json").is_file():
            raise StartupError(f"model: no config.json in {str(model)!r}")
        if tokenizer is not None:
            try:
                tokenizer = resolve_model_dir(tokenizer)
            except FileNotFoundError as exc:
                raise StartupError(f"tokenizer: {exc}") from None
        self.engine = build_engine_core(
            EngineConfig(
                device=DeviceConfig(device, gpu_memory_utilization, enforce_eager,
                                    cpu_memory_utilization),
                model=ModelConfig(
                    model=str(model), dtype=dtype, max_model_len=max_model_len, seed=seed,
                    weight_version=weight_version, tokenizer=tokenizer,
                ),
                cache=CacheConfig(
                    block_size=block_size,
                    kv_cache_memory=_bytes("kv_cache_memory", kv_cache_memory),
                    num_blocks_override=num_blocks_override,
                    enable_prefix_caching=enable_prefix_caching,
                ),
                scheduler=SchedulerConfig(
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    policy=scheduling_policy,
                ),
                quant=QuantConfig(
                    method=quantization, group_size=quant_group_size, layers=quantized_layers
                ),
                kernel_backend=kernel_backend,
                speculative=_speculative_config(
                    speculative_method, num_speculative_tokens, ngram_min, ngram_max,
                    speculative_disable_by_batch_size,
                ),
                enable_return_routed_experts=enable_return_routed_experts,
            )
        )
        self._next_id = 0
        if TORCH_LOADED_WITHOUT_WAIT_POLICY and self.engine.device.type == "cpu":
            logger.warning(WAIT_POLICY_WARNING)

    def get_tokenizer(self):
        """The checkpoint's tokenizer (transformers), or None when it ships none."""
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text needs the checkpoint's tokenizer).

        Args:
            prompts: one prompt or a list of them. A prompt is a string, a list of token ids,
                `{"prompt": str}` or `{"prompt_token_ids": [int, ...]}` (vLLM's TextPrompt and
                TokensPrompt). One string or one list of ints is ONE prompt.
            sampling_params: one SamplingParams for all prompts, or one per prompt; default
                `SamplingParams()`.
            use_tqdm: show a progress bar of finished prompts on stderr (with input and output
                tokens/s, as vLLM's); a callable is used in place of `tqdm.tqdm`.
            priority: one priority per prompt (vLLM's argument; lower runs earlier with
                `scheduling_policy="priority"`), set on a copy of its params; None keeps the
                params' own `priority`.

        Returns:
            One RequestOutput per prompt, in prompt order, each with `n` completions; its
            `prompt_token_ids` are the prompt as run (cut by `truncate_prompt_tokens`).

        Raises:
            RequestError: a prompt or parameter the engine refuses (nothing is run then, and
                the engine keeps no request of this call).
            ValueError: text prompts for a checkpoint without a tokenizer, a prompt of an
                unknown shape, or a list of sampling params whose length differs from the
                prompts'.
        """
        items = _as_prompt_list(prompts)
        parsed = [self._parse_prompt(p, i) for i, p in enumerate(items)]
        return self._run(parsed, sampling_params, use_tqdm, priority)

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to chat conversations through the tokenizer's chat template
        (`apply_chat_template`, rendered to text then tokenized without added special
        tokens, as vLLM does).

        Args:
            messages: one conversation (a list of {"role", "content"} dicts) or a list of them.
            sampling_params, use_tqdm: as `generate`.
            chat_template: a Jinja template used instead of the tokenizer's.
            add_generation_prompt: end the prompt with the assistant's turn header.
            continue_final_message: continue the last message instead of starting a new one.
            chat_template_kwargs: more variables for the template.

        Returns:
            One RequestOutput per conversation; `prompt` is the rendered template.

        Raises:
            ValueError: no tokenizer, a tokenizer without a chat template (and none given), or
                a conversation that is not a list of message dicts.
            RequestError: as `generate`.
        """
        tok = self._tokenizer("chat")
        template = chat_template or getattr(tok, "chat_template", None)
        if not template:
            raise ValueError(
                f"chat: the tokenizer of {self.engine.config.model.model!r} has no chat template "
                "(tokenizer_config.json 'chat_template' or chat_template.jinja); pass "
                "chat_template=... or call generate() with a prompt"
            )
        conversations = _as_conversation_list(messages)
        parsed = []
        for conversation in conversations:
            text = tok.apply_chat_template(
                conversation,
                chat_template=template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            parsed.append((text, tok.encode(text, add_special_tokens=False)))
        return self._run(parsed, sampling_params, use_tqdm)

    def _run(
        self,
        parsed: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool | Callable[..., Any],
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Queue every (text, ids) prompt, all or nothing, and step until all are done."""
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = [params] * len(parsed) if isinstance(params, SamplingParams) else params
        if len(params_list) != len(parsed):
            raise ValueError(
                f"sampling_params: {len(params_list)} given for {len(parsed)} prompts; give "
                f"one, or one per prompt"
            )
        if priority is not None:
            if len(priority) != len(parsed):
                raise ValueError(
                    f"priority: {len(priority)} given for {len(parsed)} prompts; give one per "
                    "prompt"
                )
            params_list = [replace(p, priority=q)
                           for p, q in zip(params_list, priority, strict=True)]  # fmt: skip
        builders: dict[str, RequestOutputBuilder] = {}
        try:
            for (text, ids), p in zip(parsed, params_list, strict=True):
                rid = str(self._next_id)
                self._next_id += 1
                ids = truncate_prompt(ids, p, self.engine.max_model_len)
                self.engine.add_request(rid, ids, p)
                builders[rid] = RequestOutputBuilder(
                    RequestOutput(rid, text, list(ids)),
                    p.n,
                    want_logprobs=p.logprobs is not None,
                    greedy=p.greedy,
                    tokenizer=self.engine.tokenizer,
                )
            self._run_engine(builders, use_tqdm)
        except BaseException:
            self.engine.abort_requests(list(builders))  # all or nothing: the engine stays clean
            raise
        return [b.output for b in builders.values()]

    def _run_engine(
        self, builders: dict[str, RequestOutputBuilder], use_tqdm: bool | Callable[..., Any]
    ) -> None:
        bar = _progress_bar(len(builders), use_tqdm)
        num_in = num_out = 0
        try:
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    builder = builders[delta.request_id]
                    builder.add(delta)
                    out = builder.output
                    if bar is None or not (delta.finished and out.finished):
                        continue
                    num_in += len(out.prompt_token_ids)
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    elapsed = max(bar.format_dict["elapsed"], 1e-9)
                    bar.postfix = (
                        f"est. speed input: {num_in / elapsed:.2f} toks/s, "
                        f"output: {num_out / elapsed:.2f} toks/s"
                    )
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()

    def _parse_prompt(self, prompt: PromptType, index: int) -> tuple[str | None, list[int]]:
        """(text or None, token ids) of one prompt.

        Raises:
            ValueError: a prompt of an unknown shape (names its index), or text without a
                tokenizer.
        """
        if isinstance(prompt, str):
            return prompt, self._tokenizer("prompt").encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if _is_token_ids(ids) or (isinstance(ids, (list, tuple)) and not ids):
                    return prompt.get("prompt"), [int(t) for t in ids]
            elif isinstance(prompt.get("prompt"), str):
                return prompt["prompt"], self._tokenizer("prompt").encode(prompt["prompt"])
        elif _is_token_ids(prompt) or (isinstance(prompt, (list, tuple)) and not prompt):
            return None, [int(t) for t in prompt]
        raise ValueError(
            f"prompts: entry {index} ({type(prompt).__name__}) is not a prompt; give a string, "
            "a list of token ids, {'prompt': str} or {'prompt_token_ids': [int, ...]}"
        )

    def _tokenizer(self, field: str):
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError(
                f"{field}: text given but the checkpoint has no tokenizer; pass token ids"
            )
        return tok


def _bytes(field: str, value: int | str | None) -> int | None:
    """A byte count given as `moe-serve` takes it (an int, or text like "4GiB").

    Raises:
        ValueError: text that is not a byte count (names the field).
    """
    if not isinstance(value, str):
        return value
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise ValueError(f"{field}: {exc}") from None


def _is_token_ids(value: object) -> bool:
    """True for a non-empty list or tuple of ints (bools excluded)."""
    return (
        isinstance(value, (list, tuple))
        and bool(value)
        and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value)
    )


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    """One prompt (a string, a dict, a list of ints) as a list of one; a list as it is."""
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        return list(prompts)
    raise ValueError(
        f"prompts: a {type(prompts).__name__} given; give a prompt (a string, a list of token "
        "ids, a dict) or a list of prompts"
    )


def _as_conversation_list(messages: Conversation | Sequence[Conversation]) -> list[Conversation]:
    """One conversation (a list of message dicts) as a list of one; a list of them as it is."""
    if isinstance(messages, (list, tuple)) and messages and all(
        isinstance(m, dict) for m in messages
    ):
        return [list(messages)]
    if isinstance(messages, (list, tuple)) and all(
        isinstance(c, (list, tuple)) and all(isinstance(m, dict) for m in c) for c in messages
    ):
        return [list(c) for c in messages]
    raise ValueError(
        "messages: give a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
        "list of conversations"
    )


def _progress_bar(total: int, use_tqdm: bool | Callable[..., Any]):
    """vLLM's "Processed prompts" bar (tqdm, on stderr), or None when `use_tqdm` is False."""
    if not use_tqdm:
        return None
    if callable(use_tqdm):
        factory = use_tqdm
    else:
        from tqdm import tqdm as factory
    return factory(
        total=total,
        desc="Processed prompts",
        dynamic_ncols=True,
        postfix=f"est. speed input: {0:.2f} toks/s, output: {0:.2f} toks/s",
    )


def _speculative_config(
    method: str | None, k: int | None, ngram_min: int, ngram_max: int, disable_by: int
) -> SpeculativeConfig:
    """The SpeculativeConfig of `LLM`'s arguments.

    Raises:
        StartupError: a value out of range (the message names the argument).
    """
    try:
        return make_speculative_config(method, k, ngram_min, ngram_max, disable_by)
    except ValueError as exc:
        raise StartupError(str(exc)) from None
