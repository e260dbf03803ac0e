"""The reference workload of ../shared/BENCH.md: checkpoint `bench-qwen3-moe` and `mixed-64`.

Shared by every benchmark under `bench/` (throughput.py, ep.py, kv_cache.py, serve.py's tests)
and by the peer runners, which receive the requests as a JSON file (`write_requests_file`).

Modes of running the workload (`MODES`):
  - `batched`: all requests submitted at once (offline throughput, BENCH.md's figure);
  - `batch1`: the first `BATCH1_REQUESTS` (8) requests one at a time, each its own generate
    call, sequentially (a single-sequence decode figure).
Either way the figure is total output tokens / total seconds of the generate call(s).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

logger = logging.getLogger("bench.workload")

CHECKPOINT_NAME = "bench-qwen3-moe"
#: BENCH.md's checkpoint config, field for field.
BENCH_CONFIG = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
#: Totals of the full mixed-64 workload (BENCH.md), checked when all 64 requests run.
MIXED64_PROMPT_TOKENS = 9093
MIXED64_OUTPUT_TOKENS = 8906
#: How many of the first requests the batch-1 mode runs, one at a time.
BATCH1_REQUESTS = 8
#: The ways of running the workload; see the module docstring.
MODES = ("batched", "batch1")


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload: prompt token ids and the exact number of output tokens."""

    prompt_token_ids: list[int]
    output_len: int


@dataclass(frozen=True)
class RunResult:
    """One run of the workload in one mode.

    output_tokens: tokens generated (all requests of the mode); seconds: wall time of the
    generate call(s) alone; token_ids: per request in order, when asked for.
    """

    output_tokens: int
    seconds: float
    token_ids: list[list[int]] | None = None


class BenchEngine(Protocol):
    """A row of the table: an engine loaded once (untimed), then run once per `run` call.

    name: the row (`moe-engine`, `vllm-cpu-bf16`, ...); compute_dtype: what it computes in;
    info: settings and versions for the report; pid: the process it computes in (the driver's
    own for in-process engines); cpu_seconds: CPU seconds that process (tree) has used so far,
    None where unknown.
    """

    name: str
    compute_dtype: str
    info: dict[str, Any]

    @property
    def pid(self) -> int: ...

    def cpu_seconds(self) -> float | None: ...

    def run(self, mode: str, return_token_ids: bool = False) -> RunResult: ...

    def close(self) -> None: ...


def mixed_workload(num_requests: int = 64) -> list[BenchRequest]:
    """The first `num_requests` requests of `mixed-64`, in arrival order (BENCH.md).

    Raises:
        ValueError: when num_requests is not in 1..64.
    """
    if not 1 <= num_requests <= 64:
        raise ValueError(f"num_requests must be in 1..64, got {num_requests}")
    rng = random.Random(0)
    requests = []
    for _ in range(64):
        prompt = [rng.randint(3, 8191) for _ in range(rng.randint(32, 256))]
        requests.append(BenchRequest(prompt, rng.randint(16, 256)))
    return requests[:num_requests]


def mode_requests(requests: list[BenchRequest], mode: str) -> list[BenchRequest]:
    """The requests a mode runs: all of them (`batched`) or the first BATCH1_REQUESTS
    (`batch1`, fewer when the workload is shorter).

    Raises:
        ValueError: unknown mode.
    """
    if mode == "batched":
        return requests
    if mode == "batch1":
        return requests[:BATCH1_REQUESTS]
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


def write_requests_file(requests: list[BenchRequest]) -> Path:
    """The requests as a temporary JSON file (a list of `{"prompt_token_ids": [int, ...],
    "output_len": int}`, the peer runners' `--requests`); the caller removes it."""
    fd, path = tempfile.mkstemp(prefix="mixed64-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump([{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                   for r in requests], f)
    return Path(path)


def ensure_bench_checkpoint(cache_dir: Path) -> Path:
    """`cache_dir/bench-qwen3-moe`, created on first use (seed 0, bf16, 229 MB), atomically."""
    return ensure_random_checkpoint(cache_dir, CHECKPOINT_NAME, "qwen3_moe", BENCH_CONFIG,
                                    torch.bfloat16)


def ensure_random_checkpoint(cache_dir: Path, name: str, model_type: str, config: dict,
                             dtype: torch.dtype) -> Path:
    """`cache_dir/name`: a random-weight `model_type` checkpoint of `config` (transformers
    `from_config`, seed 0, saved in `dtype`), made on first use, atomically (in a temporary
    directory, then renamed; a concurrent maker's result is kept)."""
    final = cache_dir / name
    if (final / "config.json").is_file():
        return final
    from transformers import AutoConfig, AutoModelForCausalLM

    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("creating %s", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=cache_dir))
    try:
        cfg = AutoConfig.for_model(model_type, **config)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        model.save_pretrained(tmp, safe_serialization=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def add_greedy_requests(row: Any, prompts: list[list[int]], output_len: int) -> list[str]:
    """Add every prompt to `row.llm.engine` as a greedy request of exactly `output_len` tokens
    (ignore EOS), ids `f"{row.name}-{n}"` from the row's running `counter`; returns the ids in
    prompt order (the benches that step `EngineCore` themselves)."""
    from moe_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len,
                            ignore_eos=True)
    ids = []
    for p in prompts:
        rid = f"{row.name}-{row.counter}"
        row.counter += 1
        row.llm.engine.add_request(rid, p, params)
        ids.append(rid)
    return ids


def apply_quick_defaults(args: Any, argv: list[str] | None, defaults: dict[str, Any]) -> None:
    """A bench's `--quick`: set each `--flag` of `defaults` on `args` unless the command line
    gave it (`argv`, or sys.argv when None)."""
    import sys

    given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
    for flag, value in defaults.items():
        if flag not in given:
            setattr(args, flag[2:].replace("-", "_"), value)
