"""Expert parallelism end to end: ranks started by torch's elastic launcher (gloo on this CPU),
served through gRPC.

- greedy token ids with --ep-size 2 and 4 equal `transformers` and --ep-size 1 (the offline
  `LLM` on the same prompts), with more concurrent requests than ranks and with a single
  request (so some ranks only run zero-token steps);
- killing a rank mid-generation brings the engine down within the collective timeout with a
  message naming the rank, and the client sees UNAVAILABLE, not a hang;
- an ep size that does not divide the experts, or exceeds them, fails at startup naming both.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from fixtures import hf_greedy, make_tiny_checkpoint
from grpc_helpers import ServerThread, stats, token_ids
from grpc_helpers import request as make_request

from moe_engine import LLM, SamplingParams
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

PROMPT_LENS = [3, 17, 40, 9, 64, 25]
MAX_NEW = [8, 6, 10, 7, 5, 9]
SINGLE_LEN, SINGLE_NEW = 21, 12


def _prompts() -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    single = torch.randint(3, 512, (SINGLE_LEN,), generator=g).tolist()
    return prompts, single


def _config(ckpt, ep_size: int, timeout_s: float = 30.0) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=256),
        cache=CacheConfig(num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48),
        parallel=ParallelConfig(ep_size=ep_size, collective_timeout_s=timeout_s),
    )


def _ep1_greedy(ckpt, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    llm = LLM(model=str(ckpt), max_model_len=256)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in max_new
    ]
    return [out.outputs[0].token_ids for out in llm.generate(prompts, params)]


@pytest.mark.parametrize(
    ("ckpt_name", "ep_size"),
    [
        ("qwen3_ckpt", 2),
        pytest.param("qwen3_ckpt", 4, marks=pytest.mark.slow),
        ("mixtral_ckpt", 2),
        pytest.param("mixtral_ckpt", 4, marks=pytest.mark.slow),
        ("gpt_oss_ckpt", 2),  # sliding window + sinks + expert biases, hybrid KV groups
    ],
)
def test_ep_greedy_equals_ep1_and_transformers(ckpt_name: str, ep_size: int, request) -> None:
    ckpt = request.getfixturevalue(ckpt_name)
    prompts, single = _prompts()
    expected = [hf_greedy(ckpt, [p], n)[0] for p, n in zip(prompts, MAX_NEW, strict=True)]
    expected_single = hf_greedy(ckpt, [single], SINGLE_NEW)[0]
    assert _ep1_greedy(ckpt, [*prompts, single], [*MAX_NEW, SINGLE_NEW]) == [
        *expected,
        expected_single,
    ]
    handle = ServerThread(_config(ckpt, ep_size), ServerOptions(port=0), startup_timeout_s=300)
    try:
        info = handle.server.engine.model_info
        assert info.ep_size == ep_size
        experts = info.experts_per_rank
        assert len(experts) == ep_size
        num_experts, top_k = info.num_experts, info.num_experts_per_tok
        assert sorted(e for rank in experts for e in rank) == list(range(num_experts))
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)

            def one(i: int) -> list[int]:
                req = make_request(
                    prompts[i], max_tokens=MAX_NEW[i], temperature=0.0, ignore_eos=True
                )
                return token_ids(list(stub.Generate(req, timeout=120)))

            with ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(one, range(len(prompts))))
            req = make_request(single, max_tokens=SINGLE_NEW, temperature=0.0, ignore_eos=True)
            got_single = token_ids(list(stub.Generate(req, timeout=120)))
            s = stats(stub)
            load = stub.GetExpertLoad(pb.GetExpertLoadRequest())
            window = stub.GetExpertLoad(pb.GetExpertLoadRequest(window=True))
            grpc_info = stub.GetModelInfo(pb.GetModelInfoRequest())
    finally:
        handle.close()
    assert grpc_info.ep_size == ep_size
    assert [list(r.experts) for r in grpc_info.experts_per_rank] == experts
    assert s.ep_size == ep_size and [r.rank for r in s.ranks] == list(range(ep_size))
    assert sum(r.kv_blocks_free for r in s.ranks) == s.kv_blocks_free
    assert 0 < s.min_dispatch_bytes <= s.dispatch_bytes_sent
    assert s.combine_bytes_sent > 0 and s.tokens_received > 0
    assert load.ep_size == ep_size and window.window_steps > 0
    assert got == expected
    assert got_single == expected_single
    assert s.kv_blocks_free == s.kv_blocks_total == 64 * ep_size
    assert s.num_running == s.num_waiting == 0
    # Every token of every layer was routed to top_k experts, wherever it ran.
    total_tokens = sum(PROMPT_LENS) + sum(MAX_NEW) - len(MAX_NEW) + SINGLE_LEN + SINGLE_NEW - 1
    for layer in load.layers:
        assert sum(layer.tokens_per_expert) == top_k * total_tokens
        # each rank's expert load: the pairs its experts processed, all pairs in all
        assert len(layer.tokens_per_rank) == ep_size
        assert sum(layer.tokens_per_rank) == top_k * total_tokens
        assert layer.rank_imbalance_ratio >= 1.0


def test_rank_killed_mid_generation_ends_server_with_unavailable(qwen3_ckpt) -> None:
    timeout_s = 10.0
    handle = ServerThread(_config(qwen3_ckpt, 2, timeout_s), ServerOptions(port=0), 300)
    try:
        engine = handle.server.engine
        victim = engine.model_info.rank_pids[1]
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            req = make_request([5, 6, 7, 8], max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = stub.Generate(req, timeout=120)
            next(stream)  # generating
            killed_at = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            elapsed = time.monotonic() - killed_at
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert elapsed < timeout_s + 5, elapsed
        deadline = time.monotonic() + timeout_s
        while not engine.dead.is_set() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.dead.is_set()
        assert "rank 1" in (engine.death_reason or ""), engine.death_reason
    finally:
        handle.close()


@pytest.mark.parametrize(("num_experts", "ep_size"), [(16, 3), (8, 16)])
def test_bad_ep_size_fails_at_startup_naming_both(
    tiny_ckpt_root, capsys, num_experts: int, ep_size: int
) -> None:
    from moe_engine.cli.serve import main

    ckpt = make_tiny_checkpoint("qwen3_moe", tiny_ckpt_root, num_experts=num_experts)
    started = time.monotonic()
    status = main(["--model", str(ckpt), "--ep-size", str(ep_size), "--port", "0"])
    err = capsys.readouterr().err
    assert status == 1
    assert f"--ep-size {ep_size}" in err and f"num_experts {num_experts}" in err, err
    assert time.monotonic() - started < 60  # refused before any rank starts


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting to be reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.slow
def test_hung_rank_ends_server_within_timeout_and_leaves_no_process(qwen3_ckpt) -> None:
    """A rank that stops answering (SIGSTOP: it cannot even run its watchdog) makes the other
    rank's collective time out; the server goes down naming it, and shutdown kills it."""
    timeout_s = 4.0
    handle = ServerThread(_config(qwen3_ckpt, 2, timeout_s), ServerOptions(port=0), 300)
    pids = handle.server.engine.model_info.rank_pids
    try:
        engine = handle.server.engine
        with grpc.insecure_channel(handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)
            req = make_request([5, 6, 7, 8], max_tokens=200, temperature=0.0, ignore_eos=True)
            stream = stub.Generate(req, timeout=120)
            next(stream)
            stopped_at = time.monotonic()
            os.kill(pids[1], signal.SIGSTOP)
            with pytest.raises(grpc.RpcError) as err:
                for _ in stream:
                    pass
            elapsed = time.monotonic() - stopped_at
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        assert elapsed < timeout_s + 10, elapsed
        assert "rank 1" in (engine.death_reason or ""), engine.death_reason
    finally:
        handle.close()
    deadline = time.monotonic() + 10
    while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(p) for p in pids), "a rank outlived the server"


