"""Speculative decoding (n-gram drafts) through the server, and its sampling distribution.

- gRPC end to end, one server per module configured by `moe-serve`'s own flags
  (`--speculative-method ngram --num-speculative-tokens 3 --ngram-min 1 --ngram-max 3
  --speculative-disable-by-batch-size 0`), the tiny Qwen3-MoE with a byte-level BPE: concurrent
  greedy streams equal transformers; each streamed response is exactly one engine step, so the
  responses' sizes must equal the steps that greedy verification of n-gram drafts takes (a
  greedy request's drafts are a function of its tokens: `_plan` replays them), and the
  GetServerStats / Prometheus counters must equal that replay's counts; streamed deltas equal
  the unary (HTTP /v1/completions) result; stop strings and stop token ids that land inside a
  multi-token step cut exactly where they do in an engine without drafts;
- bad speculative flags make `moe-serve` exit at once naming the field and the limit;
- expert parallelism (2 ranks, gloo) with drafts: greedy equals transformers while the ranks
  carry different draft counts per step, and every KV block comes back;
- at temperature 1 (engine level), with a proposer whose drafts are accepted and rejected at
  both draft positions, the marginals of generated tokens 2..4 equal those of a
  non-speculative engine (two-sample chi-square).
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from fixtures import hf_greedy
from grpc_helpers import ServerThread, free_port, stats, wait_idle
from grpc_helpers import request as make_request
from http_helpers import tokenizer_checkpoint
from prometheus_client.parser import text_string_to_metric_families

from moe_engine.cli.serve import build_parser, engine_config_from_args, server_options_from_args
from moe_engine.core.build import build_engine_core
from moe_engine.core.detokenizer import IncrementalDetokenizer
from moe_engine.core.engine_core import EngineCore
from moe_engine.core.tokenizer import load_tokenizer
from moe_engine.runner.spec_decode.drafter import DRAFT_COOLDOWN_STEPS
from moe_engine.runner.spec_decode.ngram import propose_ngram_reference
from moe_engine.sampling_params import SamplingParams
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from moe_engine.startup.spec_config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig

REPO = Path(__file__).resolve().parent.parent
K, NGRAM_MIN, NGRAM_MAX = 3, 1, 3
MAX_TOKENS = 24
#: KV blocks per rank: 16 requests of <= 66 tokens (5 blocks each) fit, so nothing is ever
#: preempted (a recompute would change the steps `_plan` predicts).
NUM_BLOCKS = 128
#: The budget holds 16 requests x (1 + K) decode tokens and every prompt at once: drafts are
#: never cut by it and no prefill is chunked (a chunk that leaves exactly the prompt's last
#: token makes that token's step verify drafts too, which `_plan` does not predict: when it
#: happens depends on arrival times).
MAX_NUM_SEQS, BUDGET = 16, 512
MODEL_NAME = "tiny-spec"
#: The in-process engine cores run one intra-op thread: on 2 shared cores, two threads that
#: wait for each other make their many small steps 10-20x slower.
ONE_THREAD = ParallelConfig(num_threads=1)
SPEC_FLAGS = [
    "--speculative-method", "ngram", "--num-speculative-tokens", str(K),
    "--ngram-min", str(NGRAM_MIN), "--ngram-max", str(NGRAM_MAX),
    "--speculative-disable-by-batch-size", "0",
]  # fmt: skip


def _prompts() -> list[list[int]]:
    """Prompts that repeat spans (as test_spec_decode's), one without repeats, and prompts of
    repeated tokens whose greedy continuations (this tiny model's) fall into loops, so n-gram
    drafts are accepted at every draft position, and rejected too (the tests check both)."""
    g = torch.Generator().manual_seed(5)
    span = torch.randint(3, 200, (7,), generator=g).tolist()
    noise = torch.randint(3, 200, (30,), generator=g).tolist()
    spans = [span * 4, noise[:9] + span + noise[9:20] + span, noise]
    loops = [[49] * 6, [49] * 12, [29] * 6, [94] * 6, [120] * 6, [224] * 6, [90, 333] * 4]
    return spans + loops


_EXPECTED: dict[str, list[list[int]]] = {}


def _expected(ckpt: Path) -> list[list[int]]:
    """transformers' greedy continuations of `_prompts()` (computed once per module)."""
    key = str(ckpt)
    if key not in _EXPECTED:
        _EXPECTED[key] = hf_greedy(ckpt, _prompts(), MAX_TOKENS)
    return _EXPECTED[key]


def _plan(prompt: list[int], output: list[int]) -> list[tuple[list[int], int]]:
    """The steps a greedy request with n-gram drafts takes: per step, the tokens it emits and
    the drafts it verified. The first token comes from the prefill (no drafts); then each step
    verifies the n-gram drafts of the tokens so far (at most what max_tokens leaves room for,
    and at most the request's draft limit: m + 1 after m of k drafts were accepted, k + 1
    after all were; no drafts for DRAFT_COOLDOWN_STEPS steps after a single rejected one),
    accepts the prefix that equals the greedy output and emits it plus one more token."""
    steps = [(output[:1], 0)]
    n, limit, rest = 1, K, 0
    while n < len(output):
        room = len(output) - n - 1
        drafts: list[int] = []
        if rest:
            rest -= 1
        elif room > 0:
            drafts = propose_ngram_reference(
                prompt + output[:n], min(limit, room), NGRAM_MIN, NGRAM_MAX
            )
        m = 0
        while m < len(drafts) and drafts[m] == output[n + m]:
            m += 1
        if drafts:
            limit = min(K, len(drafts) + 1) if m == len(drafts) else m + 1
            rest = DRAFT_COOLDOWN_STEPS if m < len(drafts) == 1 else 0
        steps.append((output[n : n + m + 1], len(drafts)))
        n += m + 1
    return steps


def _step_ends(prompt: list[int], output: list[int]) -> set[int]:
    """Output positions of the tokens that are the last of their step (`_plan`)."""
    ends, n = set(), 0
    for emitted, _ in _plan(prompt, output):
        n += len(emitted)
        ends.add(n - 1)
    return ends


def _counts(steps: list[tuple[list[int], int]]) -> tuple[int, int, int, list[int]]:
    """(request-steps with drafts, drafts, accepted drafts, accepted per position)."""
    drafts = tokens = accepted = 0
    per_pos = [0] * K
    for emitted, d in steps:
        if d:
            drafts, tokens, accepted = drafts + 1, tokens + d, accepted + len(emitted) - 1
            for pos in range(len(emitted) - 1):
                per_pos[pos] += 1
    return drafts, tokens, accepted, per_pos


def _sum_counts(all_counts) -> tuple[int, int, int, list[int]]:
    all_counts = list(all_counts)
    return (
        sum(c[0] for c in all_counts),
        sum(c[1] for c in all_counts),
        sum(c[2] for c in all_counts),
        [sum(c[3][p] for c in all_counts) for p in range(K)],
    )


def _spec_stats(s) -> tuple[int, int, int, list[int]]:
    return (
        s.spec_decode_num_drafts,
        s.spec_decode_num_draft_tokens,
        s.spec_decode_num_accepted_tokens,
        list(s.spec_decode_num_accepted_tokens_per_pos),
    )


def _delta(after, before) -> tuple[int, int, int, list[int]]:
    a, b = _spec_stats(after), _spec_stats(before)
    per_pos_b = b[3] or [0] * len(a[3])
    per_pos = [x - y for x, y in zip(a[3], per_pos_b, strict=True)]
    return a[0] - b[0], a[1] - b[1], a[2] - b[2], per_pos


def _start(ckpt: Path, *flags: str, startup_timeout_s: float = 180,
           http: bool = False) -> ServerThread:
    """A server configured by `moe-serve`'s own flag parsing (a fixed KV pool on top), gRPC on
    a free port, and with `http` the HTTP API on another."""
    args = build_parser().parse_args([
        "--model", str(ckpt), "--port", "0", "--max-model-len", "128", "--block-size", "16",
        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(BUDGET),
        "--log-level", "WARNING", *SPEC_FLAGS, *flags,
    ])  # fmt: skip
    config = engine_config_from_args(args, str(ckpt))
    assert config.speculative == SpeculativeConfig("ngram", K, NGRAM_MIN, NGRAM_MAX, 0)
    config = dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, num_blocks_override=NUM_BLOCKS)
    )
    options = dataclasses.replace(
        server_options_from_args(args), stats_poll_s=0.1, log_stats_interval_s=None, port=0,
        http_port=0 if http else None,
    )
    return ServerThread(config, options, startup_timeout_s=startup_timeout_s)


