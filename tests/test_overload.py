"""Overload and chaos over loopback, on the tiny real Qwen3-MoE checkpoint.

One server for the module: 16 batch slots, a waiting queue of WAITING_LIMIT
(--max-waiting-requests), 512 KV blocks of 16 tokens.

- Load: 500 concurrent streaming requests (16 greedy tokens each), sent once 32 long streams
  fill every batch slot and the queue; the long streams are cancelled by their clients once the
  burst has met the full queue (so a burst that reaches the server slowly on a fast machine still
  meets it); every burst request completes or is refused
  with RESOURCE_EXHAUSTED naming the limit; none is lost or duplicated; the counters in
  GetServerStats and Prometheus agree; afterwards every KV block is free and, after a warm-up
  round, another round grows neither the front end's resident memory (this process, which also
  runs the clients) nor the engine core's by more than RSS_BOUND_MIB.
- Chaos: 200 requests cancelled, timed out or aborted at random (seeded) points, interleaved
  with 40 normal greedy requests: each normal request gets exactly the tokens it gets without
  chaos, every stream that gets a final response gets exactly one, and nothing leaks.
"""

from __future__ import annotations

import asyncio
import random
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from chaos import run_with_chaos
from grpc_helpers import ServerThread, free_port, request, stats, wait_idle

from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