_SILENT_EP_FRONT_END = """
import asyncio, sys, time
sys.path[:0] = [{tests!r}, {repo!r}]
from moe_engine.startup.config import EngineConfig, ModelConfig, ParallelConfig
from moe_engine.engine.client import EngineClient

async def main():
    client = EngineClient()
    config = EngineConfig(ModelConfig(model={ckpt!r}, max_model_len=128),
                          parallel=ParallelConfig(ep_size=2))
    await client.start(config, frontend_timeout_s={silence!r})
    print(client.core_pid, *client.model_info.rank_pids, flush=True)
    await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.slow
def test_ranks_exit_when_the_front_end_goes_silent(qwen3_ckpt, tmp_path) -> None:
    """A stopped front end (alive, so no rank sees its parent die) is silent: the ranks notice
    the missing heartbeats, say so, and exit; the launcher follows. (The ranks share one bound:
    the first to exit makes the launcher end the others, which may then not get to say it.)"""
    import subprocess
    import sys
    from pathlib import Path

    silence_s = 4.0
    tests = Path(__file__).resolve().parent
    script = tmp_path / "front_end.py"
    script.write_text(_SILENT_EP_FRONT_END.format(
        tests=str(tests), repo=str(tests.parent), ckpt=str(qwen3_ckpt), silence=silence_s
    ))
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        parent = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, text=True
        )
    pids: list[int] = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 3, log.read_text()[-3000:]  # the launcher and two ranks
        parent.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + silence_s + 20
        while not all(_gone(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(_gone(p) for p in pids), "a rank or the launcher outlived its front end"
        text = log.read_text()
        said = [f"rank {rank} (pid {pids[1 + rank]}) exits: no heartbeat" in text
                for rank in (0, 1)]
        assert any(said), text[-3000:]
        for rank in (0, 1):  # a rank that did not say it was ended by the launcher first
            pid = pids[1 + rank]
            assert said[rank] or f"Terminating process {pid}" in text, text[-3000:]
    finally:
        parent.kill()
        parent.wait()
        for pid in pids:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize(
    ("ep_size", "content", "expected"),
    [
        (2, None, "No such file"),
        (2, "{not json", "--expert-placement"),
        (2, '{"version": 1, "num_experts": 8, "ep_size": 4, "slots": [[0,1],[2,3],[4,5],[6,7]]}',
         "ep_size 4"),
        (1, '{"version": 1, "num_experts": 8, "ep_size": 2, "slots": [[0,1,2,3],[4,5,6,7]]}',
         "--ep-size > 1"),
    ],
)
def test_bad_placement_fails_before_any_rank_starts(
    qwen3_ckpt, tmp_path, capsys, ep_size: int, content: str | None, expected: str
) -> None:
    from moe_engine.cli.serve import main

    placement = tmp_path / "placement.json"
    if content is not None:
        placement.write_text(content)
    started = time.monotonic()
    status = main(
        ["--model", str(qwen3_ckpt), "--ep-size", str(ep_size), "--port", "0",
         "--expert-placement", str(placement)]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert status == 1 and expected in err and "Traceback" not in err, err
    assert time.monotonic() - started < 30
