"""The engines `bench/throughput.py` runs in its own process: moe-engine's offline `LLM` (one row
per `--quantization` variant) and `transformers` `generate` with static batches.

Each is a `workload.BenchEngine`: loaded in `__init__` (untimed), `run(mode)` runs the workload
once, `batched` (everything at once; transformers: static batches of `batch_size`) or `batch1`
(the first 8 requests one at a time, each its own generate call), and times only the generate
call(s).
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from workload import BenchRequest, RunResult, mode_requests

ENGINE = "moe-engine"
HF_STATIC = "transformers-static-batching"
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def engine_row_name(quantization: str) -> str:
    """`none` -> `moe-engine`, `int4` -> `moe-engine-int4`, `int4-all` (--quantized-layers
    all) -> `moe-engine-int4-all`."""
    return ENGINE if quantization == "none" else f"{ENGINE}-{quantization}"


def own_cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads, not its children)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _check_lengths(name: str, token_ids: list[list[int]], requests: list[BenchRequest]) -> None:
    for i, (ids, req) in enumerate(zip(token_ids, requests, strict=True)):
        if len(ids) != req.output_len:
            raise RuntimeError(f"{name}: request {i}: {len(ids)} tokens, expected "
                               f"{req.output_len}")


class InProcessEngine:
    """What the in-process rows share: the process is the driver's."""

    name: str
    compute_dtype: str
    info: dict[str, Any]

    @property
    def pid(self) -> int:
        return os.getpid()

    def cpu_seconds(self) -> float | None:
        return own_cpu_seconds()

    def close(self) -> None:
        """Nothing to stop; the model is freed with the object."""


class MoeEngineRow(InProcessEngine):
    """moe-engine's offline `LLM` with `quantization` of the routed experts (`none`, `int4`,
    `mxfp4`; `int4-all` / `mxfp4-all`: the dense projections too, --quantized-layers all) and
    the engine options of throughput.py's `args`.

    Raises (from `run`):
        RuntimeError: a request produced a number of tokens other than its output_len.
    """

    def __init__(self, ckpt: Path, requests: list[BenchRequest], args: Any, quantization: str):
        from moe_engine import LLM
        from moe_engine.sampling_params import SamplingParams

        self.name = engine_row_name(quantization)
        self.requests = requests
        self.llm = LLM(
            model=str(ckpt), dtype=args.dtype, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_memory=args.kv_cache_memory, quantization=quantization.removesuffix("-all"),
            quantized_layers="all" if quantization.endswith("-all") else "experts",
            kernel_backend=args.kernel_backend,
            **({"device": args.device} if args.device else {}),
        )
        self.compute_dtype = str(self.llm.engine.dtype).removeprefix("torch.")
        self.info = {"quantization": quantization, "kernel_backend": args.kernel_backend,
                     "threads": torch.get_num_threads()}
        self.prompts = [r.prompt_token_ids for r in requests]
        self.params = [
            SamplingParams(temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len,
                           ignore_eos=True)
            for r in requests
        ]

    def run(self, mode: str, return_token_ids: bool = False) -> RunResult:
        reqs = mode_requests(self.requests, mode)
        groups = [range(len(reqs))] if mode == "batched" else [[i] for i in range(len(reqs))]
        seconds, token_ids = 0.0, []
        for group in groups:
            prompts = [self.prompts[i] for i in group]
            params = [self.params[i] for i in group]
            t0 = time.perf_counter()
            outputs = self.llm.generate(prompts, params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            token_ids += [list(o.outputs[0].token_ids) for o in outputs]
        _check_lengths(self.name, token_ids, reqs)
        return RunResult(sum(len(t) for t in token_ids), seconds,
                         token_ids if return_token_ids else None)


class HFStaticRow(InProcessEngine):
    """`transformers` `generate` in `dtype`: `batched` runs static batches of `batch_size` in
    arrival order, left-padded, each batch to its longest output (only the requested tokens
    count); `batch1` runs each request alone (no padding)."""

    def __init__(self, ckpt: Path, requests: list[BenchRequest], dtype: str, batch_size: int):
        from transformers import AutoModelForCausalLM

        self.name = HF_STATIC
        self.requests = requests
        self.batch_size = batch_size
        self.compute_dtype = dtype
        self.info = {"batch_size": batch_size, "threads": torch.get_num_threads()}
        self.model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=DTYPES[dtype]).eval()
        self.pad = self.model.config.pad_token_id

    def _generate(self, batch: list[BenchRequest]) -> tuple[int, float]:
        """One left-padded batch to its longest output: (requested tokens, seconds).

        Raises:
            RuntimeError: generate returned another number of new tokens.
        """
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        t0 = time.perf_counter()
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
            min_new_tokens=longest, pad_token_id=self.pad,
        )
        seconds = time.perf_counter() - t0
        if out.shape[1] - width != longest:
            raise RuntimeError(f"{self.name}: {out.shape[1] - width} tokens, expected {longest}")
        return sum(r.output_len for r in batch), seconds

    def run(self, mode: str, return_token_ids: bool = False) -> RunResult:
        reqs = mode_requests(self.requests, mode)
        size = self.batch_size if mode == "batched" else 1
        tokens, seconds = 0, 0.0
        with torch.inference_mode():
            for i in range(0, len(reqs), size):
                n, dt = self._generate(reqs[i:i + size])
                tokens, seconds = tokens + n, seconds + dt
        return RunResult(tokens, seconds)
