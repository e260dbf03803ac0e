"""Soak test: steady gRPC load on `moe-serve` for minutes, reporting memory and latency over time.

Not part of CI. Starts `moe-serve` on `--model` (or uses a running `--server`), keeps
`--concurrency` streaming requests in flight for `--duration` seconds (random prompt ids and
output lengths from a seeded RNG, greedy, ignore EOS; a `--cancel-fraction` of them cancelled
part-way, to exercise the abort path), and every `--interval` seconds prints one JSON line:

    t_s, requests (completed), cancelled, errors {code: n}, output_tokens_per_s,
    e2e_s / ttft_s {p50, p90, p99}, kv_blocks_free, kv_blocks_total, num_running, num_waiting,
    rss_mib {front_end, core} (when the server is started here; "core" sums the front end's
    child processes: the engine core and multiprocessing's resource tracker)

then a summary line (`"summary": true`) with the growth of each process's resident memory from
the first window to the last and the p50/p99 latency of the first and last windows. Leaks show
as resident memory that keeps growing window after window, or free KV blocks below the total
once the load stops (`kv_blocks_free_after` in the summary).

    python bench/soak.py --model /path/to/ckpt --duration 600            # 10 minutes
    python bench/soak.py --server 127.0.0.1:50051 --duration 120 --concurrency 64
    python bench/soak.py --duration 60 --interval 5 -- --max-num-seqs 16  # demo model, extra
                                                                          # moe-serve flags
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.security import API_KEY_ENV, api_key_from_env, auth_metadata


@dataclass
class Window:
    """What happened in one reporting interval."""

    e2e_s: list[float] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cancelled: int = 0
    errors: Counter = field(default_factory=Counter)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50 / p90 / p99 of `values` (seconds), None when empty."""
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    if len(values) == 1:
        values = values * 2
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": round(q[49], 4), "p90": round(q[89], 4), "p99": round(q[98], 4)}


def rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` (MiB) from /proc/PID/status, None when unreadable."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def child_pids(pid: int) -> list[int]:
    """Pids whose parent is `pid` (the engine core runs in one)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def start_server(model: str, extra: list[str]) -> tuple[subprocess.Popen, str]:
    """`moe-serve --model MODEL EXTRA` on a free loopback port; returns (process, address)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "moe_engine.cli.serve", "--model", model, "--grpc-port",
           str(port), "--port", "0"]
    proc = subprocess.Popen([*cmd, "--log-level", "WARNING", *extra])
    return proc, f"127.0.0.1:{port}"


async def wait_serving(
    channel: grpc.aio.Channel, proc: subprocess.Popen | None, timeout_s: float
) -> None:
    """Poll the health service until SERVING (SystemExit if the server dies or is too slow)."""
    stub = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"moe-serve exited with status {proc.returncode}")
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.5)
    raise SystemExit(f"the server was not SERVING within {timeout_s:.0f} s")


class Soak:
    """Keeps `concurrency` requests in flight and collects per-window figures."""

    def __init__(self, stub: pb_grpc.MoeEngineStub, args: argparse.Namespace, vocab: int):
        self.stub = stub
        self.args = args
        self.vocab = vocab
        self.rng = random.Random(args.seed)
        self.window = Window()
        self.metadata = auth_metadata(args.api_key) or None
        self.stop_at = 0.0

    def make_request(self) -> tuple[pb.GenerateRequest, int | None]:
        """A request, and after how many responses to cancel it (None: never)."""
        a = self.args
        req = pb.GenerateRequest(
            max_tokens=self.rng.randint(1, a.max_tokens), temperature=0.0, ignore_eos=True
        )
        n = self.rng.randint(1, a.max_prompt_len)
        req.prompt_ids.ids.extend(self.rng.randrange(3, self.vocab) for _ in range(n))
        cancel = self.rng.randint(1, 4) if self.rng.random() < a.cancel_fraction else None
        return req, cancel

    async def one(self) -> None:
        req, cancel_after = self.make_request()
        start = time.perf_counter()
        ttft = None
        seen = 0
        call = self.stub.Generate(req, timeout=self.args.request_timeout, metadata=self.metadata)
        try:
            async for response in call:
                seen += 1
                if ttft is None and response.token_ids:
                    ttft = time.perf_counter() - start
                self.window.output_tokens += len(response.token_ids)
                if cancel_after is not None and seen >= cancel_after and not response.finished:
                    call.cancel()
                    self.window.cancelled += 1
                    return
        except grpc.aio.AioRpcError as err:
            self.window.errors[err.code().name] += 1
            return
        self.window.e2e_s.append(time.perf_counter() - start)
        if ttft is not None:
            self.window.ttft_s.append(ttft)

    async def worker(self) -> None:
        while time.monotonic() < self.stop_at:
            await self.one()

    def take_window(self) -> Window:
        window, self.window = self.window, Window()
        return window


async def report(soak: Soak, server_pid: int | None, t0: float, elapsed_s: float) -> dict:
    window = soak.take_window()
    stats = await soak.stub.GetServerStats(
        pb.GetServerStatsRequest(), timeout=30, metadata=soak.metadata
    )
    line = {
        "t_s": round(time.monotonic() - t0, 1),
        "requests": len(window.e2e_s),
        "cancelled": window.cancelled,
        "errors": dict(window.errors),
        "output_tokens_per_s": round(window.output_tokens / elapsed_s, 1),
        "e2e_s": percentiles(window.e2e_s),
        "ttft_s": percentiles(window.ttft_s),
        "kv_blocks_free": stats.kv_blocks_free,
        "kv_blocks_total": stats.kv_blocks_total,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
    }
    if server_pid is not None:
        cores = child_pids(server_pid)
        line["rss_mib"] = {
            "front_end": rss_mib(server_pid),
            "core": sum(filter(None, (rss_mib(p) for p in cores))) if cores else None,
        }
    print(json.dumps(line), flush=True)
    return line


async def run(args: argparse.Namespace) -> int:
    proc = None
    address = args.server
    if address is None:
        proc, address = start_server(args.model, args.serve_args)
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await wait_serving(channel, proc, args.startup_timeout)
            stub = pb_grpc.MoeEngineStub(channel)
            md = auth_metadata(args.api_key) or None
            info = await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, metadata=md)
            soak = Soak(stub, args, info.vocab_size)
            t0 = time.monotonic()
            soak.stop_at = t0 + args.duration
            workers = [asyncio.create_task(soak.worker()) for _ in range(args.concurrency)]
            lines = []
            last = t0
            while time.monotonic() < soak.stop_at:
                await asyncio.sleep(min(args.interval, max(0.0, soak.stop_at - time.monotonic())))
                now = time.monotonic()
                lines.append(await report(soak, proc.pid if proc else None, t0, now - last))
                last = now
            await asyncio.gather(*workers)
            await asyncio.sleep(1.0)  # let the last aborts reach the engine
            final = await stub.GetServerStats(pb.GetServerStatsRequest(), timeout=30, metadata=md)
            print(json.dumps(summary(lines, final)), flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
    return 0


def summary(lines: list[dict], final: pb.ServerStats) -> dict:
    """Memory growth and latency drift from the first window to the last."""
    first, last = lines[0], lines[-1]
    out: dict = {
        "summary": True,
        "windows": len(lines),
        "requests": sum(x["requests"] for x in lines),
        "cancelled": sum(x["cancelled"] for x in lines),
        "errors": dict(sum((Counter(x["errors"]) for x in lines), Counter())),
        "e2e_p50_s_first_last": [first["e2e_s"]["p50"], last["e2e_s"]["p50"]],
        "e2e_p99_s_first_last": [first["e2e_s"]["p99"], last["e2e_s"]["p99"]],
        "kv_blocks_free_after": final.kv_blocks_free,
        "kv_blocks_total": final.kv_blocks_total,
    }
    if "rss_mib" in first:
        for key in ("front_end", "core"):
            a, b = first["rss_mib"][key], last["rss_mib"][key]
            out[f"rss_{key}_mib_first_last"] = [a, b]
            out[f"rss_{key}_growth_mib"] = None if a is None or b is None else round(b - a, 1)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--server", default=None, help="HOST:PORT of a running server (default: start one)"
    )
    p.add_argument("--model", default="demo", help="checkpoint for the server started here")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 300)")
    p.add_argument("--interval", type=float, default=10.0, help="seconds per report (default 10)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight (default 32)")
    p.add_argument("--max-tokens", type=int, default=64, help="outputs of 1..N tokens (default 64)")
    p.add_argument("--max-prompt-len", type=int, default=128, help="prompts of 1..N ids")
    p.add_argument("--cancel-fraction", type=float, default=0.1, help="requests cancelled early")
    p.add_argument("--request-timeout", type=float, default=120.0, help="deadline per request (s)")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to SERVING")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--api-key", default=api_key_from_env(), help=f"API key (default ${API_KEY_ENV})"
    )
    p.add_argument("serve_args", nargs="*", help="after --: extra moe-serve flags")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
