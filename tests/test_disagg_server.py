"""Prefill/decode disaggregation served: `moe-serve --disaggregation-mode prefill` and
`decode` instances (tiny Qwen3-MoE, float32) behind `moe-router`, all on loopback, the KV
moved by Mooncake's TCP transfer engine. Greedy outputs through the router equal transformers
(prompts of 1..300 tokens, concurrently); both instances' blocks return to their start; a
prefill instance whose core is killed mid-request ends the request with UNAVAILABLE and the
decode instance gets its blocks back, and the router serves again once a prefill instance is
back on that address; refusals name the field. DeepSeek-V3 moves its MLA latents."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from fixtures import hf_greedy
from grpc_helpers import ServerThread, free_port, request, stats

from moe_engine.disagg.router import serve_router
from moe_engine.disagg.transfer import mooncake_unavailable_reason
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

pytestmark = [pytest.mark.skipif(mooncake_unavailable_reason() is not None,
                                 reason=str(mooncake_unavailable_reason())),
              pytest.mark.ci_must_run]

PROMPT_LENS = [1, 5, 16, 17, 40, 150, 300]
NUM_BLOCKS = 128


def _server(ckpt: Path, mode: str, prefix_caching: bool = False, port: int = 0
            ) -> ServerThread:
    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=512),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS,
                          enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
        disagg=DisaggConfig(mode=mode, timeout_s=10),
    )
    return ServerThread(config, ServerOptions(port=port, stats_poll_s=0.2))


class RouterThread:
    """moe-router on its own loop in a thread (`serve_router`'s keyword options: http_port,
    tokenizer, served_model_name)."""

    def __init__(self, prefill: list[str], decode: list[str], **options):
        self.port, self.options = free_port(), options
        self.loop = asyncio.new_event_loop()
        self.ready, self.stop = threading.Event(), None
        self.thread = threading.Thread(target=self._run, args=(prefill, decode), daemon=True)
        self.thread.start()
        assert self.ready.wait(30)
        self.address = f"127.0.0.1:{self.port}"

    def _run(self, prefill: list[str], decode: list[str]) -> None:
        asyncio.set_event_loop(self.loop)

        async def main() -> None:
            self.stop = asyncio.Event()
            ready = asyncio.Event()
            task = asyncio.create_task(serve_router(prefill, decode, port=self.port,
                                                    ready=ready, stop=self.stop,
                                                    **self.options))
            await ready.wait()
            self.ready.set()
            await task

        self.loop.run_until_complete(main())

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(30)


#: (checkpoint fixture, prefix caching): gpt-oss has sliding-window layers (window 8).
SPLITS = [("qwen3_ckpt", False), ("qwen3_ckpt", True), ("gpt_oss_ckpt", True),
          ("deepseek_v3_ckpt", False)]


@pytest.fixture(scope="module", params=SPLITS, ids=[f"{c}-prefix{int(p)}" for c, p in SPLITS])
def split(request) -> Iterator[tuple[ServerThread, ServerThread, RouterThread, Path]]:
    name, prefix = request.param
    ckpt = request.getfixturevalue(name)
    p, d = _server(ckpt, "prefill", prefix), _server(ckpt, "decode", prefix)
    router = RouterThread([p.address], [d.address])
    yield p, d, router, ckpt
    router.close()
    p.close()
    d.close()


@pytest.fixture(scope="module")
def stub(split) -> Iterator[pb_grpc.MoeEngineStub]:
    with grpc.insecure_channel(split[2].address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def _free(server: ServerThread) -> int:
    with grpc.insecure_channel(server.address) as channel:
        return stats(pb_grpc.MoeEngineStub(channel)).kv_blocks_free


def _wait_free(server: ServerThread, value: int, timeout_s: float = 15) -> int:
    deadline = time.monotonic() + timeout_s
    while (free := _free(server)) != value and time.monotonic() < deadline:
        time.sleep(0.1)
    return free


def _greedy_through(stub, ckpt: Path, servers: list[ServerThread]) -> None:
    """Prompts of PROMPT_LENS at once through the router: transformers' greedy tokens, and
    every instance's free blocks back to their start (twice: prefix-cache hits the second)."""
    start = [_free(s) for s in servers]
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in PROMPT_LENS]
    expected = hf_greedy(ckpt, prompts, 6)

    def one(prompt: list[int]) -> list[int]:
        req = request(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
        call = stub.Generate(req, timeout=120)
        tokens = [t for r in call for t in r.token_ids]
        meta = dict(call.trailing_metadata())
        assert float(meta["moe-prefill-s"]) > 0 and float(meta["moe-decode-s"]) >= 0
        return tokens

    for _ in range(2):
        with ThreadPoolExecutor(len(prompts)) as pool:
            got = list(pool.map(one, prompts))
        assert got == expected
        assert [_wait_free(s, f) for s, f in zip(servers, start, strict=True)] == start


def test_router_greedy_equals_transformers(split, stub) -> None:
    p, d, _, ckpt = split
    _greedy_through(stub, ckpt, [p, d])


def test_two_prefill_and_two_decode_instances(qwen3_ckpt: Path) -> None:
    servers = [_server(qwen3_ckpt, m) for m in ("prefill", "prefill", "decode", "decode")]
    router = RouterThread([s.address for s in servers[:2]], [s.address for s in servers[2:]])
    try:
        with grpc.insecure_channel(router.address) as channel:
            _greedy_through(pb_grpc.MoeEngineStub(channel), qwen3_ckpt, servers)
        for s in servers:  # least in flight: every instance served some of the requests
            with grpc.insecure_channel(s.address) as channel:
                assert stats(pb_grpc.MoeEngineStub(channel)).prompt_tokens_total > 0
    finally:
        router.close()
        for s in servers:
            s.close()


def test_instances_refuse_requests_not_from_the_router(split) -> None:
    p, d, _, _ = split
    for server, field in ((p, "kv_placement"), (d, "remote_first_token")):
        with grpc.insecure_channel(server.address) as channel:
            direct = pb_grpc.MoeEngineStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(direct.Generate(request([5, 6], max_tokens=2), timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert f"{field}:" in info.value.details()


def test_bad_input_through_the_router(split, stub) -> None:
    d = split[1]
    start = _free(d)
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request([5] * 600, max_tokens=4), timeout=30))
    assert info.value.code() in (grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.INVALID_ARGUMENT)
    assert "max_model_len" in info.value.details()
    assert _wait_free(d, start) == start


def test_killed_prefill_ends_request_and_frees_decode_blocks(qwen3_ckpt: Path) -> None:
    port = free_port()
    p, d = _server(qwen3_ckpt, "prefill", port=port), _server(qwen3_ckpt, "decode")
    router = RouterThread([p.address], [d.address])
    try:
        start = _free(d)
        with grpc.insecure_channel(router.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            os.kill(p.core_pid, signal.SIGSTOP)  # the prefill hangs mid-request, then dies
            result: dict = {}

            def call() -> None:
                t0 = time.monotonic()
                try:
                    list(stub.Generate(request(list(range(3, 303)), max_tokens=4), timeout=60))
                except grpc.RpcError as exc:
                    result["code"], result["s"] = exc.code(), time.monotonic() - t0
                    result["details"] = exc.details()

            caller = threading.Thread(target=call)
            caller.start()
            deadline = time.monotonic() + 20
            while _free(d) == start and time.monotonic() < deadline:
                time.sleep(0.05)
            assert _free(d) < start  # the decode side placed the prompt's blocks
            os.kill(p.core_pid, signal.SIGKILL)
            caller.join(60)
            assert result["code"] == grpc.StatusCode.UNAVAILABLE, result
            assert "prefill instance" in result["details"] and result["s"] < 60
            # the router's abort frees the parked blocks at once (not after the 10 s timeout)
            assert _wait_free(d, start, timeout_s=3) == start
            # a prefill instance back on the same address: the router serves again
            p.close()
            p = _server(qwen3_ckpt, "prefill", port=port)
            again = list(stub.Generate(request([5, 6, 7], max_tokens=3, temperature=0.0,
                                               ignore_eos=True), timeout=60))
            assert [t for r in again for t in r.token_ids] == hf_greedy(
                qwen3_ckpt, [[5, 6, 7]], 3)[0]
            assert _wait_free(d, start) == start
    finally:
        router.close()
        p.close()
        d.close()