def _stream(stub, prompt: list[int], **fields) -> list:
    req = make_request(prompt, temperature=0.0, **fields)
    return list(stub.Generate(req, timeout=120))


@pytest.fixture(scope="module")
def tok_ckpt(qwen3_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Qwen3-MoE (same weights) with a 512-token byte-level BPE: stop strings work."""
    return tokenizer_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def server(tok_ckpt: Path, qwen3_ckpt: Path):
    _expected(qwen3_ckpt)  # transformers first: it does not share the CPU with the server
    handle = _start(
        tok_ckpt, "--metrics-port", str(free_port()), "--served-model-name", MODEL_NAME,
        http=True,
    )  # fmt: skip
    yield handle
    handle.close()


@pytest.fixture
def one_thread():
    """An EngineCore sets torch's thread count for the whole process: put it back after."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def stub(server: ServerThread):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def _metrics(port: int) -> dict[tuple[str, tuple], float]:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _metrics_spec(port: int) -> tuple[int, int, int, list[int]]:
    m = _metrics(port)
    per_pos = [
        int(m.get(("moe_engine_spec_decode_num_accepted_tokens_per_pos_total",
                   (("position", str(p)),)), -1))
        for p in range(K)
    ]  # fmt: skip
    return (
        int(m.get(("moe_engine_spec_decode_num_drafts_total", ()), -1)),
        int(m.get(("moe_engine_spec_decode_num_draft_tokens_total", ()), -1)),
        int(m.get(("moe_engine_spec_decode_num_accepted_tokens_total", ()), -1)),
        per_pos,
    )


def test_streams_equal_transformers_steps_stats_and_metrics(server, stub, qwen3_ckpt) -> None:
    prompts, want = _prompts(), _expected(qwen3_ckpt)
    plans = [_plan(p, o) for p, o in zip(prompts, want, strict=True)]
    total = stats(stub).kv_blocks_total
    wait_idle(stub, total)
    before = stats(stub)
    with ThreadPoolExecutor(len(prompts)) as pool:
        streams = list(pool.map(
            lambda p: _stream(stub, p, max_tokens=MAX_TOKENS, ignore_eos=True), prompts
        ))  # fmt: skip
    got = [[t for r in s for t in r.token_ids] for s in streams]
    assert got == want
    # stream_interval 1: one response per engine step, carrying exactly that step's tokens
    assert [[list(r.token_ids) for r in s] for s in streams] == [
        [emitted for emitted, _ in plan] for plan in plans
    ]
    assert max(len(r.token_ids) for s in streams for r in s) == K + 1  # all K drafts accepted
    assert all(s[-1].finished and s[-1].finish_reason == "length" for s in streams)
    assert all(s[-1].usage.completion_tokens == MAX_TOKENS for s in streams)

    # The unary result: HTTP /v1/completions (not streamed) of the same prompts.
    port = server.server.http_port
    body = {
        "model": MODEL_NAME, "prompt": prompts, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True,
    }  # fmt: skip
    resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert [c["token_ids"] for c in choices] == got
    assert [c["text"] for c in choices] == ["".join(r.text for r in s) for s in streams]
    assert any(c["text"] for c in choices)

    wait_idle(stub, total)
    after = stats(stub)
    expected = _sum_counts(_counts(plan) for plan in plans * 2)  # streamed + unary
    assert _delta(after, before) == expected
    drafts, draft_tokens, accepted, per_pos = _spec_stats(after)
    assert drafts > 0 and 0 < accepted < draft_tokens <= K * drafts
    assert sum(per_pos) == accepted and len(per_pos) == K
    assert per_pos[0] >= per_pos[1] >= per_pos[2] > 0  # position i needs i accepted before it
    assert after.spec_decode_mean_acceptance_length == pytest.approx(1 + accepted / drafts)
    assert after.kv_blocks_free == after.kv_blocks_total

    # Prometheus: the same totals (polled every 0.1 s; the engine is idle now).
    metrics_port = server.server.options.metrics_port
    deadline = time.monotonic() + 10
    while _metrics_spec(metrics_port) != _spec_stats(after) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _metrics_spec(metrics_port) == _spec_stats(after)


def _stop_cases(tokenizer, prompts, want) -> list[tuple[int, list[str], int | None, int, int]]:
    """(prompt index, stop strings, stop token id, position c of the token meant to stop it,
    min_tokens), per prompt: stop strings (the shortest text suffix not seen before) completed
    by a token that is not the last of its step (the step's later tokens must be dropped) and
    by one that is; and, with min_tokens c + 1 (a repeated token or text, as accepted drafts
    mostly are, can stop only there), a stop token id and a two-character stop string."""
    cases: list[tuple[int, list[str], int | None, int, int]] = []
    for i, (p, o) in enumerate(zip(prompts, want, strict=True)):
        ends = _step_ends(p, o)
        inside = [c for c in range(1, len(o) - 1) if c not in ends]
        texts, detok = [], IncrementalDetokenizer(tokenizer, [])
        for t in o:
            detok.add(t)
            texts.append(detok.text)
        if inside:
            cases.append((i, [], o[inside[0]], inside[0], inside[0] + 1))
            c = inside[-1]
            if "\ufffd" not in texts[c][-2:] and len(texts[c]) > len(texts[c - 1]):
                cases.append((i, [texts[c][-2:]], None, c, c + 1))
        picked = {True: 0, False: 0}  # inside a step / at its end
        for c in range(2, len(o) - 1):
            if picked[c in inside] >= (2 if c in inside else 1):
                continue
            n = next((n for n in range(1, 33) if texts[c][-n:] not in texts[c - 1]), None)
            stop = texts[c][-n:] if n is not None and n <= len(texts[c]) else ""
            if stop and "\ufffd" not in stop:
                cases.append((i, [stop], None, c, 0))
                picked[c in inside] += 1
    return cases


def _without_drafts(ckpt: Path, prompts, cases) -> list[tuple[list[int], str, str]]:
    """(tokens, text, finish reason) per case from an engine core without drafts."""
    engine = build_engine_core(
        EngineConfig(
            model=ModelConfig(model=str(ckpt), max_model_len=128),
            cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
            parallel=ONE_THREAD,
        )
    )
    for j, (i, stop, stop_id, _, min_tokens) in enumerate(cases):
        params = SamplingParams(
            max_tokens=MAX_TOKENS, min_tokens=min_tokens, temperature=0, ignore_eos=True,
            stop=stop, stop_token_ids=[stop_id] if stop_id is not None else None,
        )  # fmt: skip
        engine.add_request(f"c{j}", prompts[i], params)
    got: dict[str, tuple[list[int], list[str], list[str]]] = {
        f"c{j}": ([], [], []) for j in range(len(cases))
    }
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids, text, reason = got[out.request_id]
            ids += out.new_token_ids
            text.append(out.new_text)
            if out.finished:
                reason.append(str(out.finish_reason))
    return [(ids, "".join(text), reason[0]) for ids, text, reason in got.values()]


def test_stop_strings_and_ids_inside_a_step_cut_where_they_do_without_drafts(
    server, stub, qwen3_ckpt, tok_ckpt, one_thread
) -> None:
    prompts, want = _prompts(), _expected(qwen3_ckpt)
    cases = _stop_cases(load_tokenizer(str(tok_ckpt)), prompts, want)
    reference = _without_drafts(tok_ckpt, prompts, cases)
    inside = [
        case for case, (ids, _, reason) in zip(cases, reference, strict=True)
        if reason == "stop" and len(ids) == case[3] + 1
        and case[3] not in _step_ends(prompts[case[0]], want[case[0]])
    ]  # fmt: skip
    assert sum(1 for c in inside if c[1] and not c[4]) >= 3, "few stop strings inside a step"
    assert sum(1 for c in inside if c[1] and c[4]) >= 2, "few stop strings with min_tokens"
    assert sum(1 for c in inside if c[2] is not None) >= 3, "few stop token ids inside a step"
    total = stats(stub).kv_blocks_total
    wait_idle(stub, total)
    before = stats(stub)

    def one(case) -> list:
        i, stop, stop_id, _, min_tokens = case
        fields = {"stop": stop} if stop else {"stop_token_ids": [stop_id]}
        return _stream(stub, prompts[i], max_tokens=MAX_TOKENS, min_tokens=min_tokens,
                       ignore_eos=True, **fields)  # fmt: skip

    with ThreadPoolExecutor(8) as pool:
        streams = list(pool.map(one, cases))
    plans = []
    for case, s, (ids, text, reason) in zip(cases, streams, reference, strict=True):
        got = ([t for r in s for t in r.token_ids], "".join(r.text for r in s))
        assert got == (ids, text), case
        assert s[-1].finished and s[-1].finish_reason == reason, case
        assert s[-1].usage.completion_tokens == len(ids)
        steps, n = [], 0  # the steps up to the one that stopped (all its drafts verified)
        for emitted, d in _plan(prompts[case[0]], want[case[0]]):
            steps.append((emitted, d))
            n += len(emitted)
            if n >= len(ids):
                break
        plans.append(steps)
    wait_idle(stub, total)
    assert _delta(stats(stub), before) == _sum_counts(_counts(p) for p in plans)


def test_bad_speculative_flags_exit_at_once_naming_field_and_limit(qwen3_ckpt, capsys) -> None:
    """`moe-serve` processes for two bad values; `main` in this process for two more."""
    from moe_engine.cli.serve import main

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    base = ["--model", str(qwen3_ckpt), "--port", "0"]
    cases = [
        (["--speculative-method", "ngram", "--num-speculative-tokens", "99"], 1,
         ["num_speculative_tokens: 99", f"1..{MAX_SPECULATIVE_TOKENS}"]),
        (["--speculative-method", "foo"], 2, ["--speculative-method", "'foo'", "ngram", "mtp"]),
    ]  # fmt: skip
    started = time.monotonic()
    procs = [
        subprocess.Popen([sys.executable, "-m", "moe_engine.cli.serve", *base, *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for flags, _, _ in cases
    ]  # fmt: skip
    try:
        results = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert time.monotonic() - started < 60  # refused before any model is loaded
    for (flags, code, needles), p, (_, err) in zip(cases, procs, results, strict=True):
        assert p.returncode == code, (flags, err)
        assert all(n in err for n in needles), (flags, err)
        assert "Traceback" not in err, err
    for flags, needles in [
        (["--num-speculative-tokens", "3"], ["num_speculative_tokens: 3", "speculative_method"]),
        (["--speculative-method", "ngram", "--ngram-min", "3", "--ngram-max", "2"],
         ["ngram_max: 2", "ngram_min 3"]),
        (["--speculative-method", "ngram", "--speculative-disable-by-batch-size", "-1"],
         ["speculative_disable_by_batch_size: -1", "below 0"]),
    ]:  # fmt: skip
        started = time.monotonic()
        assert main([*base, *flags]) == 1
        err = capsys.readouterr().err
        assert all(n in err for n in needles), (flags, err)
        assert time.monotonic() - started < 30


def test_ep2_greedy_with_drafts_equals_transformers_and_frees_blocks(qwen3_ckpt) -> None:
    prompts, want = _prompts(), _expected(qwen3_ckpt)
    handle = _start(qwen3_ckpt, "--ep-size", "2", startup_timeout_s=300)
    try:
        assert handle.server.engine.model_info.ep_size == 2
        with grpc.insecure_channel(handle.address) as channel:
            ep_stub = pb_grpc.MoeEngineStub(channel)
            with ThreadPoolExecutor(len(prompts)) as pool:
                streams = list(pool.map(
                    lambda p: _stream(ep_stub, p, max_tokens=MAX_TOKENS, ignore_eos=True),
                    prompts,
                ))  # fmt: skip
            wait_idle(ep_stub, 2 * NUM_BLOCKS)
            s = stats(ep_stub)
        per_rank = handle.run(handle.server.engine.get_stats()).ranks
    finally:
        handle.close()
    assert [[t for r in st for t in r.token_ids] for st in streams] == want
    plans = [_plan(p, o) for p, o in zip(prompts, want, strict=True)]
    assert [[list(r.token_ids) for r in st] for st in streams] == [
        [emitted for emitted, _ in plan] for plan in plans
    ]
    assert _spec_stats(s) == _sum_counts(_counts(plan) for plan in plans)
    assert s.ep_size == 2
    assert s.kv_blocks_free == s.kv_blocks_total == 2 * NUM_BLOCKS
    assert [r.kv_blocks_free for r in s.ranks] == [NUM_BLOCKS, NUM_BLOCKS]
    # Both ranks generated and verified drafts (requests go to the least loaded rank), and
    # with different counts: their steps carried different numbers of tokens.
    assert all(r.generation_tokens_total > 0 and r.spec_decode_num_drafts > 0 for r in per_rank)
    assert sum(r.generation_tokens_total for r in per_rank) == MAX_TOKENS * len(prompts)
    assert len({_spec_stats(r)[:3] for r in per_rank}) == 2


# --- the sampling distribution with drafts -----------------------------------------------

#: A short repetitive prompt and, per output position (0 = the prefill's token), the fixed
#: draft proposed there: token 2's most frequent value in plain sampling (p ~ 0.18) and token
#: 3's most frequent value after it, so drafts are accepted and rejected at both positions.
STAT_PROMPT = [17, 42, 99, 17, 42, 99, 17, 42]
STAT_DRAFTS = {1: 327, 2: 248}
STAT_REQUESTS = 3000
STAT_MAX_TOKENS = 4
STAT_BUCKETS = 8
#: chi2.ppf(1 - 1e-3, df=8) = 26.12: a two-sample test of homogeneity over STAT_BUCKETS tokens
#: plus "other" has (2 - 1) x (9 - 1) = 8 degrees of freedom; alpha 1e-3 per position tested.
CHI2_CRITICAL_DF8_ALPHA_1E3 = 26.12


class FixedDrafts:
    """Proposes STAT_DRAFTS at the output positions that follow (as many as the room allows),
    whatever was sampled: every decode step but the last verifies drafts."""

    def propose(self, token_ids, max_drafts) -> list[list[int]]:
        out = []
        for tokens, room in zip(token_ids, max_drafts, strict=True):
            done = len(tokens) - len(STAT_PROMPT)
            drafts: list[int] = []
            while len(drafts) < room and done + len(drafts) in STAT_DRAFTS:
                drafts.append(STAT_DRAFTS[done + len(drafts)])
            out.append(drafts)
        return out


def _sample(ckpt: Path, spec: bool, seed: int) -> tuple[list[list[int]], EngineCore]:
    """STAT_REQUESTS unseeded samples (engine seed `seed`) of STAT_MAX_TOKENS tokens, with
    FixedDrafts (two per step at most) or without drafts."""
    engine = build_engine_core(
        EngineConfig(
            model=ModelConfig(model=str(ckpt), max_model_len=32, seed=seed),
            cache=CacheConfig(block_size=16, num_blocks_override=520),
            scheduler=SchedulerConfig(
                max_num_seqs=512, max_num_batched_tokens=4096, max_waiting=STAT_REQUESTS
            ),
            speculative=SpeculativeConfig("ngram", 2, 1, 3, 0) if spec else SpeculativeConfig(),
            parallel=ONE_THREAD,
        )
    )
    if spec:
        engine.drafter.proposer = FixedDrafts()
    params = SamplingParams(max_tokens=STAT_MAX_TOKENS, temperature=1.0, ignore_eos=True)
    for i in range(STAT_REQUESTS):
        engine.add_request(f"s{i}", STAT_PROMPT, params)
    got: dict[str, list[int]] = {f"s{i}": [] for i in range(STAT_REQUESTS)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    return list(got.values()), engine


def chi_square(a: Counter, b: Counter, buckets: int = STAT_BUCKETS) -> float:
    """Two-sample chi-square statistic over the `buckets` tokens most frequent in a + b, and
    all other tokens as one more bucket."""
    top = [t for t, _ in (a + b).most_common(buckets)]
    rows = [[c[t] for t in top] + [sum(c.values()) - sum(c[t] for t in top)] for c in (a, b)]
    n = [sum(r) for r in rows]
    stat = 0.0
    for j in range(len(top) + 1):
        col = rows[0][j] + rows[1][j]
        for i in range(2):
            expected = n[i] * col / (n[0] + n[1])
            stat += (rows[i][j] - expected) ** 2 / expected
    return stat


def test_sampled_marginals_with_drafts_equal_plain_sampling(qwen3_ckpt, one_thread) -> None:
    plain, _ = _sample(qwen3_ckpt, False, seed=1)
    spec, engine = _sample(qwen3_ckpt, True, seed=2)
    assert all(len(o) == STAT_MAX_TOKENS for o in plain + spec)
    s = engine.drafter.stats
    # drafts accepted and rejected at both positions
    assert 0 < s.accepted_per_pos[1] < s.accepted_per_pos[0] < s.num_drafts
    assert s.num_accepted_tokens < s.num_draft_tokens
    for pos in range(1, STAT_MAX_TOKENS):  # token 1 comes from the prefill: no drafts
        a, b = Counter(o[pos] for o in plain), Counter(o[pos] for o in spec)
        stat = chi_square(a, b)
        assert stat < CHI2_CRITICAL_DF8_ALPHA_1E3, (pos, stat, a.most_common(5), b.most_common(5))