VOCAB = 512
NUM_BLOCKS = 512
MAX_NUM_SEQS = 16
WAITING_LIMIT = 16
NUM_LOAD = 500
LOAD_TOKENS = 16
#: Long streams that fill every batch slot and the queue before each burst; they run until the
#: burst's first refusal and are then cancelled, so their length only has to outlast that.
NUM_BLOCKERS = MAX_NUM_SEQS + WAITING_LIMIT
MAX_MODEL_LEN = 1024
BLOCKER_TOKENS = MAX_MODEL_LEN - 8
#: Resident memory growth allowed over one load round after a warm-up round (MiB, per process).
RSS_BOUND_MIB = 48
NUM_CHAOS = 200
NUM_NORMAL = 40
#: Requests in flight during the chaos test: under MAX_NUM_SEQS + WAITING_LIMIT (the queue limit
#: counts only requests beyond free batch slots), so no
#: normal request is refused even while aborted ones are still being removed.
CHAOS_IN_FLIGHT = 24


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path) -> Iterator[ServerThread]:
    config = EngineConfig(
        model=ModelConfig(str(qwen3_ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(
            max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=256, max_waiting=WAITING_LIMIT
        ),
    )
    options = ServerOptions(port=0, metrics_port=free_port(), stats_poll_s=0.1)
    handle = ServerThread(config, options)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.MoeEngineStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of a process (MiB): psutil when installed, else /proc VmRSS."""
    try:
        import psutil

        return psutil.Process(None if pid == "self" else int(pid)).memory_info().rss / 2**20
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise RuntimeError(f"no VmRSS in /proc/{pid}/status") from None


async def _stream(
    stub, req: pb.GenerateRequest, refused: asyncio.Event | None = None
) -> tuple[str, object, str, list]:
    """One stream to its end: (request_id, status code or None, details, responses); sets
    `refused` when the server refuses it with RESOURCE_EXHAUSTED."""
    responses: list = []
    try:
        async for r in stub.Generate(req, timeout=120):
            responses.append(r)
    except grpc.aio.AioRpcError as err:
        if refused is not None and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            refused.set()
        return req.request_id, err.code(), err.details() or "", responses
    return req.request_id, None, "", responses


async def _fill_batch_and_queue(stub, tag: str) -> list[asyncio.Task]:
    """Start NUM_BLOCKERS long streams and wait until they fill every batch slot and the whole
    waiting queue."""
    tasks = [
        asyncio.create_task(_stream(stub, request(
            [3 + i], max_tokens=BLOCKER_TOKENS, temperature=0.0, ignore_eos=True,
            request_id=f"{tag}-blocker-{i}",
        )))
        for i in range(NUM_BLOCKERS)
    ]  # fmt: skip
    deadline = time.monotonic() + 30
    while True:
        s = await stub.GetServerStats(pb.GetServerStatsRequest())
        if (s.num_running, s.num_waiting) == (MAX_NUM_SEQS, WAITING_LIMIT):
            return tasks
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.002)


async def _load_round(address: str, tag: str) -> tuple[list, list]:
    """NUM_LOAD concurrent streams behind a full batch and queue; the blockers are cancelled at
    the burst's first refusal. Returns (blockers' outcomes: CancelledError or a result, burst
    results as (request_id, status code or None, details, responses))."""
    rng = random.Random(tag)
    async with grpc.aio.insecure_channel(address) as channel:
        aio_stub = pb_grpc.MoeEngineStub(channel)
        blockers = await _fill_batch_and_queue(aio_stub, tag)
        burst = [
            request(
                [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 12))],
                max_tokens=LOAD_TOKENS, temperature=0.0, ignore_eos=True, request_id=f"{tag}-{i}",
            )
            for i in range(NUM_LOAD)
        ]  # fmt: skip
        refused = asyncio.Event()
        burst_tasks = [asyncio.create_task(_stream(aio_stub, r, refused)) for r in burst]
        await asyncio.wait_for(refused.wait(), timeout=60)
        for task in blockers:
            task.cancel()
        results = await asyncio.gather(*burst_tasks)
        return list(await asyncio.gather(*blockers, return_exceptions=True)), list(results)


def _check_round(results: list, tokens: int = LOAD_TOKENS) -> tuple[int, int]:
    """Every request completed once or was refused; returns (completed, rejected)."""
    assert len({rid for rid, *_ in results}) == len(results)
    completed = rejected = 0
    for rid, code, details, responses in results:
        if code is None:
            assert responses and all(r.request_id == rid for r in responses)
            assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
            assert responses[-1].finish_reason == "length"
            assert sum(len(r.token_ids) for r in responses) == tokens
            assert responses[-1].usage.completion_tokens == tokens
            completed += 1
        else:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (rid, code, details)
            assert not responses
            assert f"is {WAITING_LIMIT}" in details and "--max-waiting-requests" in details
            rejected += 1
    return completed, rejected


def _metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def test_load_500_streams_complete_or_are_rejected(
    server: ServerThread, stub: pb_grpc.MoeEngineStub
) -> None:
    start = stats(stub)
    assert start.kv_blocks_free == NUM_BLOCKS
    core_pid = server.server.engine.core_pid
    totals = [0, 0]
    rss: list[tuple[float, float]] = []
    t0 = time.monotonic()
    for round_index in range(2):  # a warm-up round, then the measured one
        blockers, results = asyncio.run(_load_round(server.address, f"load{round_index}"))
        assert all(isinstance(b, asyncio.CancelledError) for b in blockers), blockers
        completed, rejected = _check_round(results)
        assert rejected > 0 and completed >= WAITING_LIMIT, (completed, rejected)
        totals[0] += completed
        totals[1] += rejected
        wait_idle(stub, NUM_BLOCKS)
        rss.append((rss_mib(), rss_mib(core_pid)))
    elapsed = time.monotonic() - t0
    end = stats(stub)
    assert end.num_finished - start.num_finished == totals[0]
    assert end.num_rejected - start.num_rejected == totals[1]
    assert end.num_aborted - start.num_aborted == 2 * NUM_BLOCKERS  # the cancelled blockers
    time.sleep(0.3)  # a few metrics polls
    port = server.server.options.metrics_port
    assert _metric(port, "moe_engine_num_requests_rejected_total") == end.num_rejected
    assert _metric(port, "moe_engine_num_requests_aborted_total") == end.num_aborted
    assert _metric(port, "moe_engine_num_preemptions_total") == end.num_preemptions
    (front0, core0), (front1, core1) = rss
    print(
        f"\nload: 2 x {NUM_LOAD} requests in {elapsed:.1f} s, {totals[0]} completed, "
        f"{totals[1]} rejected; RSS front end {front0:.0f} -> {front1:.0f} MiB, "
        f"core {core0:.0f} -> {core1:.0f} MiB"
    )
    assert front1 - front0 <= RSS_BOUND_MIB
    assert core1 - core0 <= RSS_BOUND_MIB


# ------------------------------------------------------------------------------ chaos


def _normal_requests() -> list[pb.GenerateRequest]:
    rng = random.Random(1234)
    return [
        request(
            [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 40))],
            max_tokens=rng.randint(4, 24),
            temperature=0.0,
            ignore_eos=True,
            request_id=f"normal-{i}",
        )
        for i in range(NUM_NORMAL)
    ]


def test_chaos_leaves_normal_requests_exact_and_no_leak(
    server: ServerThread, stub: pb_grpc.MoeEngineStub
) -> None:
    normal = _normal_requests()

    def run(with_chaos: bool) -> tuple[list[list[int]], dict[str, int]]:
        return asyncio.run(run_with_chaos(
            server.address, normal, NUM_CHAOS if with_chaos else 0, in_flight=CHAOS_IN_FLIGHT,
            chaos_seed=99, shuffle_seed=7, vocab=VOCAB, max_prompt=60, max_tokens=120,
            kinds=["cancel", "timeout", "abort", "abort-twice"],
        ))  # fmt: skip

    start = stats(stub)
    reference, _ = run(with_chaos=False)
    t0 = time.monotonic()
    observed, outcomes = run(with_chaos=True)
    elapsed = time.monotonic() - t0
    print(f"\nchaos: {NUM_CHAOS} disrupted + {NUM_NORMAL} normal in {elapsed:.1f} s: {outcomes}")
    assert sum(outcomes.values()) == NUM_CHAOS
    assert {"cancelled", "timed out", "abort -> abort"} <= outcomes.keys(), outcomes
    for req, ref, got in zip(normal, reference, observed, strict=True):
        assert len(ref) == req.max_tokens
        assert got == ref, req.request_id
    wait_idle(stub, start.kv_blocks_free)
    end = stats(stub)
    assert end.num_rejected == start.num_rejected
    assert end.num_aborted > start.num_aborted
    assert server.server.engine.num_live_requests == 0
    assert not server.server.servicer._live
