"""One harness for every architecture's token-exactness against `transformers` (issue 43).

A family's test module states its tiny config (a dict of config.json fields over `COMMON`) and
calls the checks here; the checkpoint is `AutoModelForCausalLM.from_config` of that config,
seeded, saved as safetensors (nothing is downloaded). Each check serves it through the engine
and compares greedy ids with `transformers.generate` (float32):

- `check_token_exact`: the offline `LLM`, a small token budget so every prompt longer than it
  is chunked, prompts longer than any window or chunk; every KV block and state slot returned;
- `check_prefix_cache`: prefix caching on, a second round of prompts sharing the first
  round's prefixes: hits counted, ids still exact;
- `check_ep_token_exact`: `--ep-size N` through gRPC (ranks by torch's elastic launcher).

Loading itself proves the checkpoint-name mapping complete: the loader refuses a checkpoint
tensor it has no parameter for and a parameter no tensor fills (`WeightLoader`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from fixtures import _COMMON, hf_greedy

#: Fields every tiny family checkpoint shares unless its own dict overrides them: the tiny
#: checkpoints' common shape (`fixtures._COMMON`: 512-token vocabulary, hidden 64, 4 query / 2 KV
#: heads of 16 dims, top-2 routing, large init so greedy continuations depend on the prompt).
COMMON: dict[str, Any] = dict(_COMMON)

#: Prompt lengths (tokens): 1 (decode only), one under a 16-token chunk, several chunks, and
#: one longer than the test windows (<= 32) and block size.
PROMPT_LENS: tuple[int, ...] = (1, 11, 37, 70)
MAX_NEW = 8


def make_family_checkpoint(
    model_type: str,
    fields: dict[str, Any],
    root: Path,
    *,
    drawn: tuple[str, ...] = (),
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    name: str | None = None,
) -> Path:
    """A tiny random checkpoint of `model_type` under `root` (reused when present).

    Args:
        model_type: transformers' model type (`AutoConfig.for_model`).
        fields: config fields over `COMMON` (a field set to `None` here is removed from COMMON
            before the config is made, for configs that lack it).
        drawn: name endings of parameters/buffers transformers initialises to zero or one (biases,
            sinks, zero-centred norms, correction biases): drawn from N(0, initializer_range) so
            their code paths are tested.
        seed: `torch.manual_seed` before the weights are drawn.
        name: directory name (default `model_type`).

    Returns:
        The checkpoint directory (config.json + model.safetensors).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(root) / (name or model_type)
    if (path / "config.json").is_file():
        return path
    merged = {**COMMON, **fields}
    config = AutoConfig.for_model(model_type, **{k: v for k, v in merged.items() if v is not None})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if drawn:
        std = float(getattr(config, "initializer_range", 0.5))
        with torch.no_grad():
            for tensor_name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if tensor_name.endswith(drawn) and tensor.is_floating_point():
                    tensor.normal_(0.0, std)
    model.save_pretrained(path, safe_serialization=True)
    return path


def family_prompts(vocab: int, lens: Sequence[int] = PROMPT_LENS, seed: int = 0) -> list[list[int]]:
    """Random prompts (ids 3..vocab-1) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def _greedy(llm, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    from moe_engine import SamplingParams

    params = SamplingParams(max_tokens=max_new, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def check_token_exact(
    ckpt: Path,
    *,
    prompts: list[list[int]] | None = None,
    max_new: int = MAX_NEW,
    max_num_batched_tokens: int = 16,
    expected: list[list[int]] | None = None,
    **llm_kwargs: Any,
):
    """Greedy ids of the offline `LLM` equal `transformers.generate`'s, chunked prefill on,
    and every KV block and state slot back in the pool after.

    Args:
        prompts: default `family_prompts(vocab)`.
        expected: the oracle's ids when already computed (default `hf_greedy`).
        llm_kwargs: more `LLM` arguments (kernel_backend, quantization, ...).

    Returns:
        The `LLM` (its engine's stats for further checks).
    """
    from moe_engine import LLM

    vocab = _vocab(ckpt)
    prompts = prompts or family_prompts(vocab)
    expected = expected if expected is not None else hf_greedy(ckpt, prompts, max_new)
    kwargs = dict(max_model_len=256, num_blocks_override=64, block_size=16)
    llm = LLM(model=str(ckpt), max_num_batched_tokens=max_num_batched_tokens,
              **{**kwargs, **llm_kwargs})
    got = _greedy(llm, prompts, max_new)
    assert got == expected, _diff(got, expected)
    _assert_all_returned(llm)
    return llm


def check_prefix_cache(ckpt: Path, *, max_new: int = 6, **llm_kwargs: Any):
    """Prefix caching on: prompts sharing a 40-token prefix, served one after another, hit the
    cache (hits > 0) and stay token-exact with `transformers`.

    Returns:
        The `LLM`.
    """
    from moe_engine import LLM

    vocab = _vocab(ckpt)
    prefix, tails = family_prompts(vocab, (40,), seed=7)[0], family_prompts(vocab, (3, 9), 8)
    prompts = [prefix + tail for tail in tails]
    expected = hf_greedy(ckpt, prompts, max_new)
    kwargs = dict(max_model_len=256, num_blocks_override=64, block_size=16,
                  max_num_batched_tokens=32)
    llm = LLM(model=str(ckpt), enable_prefix_caching=True, **{**kwargs, **llm_kwargs})
    got = [_greedy(llm, [p], max_new)[0] for p in prompts]
    assert got == expected, _diff(got, expected)
    hits = llm.engine.get_stats().prefix_cache_hits
    assert hits > 0, "the second prompt did not hit the cached prefix"
    _assert_all_returned(llm)
    return llm


def check_ep_token_exact(ckpt: Path, ep_size: int = 2, *, max_new: int = 6) -> None:
    """`--ep-size ep_size` served through gRPC: concurrent greedy requests equal
    `transformers`; the experts split over the ranks; every block back after."""
    import grpc
    from grpc_helpers import ServerThread, stats, token_ids
    from grpc_helpers import request as make_request

    from moe_engine.server.app import ServerOptions
    from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
    from moe_engine.startup.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    prompts = family_prompts(_vocab(ckpt), (5, 37, 70), seed=3)
    expected = hf_greedy(ckpt, prompts, max_new)
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=256),
        cache=CacheConfig(num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
        parallel=ParallelConfig(ep_size=ep_size, collective_timeout_s=60.0),
    )
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    try:
        assert handle.server.engine.model_info.ep_size == ep_size
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)

            def one(p: list[int]) -> list[int]:
                req = make_request(p, max_tokens=max_new, temperature=0.0, ignore_eos=True)
                return token_ids(list(stub.Generate(req, timeout=180)))

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(one, prompts))
            s = stats(stub)
    finally:
        handle.close()
    assert got == expected, _diff(got, expected)
    assert s.kv_blocks_free == s.kv_blocks_total
    assert s.num_running == s.num_waiting == 0


def _vocab(ckpt: Path) -> int:
    import json

    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    return int(cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size"))


def _assert_all_returned(llm) -> None:
    stats = llm.engine.get_stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total, (stats.kv_blocks_free,
                                                           stats.kv_blocks_total)
    total = getattr(stats, "state_slots_total", 0)
    if total:
        assert stats.state_slots_free == total


def _diff(got: Iterable[list[int]], expected: Iterable[list[int]]) -> str:
    rows = [f"prompt {i}: engine {g} != transformers {e}"
            for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]
    return "; ".join(rows)
