"""Online serving benchmark: a gRPC load generator against a running `moe-serve`.

Sends the `mixed-64` request distribution (../shared/BENCH.md: prompts of `randint(32, 256)`
token ids drawn with `randint(3, 8191)`, outputs of `randint(16, 256)` tokens, greedy, ignore
EOS, `min_tokens = max_tokens`; `random.Random(seed)`, so the first 64 requests at seed 0 on a
vocabulary of >= 8192 ids are exactly mixed-64) to `moe_engine.v1.MoeEngine/Generate` over one
`grpc.aio` channel, as many concurrent streams as the arrivals ask for, and reports per run:

- request throughput (completed requests / run seconds), output and total tokens/s;
- TTFT (send to the first response carrying tokens), TPOT per request
  ((e2e - TTFT) / (output tokens - 1)), ITL (the gap between consecutive streamed responses
  carrying tokens), e2e latency: mean, p50, p90, p99 (linear interpolation, numpy's default);
- goodput: requests per second that met both SLOs (TTFT <= --slo-ttft, TPOT <= --slo-tpot),
  the definition of DistServe (Zhong et al., OSDI 2024) and vLLM's `benchmark_serving.py`;
- failures by gRPC status code (`INCOMPLETE`: a stream that ended OK with fewer tokens than
  asked, e.g. aborted while the server drained);
- the generator's own cost: CPU seconds of this process, microseconds per streamed response,
  and how late the Poisson sends left against their schedule (`max_send_lag_s`).

Arrivals: `--request-rate R [R ...]` sends requests as a Poisson process of R requests/s (one
run per rate, in turn; `inf` sends all at once); `--concurrency N [N ...]` keeps N requests in
flight (closed loop). Every run sends the same requests (seeded) unless
`--new-prompts-per-run`; arrival gaps come from their own seeded generator.

    python bench/serve.py --request-rate 0.25 0.5 1 --num-requests 32
    python bench/serve.py --concurrency 8 --num-requests 64 --json
    python bench/serve.py --request-rate 1 --shared-prefix 0.5 --output prefix.json
    python bench/serve.py --request-rate 0.5 1 2 --plot latency.png --server host:50051 \\
        --api-key "$KEY" --tls-ca ca.pem

Exit status: 0 when every request completed, 1 when some failed (the report still comes),
2 for a bad flag or a server that cannot be reached.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from moe_engine.cli.argtypes import int_at_least, positive_seconds  # noqa: E402
from moe_engine.cli.connection import connection_from_args
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.security import API_KEY_ENV

#: mixed-64's ranges (BENCH.md): prompt lengths, prompt ids, output lengths (inclusive).
PROMPT_LEN_RANGE = (32, 256)
TOKEN_ID_RANGE = (3, 8191)
OUTPUT_LEN_RANGE = (16, 256)
#: Requests per run by default: the whole of mixed-64.
DEFAULT_NUM_REQUESTS = 64
INCOMPLETE = "INCOMPLETE"
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class ServeRequest:
    """One request: prompt token ids (int, each in [3, vocab)) and the exact output length."""

    prompt_token_ids: list[int]
    output_len: int


def sample_requests(
    num_requests: int, vocab_size: int, seed: int = 0, shared_prefix: float = 0.0,
    long_prompts: tuple[float, int] | None = None,
) -> list[ServeRequest]:
    """`num_requests` requests of the mixed-64 distribution (BENCH.md), in arrival order.

    The draws are mixed-64's, in its order (`random.Random(seed)`: a prompt length, that many
    ids in [3, 8191], an output length), continued past 64 requests. On a vocabulary smaller
    than 8192 each id maps to `3 + (id - 3) % (vocab_size - 3)`, so prompt and output lengths
    do not depend on the model; from 8192 ids up nothing changes (seed 0: exactly mixed-64).

    With `shared_prefix` F > 0 the first `int(F * len(prompt))` ids of every prompt are the
    same ids (a common prefix drawn from its own seeded generator), for prefix-caching runs;
    lengths are unchanged.

    With `long_prompts` (F, L), each request is, with probability F (its own seeded generator,
    so the mixed-64 draws are unchanged), a long one: its prompt is extended with further ids
    to L tokens (a mix of long and short prompts, as disaggregation is meant for).

    Raises:
        ValueError: num_requests < 1, vocab_size < 4, shared_prefix outside [0, 1), or a
            long-prompt fraction outside (0, 1] or length below 1.
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4 (ids start at 3), got {vocab_size}")
    if not 0.0 <= shared_prefix < 1.0:
        raise ValueError(f"shared_prefix must be in [0, 1), got {shared_prefix}")
    if long_prompts is not None and not (0 < long_prompts[0] <= 1 and long_prompts[1] >= 1):
        raise ValueError(f"long_prompts must be (fraction in (0, 1], length >= 1), "
                         f"got {long_prompts}")
    low, high = TOKEN_ID_RANGE
    span = min(high, vocab_size - 1) - low + 1

    def draw(rng: random.Random) -> int:
        return low + (rng.randint(low, high) - low) % span

    rng = random.Random(seed)
    prefix_rng = random.Random(f"{seed}:shared-prefix")
    long_rng = random.Random(f"{seed}:long-prompts")
    common = [draw(prefix_rng) for _ in range(PROMPT_LEN_RANGE[1])]
    requests = []
    for _ in range(num_requests):
        prompt = [draw(rng) for _ in range(rng.randint(*PROMPT_LEN_RANGE))]
        output_len = rng.randint(*OUTPUT_LEN_RANGE)
        if long_prompts is not None and long_rng.random() < long_prompts[0]:
            prompt += [draw(long_rng) for _ in range(long_prompts[1] - len(prompt))]
        k = int(shared_prefix * len(prompt))
        prompt[:k] = common[:k]
        requests.append(ServeRequest(prompt, output_len))
    return requests


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Send times (seconds from the run's start) of a Poisson process of `rate` requests/s:
    exponential gaps of mean 1 / rate from `random.Random(f"{seed}:arrivals")`, the first
    request at 0. `rate` inf: all at 0.

    Raises:
        ValueError: rate <= 0.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0, got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(f"{seed}:arrivals")
    times, t = [], 0.0
    for _ in range(num_requests):
        times.append(t)
        t += rng.expovariate(rate)
    return times


def to_proto(req: ServeRequest) -> pb.GenerateRequest:
    """The GenerateRequest for `req`: greedy, ignore EOS, min_tokens = max_tokens."""
    message = pb.GenerateRequest(
        max_tokens=req.output_len, min_tokens=req.output_len, temperature=0.0, ignore_eos=True
    )
    message.prompt_ids.ids.extend(req.prompt_token_ids)
    message.prompt_ids.SetInParent()
    return message


@dataclass
class RequestResult:
    """What one request measured (seconds, from `time.perf_counter`).

    Attributes:
        prompt_len, output_len: the request's prompt length and requested output length.
        output_tokens: tokens received.
        ttft_s: send to the first response carrying tokens (None: none came).
        e2e_s: send to the end of the stream (None: failed).
        tpot_s: (e2e - ttft) / (output_tokens - 1) (None: failed or < 2 tokens).
        itl_s: gaps between consecutive responses carrying tokens.
        chunks: responses received.
        error: gRPC status code name, INCOMPLETE, or None when it completed.
        message: the status details of a failure.
    """

    index: int
    prompt_len: int
    output_len: int
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    chunks: int = 0
    error: str | None = None
    message: str = ""


@dataclass(frozen=True)
class Chunk:
    """One streamed response as the load generator sees it: `tokens` it carries (timed as an
    arrival when > 0), and `total`, the request's exact output tokens when the response says
    (an HTTP stream's final usage chunk); None otherwise."""

    tokens: int
    total: int | None = None


class TargetError(Exception):
    """A request the server refused or broke off: `code` (a gRPC status name, or "HTTP 400"),
    `message` (the server's details)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


#: Streams one request: yields its `Chunk`s, raises `TargetError` for a failure.
StreamFn = Callable[[ServeRequest], AsyncIterator[Chunk]]


def grpc_stream(
    stub: pb_grpc.MoeEngineStub, metadata: tuple[tuple[str, str], ...], timeout: float | None
) -> StreamFn:
    """`Generate` over gRPC (`to_proto`), one `Chunk` per response."""

    async def stream(req: ServeRequest) -> AsyncIterator[Chunk]:
        try:
            call = stub.Generate(to_proto(req), timeout=timeout, metadata=metadata or None)
            async for response in call:
                yield Chunk(len(response.token_ids))
        except grpc.aio.AioRpcError as err:
            raise TargetError(err.code().name, err.details() or "") from None

    return stream


async def run_one(stream: StreamFn, index: int, req: ServeRequest) -> RequestResult:
    """Stream one request and time it. Never raises for a refused request (recorded)."""
    result = RequestResult(index, len(req.prompt_token_ids), req.output_len)
    start = time.perf_counter()
    last = start
    try:
        async for chunk in stream(req):
            now = time.perf_counter()
            result.chunks += 1
            if chunk.tokens:
                if result.ttft_s is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.output_tokens += chunk.tokens
            if chunk.total is not None:
                result.output_tokens = chunk.total
    except TargetError as err:
        result.error, result.message = err.code, err.message
        return result
    result.e2e_s = time.perf_counter() - start
    if result.output_tokens != req.output_len:
        result.error = INCOMPLETE
        result.message = f"{result.output_tokens} of {req.output_len} tokens"
        return result
    if result.output_tokens > 1 and result.ttft_s is not None:
        result.tpot_s = (result.e2e_s - result.ttft_s) / (result.output_tokens - 1)
    return result


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 of `values` (seconds); all None when empty."""
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64)
    out = {"mean": float(arr.mean())}
    for p, v in zip(PERCENTILES, np.percentile(arr, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    return out


def run_metrics(
    results: list[RequestResult],
    duration_s: float,
    slo_ttft_s: float,
    slo_tpot_s: float,
) -> dict[str, Any]:
    """The run's figures from its requests (see the module docstring), `duration_s` being the
    first send to the last stream's end (seconds).

    A completed request with one output token has no TPOT and meets the TPOT SLO.
    """
    ok = [r for r in results if r.error is None]
    failures = Counter(r.error for r in results if r.error is not None)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_len for r in ok)
    good = [
        r for r in ok
        if r.ttft_s is not None and r.ttft_s <= slo_ttft_s
        and (r.tpot_s is None or r.tpot_s <= slo_tpot_s)
    ]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(sorted(failures.items())),
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(prompt_tokens + output_tokens),
        "ttft_s": summarize([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_s": summarize([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_s": summarize([g for r in ok for g in r.itl_s]),
        "e2e_s": summarize([r.e2e_s for r in ok if r.e2e_s is not None]),
        "slo_met": len(good),
        "slo_attainment": len(good) / len(results) if results else 0.0,
        "goodput": per_s(len(good)),
    }


async def run_load(
    stream: StreamFn,
    requests: list[ServeRequest],
    *,
    rate: float | None,
    concurrency: int | None,
    seed: int,
) -> tuple[list[RequestResult], float, float]:
    """Send `requests` as a Poisson process of `rate` req/s, or with `concurrency` in flight.

    Returns:
        (results in request order, duration in seconds from the first send to the last
        stream's end, the largest lateness of a Poisson send against its schedule in seconds).
    """
    results: list[RequestResult | None] = [None] * len(requests)
    max_lag = 0.0

    async def one(i: int) -> None:
        results[i] = await run_one(stream, i, requests[i])

    start = time.perf_counter()
    if concurrency is not None:
        next_index = iter(range(len(requests)))

        async def worker() -> None:
            for i in next_index:  # shared iterator: each index goes to one worker
                await one(i)

        await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    else:
        assert rate is not None
        tasks = []
        for i, at in enumerate(poisson_arrivals(len(requests), rate, seed)):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            max_lag = max(max_lag, time.perf_counter() - (start + at))
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration, max_lag


async def wait_for_model(
    stub: pb_grpc.MoeEngineStub, metadata: tuple[tuple[str, str], ...], wait_s: float
) -> pb.ModelInfo:
    """GetModelInfo, retried while the server is UNAVAILABLE (still loading) for `wait_s` s.

    Raises:
        grpc.aio.AioRpcError: another status, or UNAVAILABLE after `wait_s` seconds.
    """
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await stub.GetModelInfo(
                pb.GetModelInfoRequest(), timeout=max(1.0, deadline - time.monotonic()),
                metadata=metadata or None, wait_for_ready=True,
            )
        except grpc.aio.AioRpcError as err:
            retry = err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if not retry or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(0.5)


def _http_client(args: argparse.Namespace) -> Any:
    """An `httpx.AsyncClient` on --http-server (with the API key), or a null context."""
    if not args.http_server:
        return contextlib.nullcontext(None)
    import httpx

    key = args.api_key or os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    base = args.http_server if "://" in args.http_server else f"http://{args.http_server}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    return httpx.AsyncClient(base_url=base, headers=headers, timeout=args.timeout,
                             limits=limits)


def _http_side() -> tuple[Any, Any]:
    """bench/serve_http.py's `http_stream` and `wait_for_http` (imported beside this file, as
    it imports this one's types under the name this module runs as)."""
    import importlib.util

    here = Path(__file__).resolve().parent
    sys.modules.setdefault("serve", sys.modules[__name__])
    spec = importlib.util.spec_from_file_location("serve_http", here / "serve_http.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.http_stream, module.wait_for_http


def _fmt_rate(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Every run the flags ask for; the JSON report (see `main`)."""
    credentials, metadata = connection_from_args(args)
    out = sys.stderr if args.json else sys.stdout
    if credentials is None:
        channel_cm = grpc.aio.insecure_channel(args.server)
    else:
        channel_cm = grpc.aio.secure_channel(args.server, credentials)
    async with channel_cm as channel, _http_client(args) as http:
        stub = pb_grpc.MoeEngineStub(channel)
        info = await wait_for_model(stub, metadata, args.wait_s)
        if http is None:
            stream = grpc_stream(stub, metadata, args.timeout)
        else:
            http_stream, wait_for_http = _http_side()
            served = await wait_for_http(http, args.wait_s)
            stream = http_stream(http, served)
        base = sample_requests(args.num_requests, info.vocab_size, args.seed, args.shared_prefix,
                               args.long_prompts)
        too_long = sum(
            len(r.prompt_token_ids) + r.output_len > info.max_model_len for r in base
        )
        if too_long:
            print(
                f"warning: {too_long} of {len(base)} requests exceed max_model_len "
                f"{info.max_model_len} (prompt + output) and will fail with OUT_OF_RANGE",
                file=sys.stderr,
            )
        if args.warmup:
            warm_rng = random.Random(f"{args.seed}:warmup")
            warm = [
                ServeRequest([warm_rng.randint(3, info.vocab_size - 1) for _ in range(32)], 16)
                for _ in range(args.warmup)
            ]
            await run_load(stream, warm, rate=None, concurrency=len(warm), seed=args.seed)
        plans: list[tuple[float | None, int | None]] = (
            [(r, None) for r in args.request_rate] if args.request_rate
            else [(None, c) for c in args.concurrency]
        )
        runs = []
        for k, (rate, concurrency) in enumerate(plans):
            requests = (
                sample_requests(args.num_requests, info.vocab_size, args.seed + k,
                                args.shared_prefix, args.long_prompts)
                if args.new_prompts_per_run else base
            )
            label = (f"rate {_fmt_rate(rate)} req/s" if rate is not None
                     else f"concurrency {concurrency}")
            print(f"run {k + 1}/{len(plans)}: {label}, {len(requests)} requests ...",
                  file=sys.stderr, flush=True)
            cpu0 = time.process_time()
            results, duration, max_lag = await run_load(
                stream, requests, rate=rate, concurrency=concurrency, seed=args.seed
            )
            cpu = time.process_time() - cpu0
            metrics = run_metrics(results, duration, args.slo_ttft, args.slo_tpot)
            chunks = sum(r.chunks for r in results)
            run = {
                "mode": "rate" if rate is not None else "concurrency",
                "request_rate": None if rate is None else _fmt_rate(rate) if math.isinf(rate)
                else rate,
                "concurrency": concurrency,
                **metrics,
                "client": {
                    "cpu_s": cpu,
                    "cpu_fraction": cpu / duration if duration > 0 else 0.0,
                    "responses": chunks,
                    "us_per_response": 1e6 * cpu / chunks if chunks else None,
                    "max_send_lag_s": max_lag,
                },
                "requests": [
                    {k2: v for k2, v in asdict(r).items() if k2 != "itl_s"} for r in results
                ],
            }
            runs.append(run)
            print(format_run(run, args.slo_ttft, args.slo_tpot), file=out, flush=True)
    prompt_total = sum(len(r.prompt_token_ids) for r in base)
    return {
        "server": args.server,
        "frontend": "http" if args.http_server else "grpc",
        "http_server": args.http_server,
        "model": {
            "model": info.model, "architecture": info.architecture, "dtype": info.dtype,
            "vocab_size": info.vocab_size, "max_model_len": info.max_model_len,
            "max_num_seqs": info.max_num_seqs,
            "max_num_batched_tokens": info.max_num_batched_tokens,
        },
        "workload": {
            "name": ("mixed-64" if args.num_requests == DEFAULT_NUM_REQUESTS
                     else f"mixed-64 distribution, {args.num_requests} requests")
            + (f", {args.long_prompts[0]:g} of them with {args.long_prompts[1]}-token prompts"
               if args.long_prompts else ""),
            "num_requests": args.num_requests,
            "seed": args.seed,
            "shared_prefix": args.shared_prefix,
            "long_prompts": list(args.long_prompts) if args.long_prompts else None,
            "new_prompts_per_run": args.new_prompts_per_run,
            "prompt_tokens": prompt_total,
            "output_tokens": sum(r.output_len for r in base),
            "warmup_requests": args.warmup,
        },
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "runs": runs,
    }


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{1000 * value:.1f}"


def format_run(run: dict[str, Any], slo_ttft: float, slo_tpot: float) -> str:
    """A readable block for one run: counts, throughput, goodput and a latency table (ms)."""
    label = (f"request rate {run['request_rate']} req/s (Poisson)" if run["mode"] == "rate"
             else f"concurrency {run['concurrency']} (closed loop)")
    failures = ", ".join(f"{k} {v}" for k, v in run["failures"].items()) or "none"
    client = run["client"]
    lines = [
        f"== {label}: {run['completed']}/{run['num_requests']} completed in "
        f"{run['duration_s']:.1f} s; failures: {failures}",
        f"   request throughput {run['request_throughput']:.3f} req/s, output "
        f"{run['output_throughput']:.1f} tok/s, total {run['total_token_throughput']:.1f} tok/s",
        f"   goodput {run['goodput']:.3f} req/s ({run['slo_met']} requests with TTFT <= "
        f"{slo_ttft:g} s and TPOT <= {1000 * slo_tpot:g} ms)",
        f"   client: {client['cpu_s']:.2f} CPU s ({100 * client['cpu_fraction']:.1f}% of one "
        f"core), max send lag {1000 * client['max_send_lag_s']:.1f} ms",
        f"   {'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s = run[f"{name}_s"]
        lines.append(f"   {name.upper():<6}" + "".join(
            f"{_ms(s[k]):>10}" for k in ("mean", "p50", "p90", "p99")))
    return "\n".join(lines)


def format_summary(report: dict[str, Any]) -> str:
    """One line per run: the figures to compare across rates (latencies in ms)."""
    head = (f"{'rate':>6} {'conc':>5} {'ok/n':>7} {'req/s':>7} {'out tok/s':>9} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} {'TPOT p99':>9} {'ITL p99':>8} "
            f"{'E2E p50':>8} {'E2E p99':>8} {'goodput':>8}")
    lines = [head]
    for run in report["runs"]:
        rate = "-" if run["request_rate"] is None else str(run["request_rate"])
        conc = "-" if run["concurrency"] is None else str(run["concurrency"])
        lines.append(
            f"{rate:>6} {conc:>5} {run['completed']:>3}/{run['num_requests']:<3} "
            f"{run['request_throughput']:>7.3f} {run['output_throughput']:>9.1f} "
            f"{_ms(run['ttft_s']['p50']):>9} {_ms(run['ttft_s']['p99']):>9} "
            f"{_ms(run['tpot_s']['p50']):>9} {_ms(run['tpot_s']['p99']):>9} "
            f"{_ms(run['itl_s']['p99']):>8} {_ms(run['e2e_s']['p50']):>8} "
            f"{_ms(run['e2e_s']['p99']):>8} {run['goodput']:>8.3f}"
        )
    w = report["workload"]
    slo = report["slo"]
    return (
        f"{report['model']['model']} ({report['model']['dtype']}) at {report['server']}: "
        f"{w['name']}, seed {w['seed']}, shared prefix {w['shared_prefix']:g}; "
        f"goodput SLO TTFT <= {slo['ttft_s']:g} s, TPOT <= {1000 * slo['tpot_s']:g} ms; "
        f"latencies in ms\n" + "\n".join(lines)
    )


def plot(report: dict[str, Any], path: Path) -> None:
    """p50 and p99 TTFT and TPOT against request rate (PNG via matplotlib's Agg backend).

    The x value is the offered rate of a Poisson run, and the achieved request throughput of a
    concurrency or `inf` run.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = []
    for run in report["runs"]:
        rate = run["request_rate"]
        x = rate if isinstance(rate, (int, float)) else run["request_throughput"]
        points.append((x, run))
    points.sort(key=lambda p: p[0])
    xs = [p[0] for p in points]
    slo = report["slo"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in ((axes[0], "ttft_s", "TTFT"), (axes[1], "tpot_s", "TPOT")):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ys = [run[metric][q] for _, run in points]
            ax.plot(xs, [np.nan if y is None else y for y in ys], style, label=f"{title} {q}")
        ax.axhline(slo[metric], color="red", lw=0.8, ls=":", label=f"SLO {slo[metric]:g} s")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{title} (s)")
        ax.set_title(f"{title} vs request rate")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(f"{report['model']['model']}: {report['workload']['name']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or inf, got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or inf), got {text!r}")
    return value



def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _long_prompts(text: str) -> tuple[float, int]:
    """`F:LEN` for --long-prompts: a fraction in (0, 1] and a length >= 1 (tokens)."""
    frac, sep, length = text.partition(":")
    try:
        value = (float(frac), int(length))
    except ValueError:
        value = None
    if not sep or value is None or not (0 < value[0] <= 1 and value[1] >= 1):
        raise argparse.ArgumentTypeError(
            f"expected F:LEN with F in (0, 1] and LEN >= 1 tokens (e.g. 0.125:768), got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench/serve.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default %(default)s)")
    p.add_argument("--http-server", default=None, metavar="HOST:PORT",
                   help="send the requests to this moe-serve --port (HTTP) instead, as streamed "
                        "POST /v1/completions (the OpenAI API); the model's facts still come "
                        "from GetModelInfo at --server, the same process")
    p.add_argument("--api-key", default=None,
                   help=f"API key sent with every call (default ${API_KEY_ENV}, else none)")
    p.add_argument("--tls", action="store_true", help="connect with TLS (the system's CAs)")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the server's certificate (TLS)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    load = p.add_mutually_exclusive_group(required=True)
    load.add_argument("--request-rate", type=_rate, nargs="+", metavar="R",
                      help="Poisson arrivals, requests/s (inf: all at once); one run per rate")
    load.add_argument("--concurrency", type=int_at_least(1), nargs="+", metavar="N",
                      help="closed loop: N requests in flight; one run per value")
    p.add_argument("--num-requests", type=int_at_least(1), default=DEFAULT_NUM_REQUESTS,
                   help="requests per run (default %(default)s: mixed-64)")
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--shared-prefix", type=_fraction, default=0.0, metavar="F",
                   help="fraction of each prompt that is a prefix common to all (default 0)")
    p.add_argument("--long-prompts", type=_long_prompts, default=None, metavar="F:LEN",
                   help="make a fraction F of the requests long: their prompts extended to "
                        "LEN tokens (e.g. 0.125:768; default none)")
    p.add_argument("--new-prompts-per-run", action="store_true",
                   help="run k draws its prompts with seed + k (no prefix-cache reuse between "
                        "runs); default: every run sends the same requests")
    p.add_argument("--slo-ttft", type=positive_seconds, default=2.0, help="goodput SLO, seconds")
    p.add_argument("--slo-tpot", type=positive_seconds, default=0.1, help="goodput SLO, seconds")
    p.add_argument("--warmup", type=int, default=1,
                   help="short requests (32 ids, 16 tokens) sent before the runs (default 1)")
    p.add_argument("--timeout", type=positive_seconds, default=None,
                   help="deadline per request, seconds (default none)")
    p.add_argument("--wait-s", type=positive_seconds, default=60.0,
                   help="how long to wait for the server to answer GetModelInfo (default 60)")
    p.add_argument("--json", action="store_true",
                   help="print the JSON report on stdout (the tables go to stderr)")
    p.add_argument("--output", type=Path, default=None, help="write the JSON report here")
    p.add_argument("--plot", type=Path, default=None,
                   help="PNG of p50/p99 TTFT and TPOT against request rate")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; see the module docstring for the exit status.

    The JSON report: `server`, `model` (GetModelInfo fields), `workload` (num_requests, seed,
    shared_prefix, requested prompt/output token totals), `slo`, and `runs`, one per rate or
    concurrency, each with the counts, `failures` by code, throughputs, `ttft_s`, `tpot_s`,
    `itl_s`, `e2e_s` ({mean, p50, p90, p99}, seconds), `goodput`, `client` (the generator's
    own cost) and `requests` (one entry per request, in order).
    """
    args = build_parser().parse_args(argv)
    if args.warmup < 0:
        print("bench/serve.py: error: --warmup must be >= 0", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(benchmark(args))
    except (ValueError, TimeoutError) as exc:  # bad key / TLS flags; no HTTP answer
        print(f"bench/serve.py: error: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as err:
        hint = (f" (no server answered within --wait-s {args.wait_s:g} s)"
                if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED else "")
        print(f"bench/serve.py: error: {args.server}: {err.code().name}: {err.details()}{hint}",
              file=sys.stderr)
        return 2
    table = format_summary(report)
    print(table, file=sys.stderr if args.json else sys.stdout, flush=True)
    if args.output is not None:
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    if args.plot is not None:
        plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    return 1 if any(run["failed"] for run in report["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
