"""Qwen3-Next (`Qwen3NextForCausalLM`: Gated DeltaNet linear attention + gated full attention)
served through gRPC, on the tiny float32 random checkpoint (tests/fixtures.py kind
"qwen3_next"); the offline `LLM` side is tests/test_qwen3_next.py.

One ep-1 server for the module: 8 batch slots (so 8 state slots), a 48-token step budget
(longer prompts are chunked, each chunk continuing the state the last left) and a pool of
NUM_BLOCKS blocks of 16 tokens, too few for the long prompts together (preemption).

- concurrent greedy streams for prompts of 1..300 tokens equal `transformers.generate`; some
  requests were preempted (their state dropped and recomputed) and afterwards every state
  slot and KV block is free;
- chaos: 200 requests cancelled client-side, cut by deadlines or aborted with the Abort RPC
  at seeded random points (preemptions among them), interleaved with 20 normal greedy
  requests whose ids equal transformers'; afterwards state slots and KV blocks are back at
  their start values and a greedy request is still served exactly;
- --ep-size 2 (ranks from the elastic launcher, gloo): greedy streams equal transformers,
  each rank has its own state pool (state_slots_total = 2 x max_num_seqs), all free after;
- --quantization mxfp4 experts: greedy streams equal transformers on the checkpoint whose
  experts went through MXFP4 and back (exact to undo);
- `moe-serve` refuses --enable-prefix-caching and --speculative-method at startup, exit 1,
  naming the flag and the linear-attention layers.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from chaos import run_with_chaos
from fixtures import dequantized_experts_copy, hf_greedy
from grpc_helpers import ServerThread, greedy_streams, request, stats, wait_idle

from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
)

VOCAB = 512
MAX_NUM_SEQS = 8
MAX_MODEL_LEN = 384
#: 24 blocks of 16 tokens: one max_model_len request fits (the startup check), the 8 prompts of
#: the greedy test (~40 blocks with their new tokens) do not, so some are preempted.
NUM_BLOCKS = 24
PROMPT_LENS = [1, 2, 3, 17, 48, 49, 100, 300]
MAX_NEW = [12, 10, 12, 9, 12, 11, 12, 10]
NUM_CHAOS = 200
NUM_NORMAL = 20
CHAOS_IN_FLIGHT = 16


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def _expected(ckpt: Path, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    return [hf_greedy(ckpt, [p], n)[0] for p, n in zip(prompts, max_new, strict=True)]


def _config(ckpt: Path, **fields) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=fields.pop("num_blocks", NUM_BLOCKS)),
        scheduler=SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=48),
        **fields,
    )


def _assert_all_free(s: pb.ServerStats, slots: int) -> None:
    assert s.num_running == s.num_waiting == 0, s
    assert s.state_slots_free == s.state_slots_total == slots, s
    assert s.kv_blocks_free == s.kv_blocks_total, s


@pytest.fixture(scope="module")
def server(qwen3_next_ckpt: Path) -> Iterator[ServerThread]:
    handle = ServerThread(_config(qwen3_next_ckpt), ServerOptions(port=0))
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.MoeEngineStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def test_greedy_streams_match_transformers_with_chunking_and_preemption(
    stub: pb_grpc.MoeEngineStub, qwen3_next_ckpt: Path
) -> None:
    prompts = _prompts(PROMPT_LENS, seed=17)
    expected = _expected(qwen3_next_ckpt, prompts, MAX_NEW)
    start = stats(stub)
    _assert_all_free(start, MAX_NUM_SEQS)
    assert start.kv_blocks_total == NUM_BLOCKS
    got = greedy_streams(stub, prompts, MAX_NEW)
    assert got == expected
    wait_idle(stub, NUM_BLOCKS)
    end = stats(stub)
    print(f"\ngreedy: {end.num_preemptions - start.num_preemptions} preemptions")
    assert end.num_preemptions > start.num_preemptions
    _assert_all_free(end, MAX_NUM_SEQS)


# ------------------------------------------------------------------------------ chaos


def _normal_requests() -> list[pb.GenerateRequest]:
    rng = random.Random(4321)
    return [
        request(
            [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 120))],
            max_tokens=rng.randint(4, 16),  # transformers' CPU fallback takes ~50 ms a token
            temperature=0.0,
            ignore_eos=True,
            request_id=f"normal-{i}",
        )
        for i in range(NUM_NORMAL)
    ]


def test_chaos_leaves_normal_requests_exact_and_every_slot_free(
    server: ServerThread, stub: pb_grpc.MoeEngineStub, qwen3_next_ckpt: Path
) -> None:
    normal = _normal_requests()
    expected = _expected(
        qwen3_next_ckpt, [list(r.prompt_ids.ids) for r in normal], [r.max_tokens for r in normal]
    )

    start = stats(stub)
    _assert_all_free(start, MAX_NUM_SEQS)
    t0 = time.monotonic()
    observed, outcomes = asyncio.run(run_with_chaos(
        server.address, normal, NUM_CHAOS, in_flight=CHAOS_IN_FLIGHT, chaos_seed=77,
        shuffle_seed=5, vocab=VOCAB, max_prompt=120, max_tokens=24,
        kinds=["cancel", "cancel", "timeout", "timeout", "abort", "normal"],
    ))  # fmt: skip
    elapsed = time.monotonic() - t0
    end = stats(stub)
    print(f"\nchaos: {NUM_CHAOS} disrupted + {NUM_NORMAL} normal in {elapsed:.1f} s: {outcomes}, "
          f"{end.num_preemptions - start.num_preemptions} preemptions")  # fmt: skip
    assert sum(outcomes.values()) == NUM_CHAOS
    assert {"cancelled", "timed out", "abort -> abort", "finished"} <= outcomes.keys(), outcomes
    for req, want, got in zip(normal, expected, observed, strict=True):
        assert got == want, req.request_id
    wait_idle(stub, start.kv_blocks_free)
    end = stats(stub)
    assert end.state_slots_free == start.state_slots_free == MAX_NUM_SEQS
    assert end.num_aborted > start.num_aborted
    assert server.server.engine.num_live_requests == 0
    assert not server.server.servicer._live
    # still serving, exactly
    prompt = _prompts([70], seed=3)[0]
    assert greedy_streams(stub, [prompt], [10]) == [hf_greedy(qwen3_next_ckpt, [prompt], 10)[0]]
    wait_idle(stub, start.kv_blocks_free)
    _assert_all_free(stats(stub), MAX_NUM_SEQS)


# ------------------------------------------------------------------------------ ep 2, mxfp4


def test_ep2_greedy_streams_match_transformers_with_a_state_pool_per_rank(
    qwen3_next_ckpt: Path,
) -> None:
    prompts = _prompts([3, 40, 130], seed=23)
    max_new = [10, 8, 9]
    expected = _expected(qwen3_next_ckpt, prompts, max_new)
    config = _config(
        qwen3_next_ckpt, num_blocks=64, parallel=ParallelConfig(ep_size=2, collective_timeout_s=30)
    )
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            got = greedy_streams(stub, prompts, max_new)
            wait_idle(stub, 2 * 64)
            s = stats(stub)
    finally:
        handle.close()
    assert got == expected
    assert s.ep_size == 2 and s.kv_blocks_total == 2 * 64
    _assert_all_free(s, 2 * MAX_NUM_SEQS)


def test_mxfp4_experts_match_transformers_on_dequantized_weights(
    qwen3_next_ckpt: Path, tmp_path: Path
) -> None:
    """MXFP4 dequantizes exactly on the CPU path: every greedy id equals transformers on the
    checkpoint whose routed experts went through MXFP4 and back (shared expert untouched)."""
    prompts = _prompts([1, 9, 40, 120], seed=31)
    max_new = [8] * len(prompts)
    ref_ckpt = dequantized_experts_copy(qwen3_next_ckpt, tmp_path, "mxfp4", 32)
    expected = _expected(ref_ckpt, prompts, max_new)
    # the quantization shows (the unquantized ids differ for every one of these prompts;
    # the 1-token one is the cheapest to check)
    assert hf_greedy(qwen3_next_ckpt, prompts[:1], max_new[0]) != expected[:1]
    config = _config(
        qwen3_next_ckpt, num_blocks=64, quant=QuantConfig(method="mxfp4", group_size=32)
    )
    handle = ServerThread(config, ServerOptions(port=0))
    try:
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            info = stub.GetModelInfo(pb.GetModelInfoRequest())
            got = greedy_streams(stub, prompts, max_new)
            wait_idle(stub, 64)
            s = stats(stub)
    finally:
        handle.close()
    assert info.expert_weight_format == "mxfp4"
    assert got == expected
    _assert_all_free(s, MAX_NUM_SEQS)


# ------------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--enable-prefix-caching"], "--enable-prefix-caching"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "2"],
         "--speculative-method ngram"),
    ],
)
def test_moe_serve_refuses_at_startup_naming_the_flag(
    qwen3_next_ckpt: Path, flags: list[str], named: str, capsys
) -> None:
    from moe_engine.cli.serve import main

    started = time.monotonic()
    status = main(["--model", str(qwen3_next_ckpt), *flags, "--port", "0"])
    err = capsys.readouterr().err
    assert status == 1, err
    assert named in err and "linear attention" in err, err
    assert time.monotonic() - started < 60
