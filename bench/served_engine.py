"""moe-engine behind its own gRPC front end, as rows of `bench/throughput.py`.

`ServedRow` starts `moe-serve` on the bench checkpoint with the offline row's limits (dtype,
max_model_len, max_num_seqs, max_num_batched_tokens, kv cache, kernels, quantization) in its own
process, and runs the workload as a gRPC client from the driver's process, which is what
`moe-client batch` does: `batched` sends all requests at once (64 streams on one channel),
`batch1` one at a time. Two rows:

- `moe-engine-grpc`: every request `final_only` (one response per request when it finishes:
  a batch client's view, and what the OpenAI server asks for when `stream` is false);
- `moe-engine-grpc-stream`: every step's tokens streamed (one response per request per step:
  a chat client's view).

The client's CPU is the driver's and shares the machine's cores with the server, as a load
generator on the same machine does. Only the generate calls are timed (the channel is up).
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
from peer_runner import process_tree_cpu_s
from soak import start_server, wait_serving
from workload import BenchRequest, RunResult, mode_requests

from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

#: Row name -> whether its requests stream every step.
SERVED_ROWS = {"moe-engine-grpc": False, "moe-engine-grpc-stream": True}
STARTUP_TIMEOUT_S = 300.0


def serve_flags(args: Any, quantization: str) -> list[str]:
    """The moe-serve flags that give the offline row's engine (`local_engines.MoeEngineRow`)."""
    flags = ["--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
             "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--quantization", quantization, "--kernel-backend", args.kernel_backend]
    if args.kv_cache_memory:
        flags += ["--kv-cache-memory", str(args.kv_cache_memory)]
    return flags


class ServedRow:
    """`moe-serve` in a subprocess, driven over gRPC (`workload.BenchEngine`).

    Raises (from `__init__` and `run`):
        SystemExit: the server exited or was not SERVING within STARTUP_TIMEOUT_S.
        RuntimeError: a request failed or returned another number of tokens.
    """

    def __init__(self, name: str, ckpt: Path, requests: list[BenchRequest], args: Any,
                 quantization: str = "none", flags: list[str] | None = None,
                 stream: bool | None = None):
        """`flags`: moe-serve's flags instead of `serve_flags(args, quantization)` (then
        `args.dtype` only names the row's compute dtype); `stream`: instead of the row name's
        entry in SERVED_ROWS (a row of another name)."""
        self.name = name
        self.stream = SERVED_ROWS[name] if stream is None else stream
        self.requests = requests
        self.compute_dtype = args.dtype
        self.proc, self.address = start_server(
            str(ckpt), serve_flags(args, quantization) if flags is None else flags)
        self.info = {**({"quantization": quantization} if flags is None
                        else {"moe_serve_flags": " ".join(flags)}),
                     "final_only": not self.stream,
                     "client": "grpc.aio, one channel, in the driver's process"}
        try:
            asyncio.run(self._wait())
        except BaseException:
            self.close()
            raise

    async def _wait(self) -> None:
        async with grpc.aio.insecure_channel(self.address) as channel:
            await wait_serving(channel, self.proc, STARTUP_TIMEOUT_S)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float | None:
        """CPU seconds of the server's process tree (front end and engine core)."""
        return process_tree_cpu_s(self.proc.pid)

    def _request(self, req: BenchRequest, logprobs: int | None = None) -> pb.GenerateRequest:
        return pb.GenerateRequest(
            prompt_ids=pb.TokenIds(ids=req.prompt_token_ids), max_tokens=req.output_len,
            min_tokens=req.output_len, temperature=0.0, ignore_eos=True,
            final_only=not self.stream, **({"logprobs": logprobs} if logprobs else {}),
        )

    def first_logprobs(self, prompts: list[list[int]], k: int) -> list[dict[int, float]]:
        """Per prompt, alone and greedy: the first output token's top-`k` logprobs
        (token id -> logprob; the chosen token's included)."""
        async def go() -> list[dict[int, float]]:
            async with grpc.aio.insecure_channel(self.address) as channel:
                stub = pb_grpc.MoeEngineStub(channel)
                out = []
                for prompt in prompts:
                    got: dict[int, float] = {}
                    async for response in stub.Generate(self._request(BenchRequest(prompt, 1),
                                                                      logprobs=k)):
                        for lp in response.logprobs[:1]:
                            got[lp.token_id] = lp.logprob
                            got.update({t.token_id: t.logprob for t in lp.top_logprobs})
                    out.append(got)
                return out
        return asyncio.run(go())

    def run(self, mode: str, return_token_ids: bool = False,
            output_len: int | None = None) -> RunResult:
        """The workload once in `mode`; `output_len`: every batch-1 request that many tokens
        instead of its own."""
        reqs = mode_requests(self.requests, mode)
        if mode == "batch1" and output_len:
            reqs = [BenchRequest(r.prompt_token_ids, output_len) for r in reqs]
        seconds, token_ids = asyncio.run(self._run(reqs, mode == "batched"))
        for i, (ids, req) in enumerate(zip(token_ids, reqs, strict=True)):
            if len(ids) != req.output_len:
                raise RuntimeError(f"{self.name}: request {i}: {len(ids)} tokens, expected "
                                   f"{req.output_len}")
        return RunResult(sum(len(t) for t in token_ids), seconds,
                         token_ids if return_token_ids else None)

    async def _run(self, reqs: list[BenchRequest], together: bool
                   ) -> tuple[float, list[list[int]]]:
        async with grpc.aio.insecure_channel(self.address) as channel:
            await channel.channel_ready()
            stub = pb_grpc.MoeEngineStub(channel)

            async def one(req: BenchRequest) -> list[int]:
                ids: list[int] = []
                async for response in stub.Generate(self._request(req)):
                    ids.extend(response.token_ids)
                return ids

            t0 = time.perf_counter()
            if together:
                token_ids = list(await asyncio.gather(*(one(r) for r in reqs)))
            else:
                token_ids = [await one(r) for r in reqs]
            return time.perf_counter() - t0, token_ids

    def close(self) -> None:
        """Stop the server (SIGTERM drains; killed after 30 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
