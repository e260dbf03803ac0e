"""Parallel sampling over gRPC (GenerateRequest.n): one call streams n completions tagged by
`index`, greedy completions equal transformers, the prompt's KV blocks are held once (a pool
too small for n unshared copies serves them without preemption), seeds give distinct
reproducible completions, Abort ends all of them, and a bad n is refused naming the field.
One server for the module."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading

import grpc
import pytest
from fixtures import hf_greedy
from grpc_helpers import ServerThread, stats, wait_idle
from grpc_helpers import request as make_request

from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig

NUM_BLOCKS = 12
PROMPT = [random.Random(5).randrange(3, 500) for _ in range(64)]  # 4 full blocks of 16


@pytest.fixture(scope="module")
def server(qwen3_ckpt):
    config = EngineConfig(
        model=ModelConfig(model=str(qwen3_ckpt), max_model_len=128),
        cache=CacheConfig(num_blocks_override=NUM_BLOCKS),
    )
    handle = ServerThread(config, ServerOptions(port=0))
    yield handle
    handle.close()


@pytest.fixture()
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def completions(responses: list[pb.GenerateResponse]) -> dict[int, list[int]]:
    """Token ids per completion index; each completion has exactly one finished response."""
    by_index: dict[int, list[int]] = {}
    finished: dict[int, int] = {}
    for r in responses:
        by_index.setdefault(r.index, []).extend(r.token_ids)
        finished[r.index] = finished.get(r.index, 0) + r.finished
    assert all(count == 1 for count in finished.values()), finished
    return by_index


def test_greedy_n4_shares_the_prompt_blocks_and_equals_transformers(stub, qwen3_ckpt) -> None:
    """Unshared, 4 x (64 + 8 tokens) need 20 blocks of 16 and the pool has 12: only shared
    prompt blocks (3, plus 2 of each completion's own) let all four run without preemption."""
    expected = hf_greedy(qwen3_ckpt, [PROMPT], 8)[0]
    before = stats(stub).num_preemptions
    req = make_request(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, n=4)
    got = completions(list(stub.Generate(req, timeout=120)))
    assert got == {i: expected for i in range(4)}
    assert stats(stub).num_preemptions == before
    wait_idle(stub, NUM_BLOCKS)


def test_seeded_completions_differ_repeat_and_match_seed_plus_index(stub) -> None:
    def run(n: int, seed: int) -> dict[int, list[int]]:
        req = make_request(PROMPT[:20], max_tokens=12, temperature=1.0, seed=seed,
                           ignore_eos=True, n=n)
        return completions(list(stub.Generate(req, timeout=120)))

    first = run(3, 1234)
    assert len({tuple(v) for v in first.values()}) == 3
    assert run(3, 1234) == first
    assert run(1, 1236)[0] == first[2]


def test_abort_ends_every_completion_and_frees_their_blocks(stub) -> None:
    req = make_request(PROMPT[:20], max_tokens=100, ignore_eos=True, n=3, request_id="par-ab")
    stream = stub.Generate(req, timeout=120)
    first = next(stream)
    aborted = stub.Abort(pb.AbortRequest(request_id="par-ab"), timeout=30)
    rest = [first, *stream]
    assert aborted.aborted, aborted.detail
    finals = [r for r in rest if r.finished]
    assert sorted(r.index for r in finals) == [0, 1, 2]
    assert {r.finish_reason for r in finals} == {"abort"}
    wait_idle(stub, NUM_BLOCKS)


@pytest.mark.parametrize("n", [0, 129])
def test_bad_n_is_invalid_argument_naming_n(stub, n: int) -> None:
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(make_request([5, 6], max_tokens=2, n=n), timeout=30))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details().startswith("n"), err.value.details()
    assert str(n) in err.value.details()


def test_moe_client_generate_n_prints_each_completion(server) -> None:
    def cli(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "moe_engine.cli.client", "--server", server.address,
             "generate", "--prompt-ids", "5,6,7", "--max-tokens", "4", "--ignore-eos",
             "--temperature", "0", "--n", "2", *extra],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    proc = cli("--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert [c["index"] for c in data["completions"]] == [0, 1]
    assert data["completions"][0]["token_ids"] == data["completions"][1]["token_ids"]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 8}
    plain = cli()
    assert plain.returncode == 0, plain.stderr
    assert [line.split()[0] for line in plain.stdout.splitlines()] == ["[0]", "[1]"]


def test_concurrent_n_requests_leave_the_pool_whole(stub) -> None:
    results: list[dict[int, list[int]]] = []

    def one(i: int) -> None:
        req = make_request(PROMPT[i : i + 10], max_tokens=6, temperature=0.0, n=2,
                           ignore_eos=True)
        results.append(completions(list(stub.Generate(req, timeout=120))))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 4 and all(r[0] == r[1] for r in results)
    wait_idle(stub, NUM_BLOCKS)


def test_moe_client_batch_with_n_and_a_refused_line_exits_1(server, tmp_path) -> None:
    """A batch line with n = 2 reports its completions; a refused one (n = 0) is counted in
    the summary's num_errors and makes the exit status 1."""
    path = tmp_path / "requests.jsonl"
    path.write_text('{"prompt_ids": [5, 6], "max_tokens": 3, "n": 2, "ignore_eos": true}\n'
                    '{"prompt_ids": [5, 6], "max_tokens": 3, "n": 0}\n')
    proc = subprocess.run(
        [sys.executable, "-m", "moe_engine.cli.client", "--server", server.address, "batch",
         str(path)], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    by_index = {line["index"]: line for line in lines if "index" in line}
    assert [c["index"] for c in by_index[0]["completions"]] == [0, 1]
    assert by_index[1]["error"] == {"code": "INVALID_ARGUMENT",
                                    "message": "n must be in [1, 128], got 0"}
    assert lines[-1]["summary"] and lines[-1]["num_errors"] == 1
    assert lines[-1]["output_tokens"] == 6
