"""Speculative decoding (n-gram drafts) through the gRPC server: concurrent greedy streams equal
transformers at ep 1 and ep 2 (ranks in lockstep while they carry different draft counts),
GetServerStats and /metrics carry the spec_decode counters, and every KV block comes back."""

from __future__ import annotations

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from fixtures import hf_greedy
from grpc_helpers import ServerThread, free_port, stats, token_ids
from grpc_helpers import request as make_request

from moe_engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.spec_decode.config import SpeculativeConfig

MAX_NEW = 16


def _prompts() -> list[list[int]]:
    """Prompts that repeat spans (n-gram drafts find matches) and one that does not."""
    g = torch.Generator().manual_seed(5)
    span = torch.randint(3, 200, (7,), generator=g).tolist()
    noise = torch.randint(3, 200, (30,), generator=g).tolist()
    return [span * 4, noise[:9] + span + noise[9:20] + span, noise, span[:3] * 5 + noise[:4]]


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    assert m is not None, f"{name} not in /metrics"
    return float(m[1])


@pytest.mark.parametrize("ep_size", [1, 2])
def test_greedy_streams_equal_transformers_with_drafts(qwen3_ckpt, ep_size) -> None:
    prompts = _prompts()
    want = hf_greedy(qwen3_ckpt, prompts, MAX_NEW)
    config = EngineConfig(
        model=ModelConfig(model=str(qwen3_ckpt), max_model_len=128),
        cache=CacheConfig(block_size=4, num_blocks_override=80),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=24),
        parallel=ParallelConfig(ep_size=ep_size),
        speculative=SpeculativeConfig("ngram", 3, 1, 3, 0),
    )
    handle = ServerThread(
        config, ServerOptions(port=0, metrics_port=free_port()), startup_timeout_s=300
    )
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)

            def one(p: list[int]) -> list[int]:
                req = make_request(p, max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
                return token_ids(list(stub.Generate(req, timeout=120)))

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(one, prompts))
            s = stats(stub)
            port = handle.server.options.metrics_port
            deadline = time.monotonic() + 15
            while True:  # the metrics follow the engine's stats poll
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
                text = text.read().decode()
                if _metric(text, "moe_engine_spec_decode_num_drafts") or (
                    time.monotonic() > deadline
                ):
                    break
                time.sleep(0.2)
    finally:
        handle.close()
    assert got == want
    assert s.spec_decode_num_drafts > 0
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    assert sum(s.spec_decode_num_accepted_tokens_per_pos) == s.spec_decode_num_accepted_tokens
    assert s.spec_decode_mean_acceptance_length == pytest.approx(
        1 + s.spec_decode_num_accepted_tokens / s.spec_decode_num_drafts
    )
    assert s.kv_blocks_free == s.kv_blocks_total
    for field in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert _metric(text, f"moe_engine_spec_decode_{field}") == getattr(
            s, f"spec_decode_{field}"
        )
