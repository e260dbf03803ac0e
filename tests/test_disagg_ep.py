"""Prefill/decode disaggregation with expert parallelism: a prefill instance and a decode
instance of 2 expert-parallel ranks each (tiny Qwen3-MoE, float32, Mooncake TCP on loopback)
behind moe-router. Each rank has its own KV cache and transfer engine: a decode rank places a
request in its blocks, the prefill rank that ran it writes there. Greedy outputs equal
transformers (prompts of 1..300 tokens, at once, so both decode ranks take requests), and every
rank's blocks on both sides return to their start; one EP-1 prefill feeds the EP-2 decode
instance too (the layouts of the ranks' caches match)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from fixtures import hf_greedy
from grpc_helpers import ServerThread, request, stats
from test_disagg_server import NUM_BLOCKS, PROMPT_LENS, RouterThread, _server

from moe_engine.disagg.transfer import mooncake_unavailable_reason
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

pytestmark = [pytest.mark.skipif(mooncake_unavailable_reason() is not None,
                                 reason=str(mooncake_unavailable_reason())),
              pytest.mark.ci_must_run]


def _ep_server(ckpt: Path, mode: str) -> ServerThread:
    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        parallel=ParallelConfig(ep_size=2, collective_timeout_s=60),
        disagg=DisaggConfig(mode=mode, timeout_s=10),
    )
    return ServerThread(config, ServerOptions(port=0, stats_poll_s=0.2), startup_timeout_s=300)


def _rank_free(server: ServerThread) -> list[int]:
    """Free KV blocks per rank (one entry for an instance without expert parallelism)."""
    with grpc.insecure_channel(server.address) as channel:
        s = stats(pb_grpc.MoeEngineStub(channel))
    return [r.kv_blocks_free for r in s.ranks] or [s.kv_blocks_free]


def _wait(server: ServerThread, value: list[int], timeout_s: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (free := _rank_free(server)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


@pytest.fixture(scope="module")
def ep_split(qwen3_ckpt: Path) -> Iterator[tuple[ServerThread, ServerThread, ServerThread]]:
    """(prefill EP 2, decode EP 2, prefill EP 1)."""
    servers = [_ep_server(qwen3_ckpt, "prefill"), _ep_server(qwen3_ckpt, "decode"),
               _server(qwen3_ckpt, "prefill")]
    yield servers[0], servers[1], servers[2]
    for s in servers:
        s.close()


@pytest.mark.parametrize("prefill_ep", [2, 1])
def test_ep_split_greedy_equals_transformers(ep_split, qwen3_ckpt: Path,
                                             prefill_ep: int) -> None:
    p = ep_split[0] if prefill_ep == 2 else ep_split[2]
    d = ep_split[1]
    router = RouterThread([p.address], [d.address])
    try:
        start_p, start_d = _rank_free(p), _rank_free(d)
        assert len(start_d) == 2 and len(start_p) == prefill_ep
        g = torch.Generator().manual_seed(9)
        prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
        expected = hf_greedy(qwen3_ckpt, prompts, 24)  # long enough to see both ranks busy
        taken = [0, 0]

        with grpc.insecure_channel(router.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)

            def one(prompt: list[int]) -> list[int]:
                call = stub.Generate(request(prompt, max_tokens=24, temperature=0.0,
                                             ignore_eos=True), timeout=120)
                return [t for r in call for t in r.token_ids]

            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(one, pr) for pr in prompts]
                deadline = time.monotonic() + 60
                while not all(f.done() for f in futures) and time.monotonic() < deadline:
                    for rank, (now, was) in enumerate(zip(_rank_free(d), start_d, strict=True)):
                        taken[rank] |= now < was  # the rank holds some request's blocks
                    time.sleep(0.01)
                got = [f.result() for f in futures]
        assert got == expected
        assert taken == [1, 1], f"both decode ranks should have taken requests: {taken}"
        assert _wait(d, start_d) == start_d and _wait(p, start_p) == start_p
    finally:
        router.close()
