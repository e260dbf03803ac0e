"""Through the gRPC server: concurrent greedy streams equal `transformers` token for token.

One server per architecture, with a 32-token budget (chunked prefill) and a KV pool of 22
blocks, too small for all requests at once. Whether eight concurrent streams overlap enough to
preempt depends on when they arrive, so the preemption check is its own test with an order that
forces it: a long request is decoding when a second one arrives, and the two together need more
blocks than the pool has.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from fixtures import hf_greedy
from grpc_helpers import ServerThread, greedy_streams, stats, token_ids
from grpc_helpers import request as make_request

from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

PROMPT_LENS = [1, 3, 16, 31, 64, 100, 200, 300]
MAX_NEW = [8, 12, 6, 10, 9, 5, 12, 7]


def _server(ckpt) -> ServerThread:
    """A server with a 32-token budget (chunked prefill) and 22 KV blocks of 16 tokens."""
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=320),
        cache=CacheConfig(num_blocks_override=22),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32),
    )
    return ServerThread(config, ServerOptions(port=0))


@pytest.mark.parametrize("ckpt_name", ["qwen3_ckpt", "mixtral_ckpt"])
def test_concurrent_greedy_streams_match_transformers(ckpt_name, request) -> None:
    ckpt = request.getfixturevalue(ckpt_name)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    expected = [hf_greedy(ckpt, [p], n)[0] for p, n in zip(prompts, MAX_NEW, strict=True)]
    handle = _server(ckpt)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            got = greedy_streams(stub, prompts, MAX_NEW, timeout_s=120)
            s = stats(stub)
    finally:
        handle.close()
    assert got == expected
    assert s.kv_blocks_free == s.kv_blocks_total


def test_preempted_stream_matches_transformers(qwen3_ckpt) -> None:
    """Request A (100 + 150 tokens: 16 blocks) decodes; B (100 + 100: 13 blocks) is sent once A
    streams its first token, so both run while A has 149 steps to go and together they
    outgrow the 22 blocks: the newest (B) is preempted, recomputed, and both stay exact."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (100,), generator=g).tolist() for _ in range(2)]
    max_new = [150, 100]
    expected = [hf_greedy(qwen3_ckpt, [p], n)[0] for p, n in zip(prompts, max_new, strict=True)]
    handle = _server(qwen3_ckpt)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            reqs = [
                make_request(p, max_tokens=n, temperature=0.0, ignore_eos=True)
                for p, n in zip(prompts, max_new, strict=True)
            ]
            stream_a = stub.Generate(reqs[0], timeout=120)
            first = next(stream_a)
            with ThreadPoolExecutor(1) as pool:
                b = pool.submit(lambda: token_ids(list(stub.Generate(reqs[1], timeout=120))))
                got_a = token_ids([first, *stream_a])
                got_b = b.result()
            s = stats(stub)
    finally:
        handle.close()
    assert [got_a, got_b] == expected
    assert s.num_preemptions >= 1
    assert s.kv_blocks_free == s.kv_blocks_total
