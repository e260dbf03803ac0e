"""bench/throughput.py and its peers without vLLM: the alternating measurement (order, failures,
idle-CPU accounting), the greedy agreement, the ratio table, row selection, vLLM's environment,
and the runner protocol (bench/peer_runner.py driving bench/vllm_runner.py in both modes)
against a stand-in `vllm` package (a fake LLM that echoes a seeded token pattern)."""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType

import pytest
from bench_loader import load_bench

_load = load_bench


@pytest.fixture(scope="module")
def tp() -> ModuleType:
    return _load("throughput")  # puts bench/ on sys.path for the modules below


@pytest.fixture(scope="module")
def mods(tp: ModuleType) -> argparse.Namespace:
    import measure
    import peer_runner
    import vllm_peer
    import workload

    return argparse.Namespace(measure=measure, peer_runner=peer_runner, vllm_peer=vllm_peer,
                              workload=workload)


def test_greedy_agreement_finds_first_divergence(mods: argparse.Namespace) -> None:
    rng = random.Random()
    ours, theirs, expected = [], [], []
    for _ in range(6):
        n = rng.randint(2, 40)
        seq = [rng.randint(0, 8191) for _ in range(n)]
        other = list(seq)
        if rng.random() < 0.5:
            k = rng.randrange(n)
            other[k] = (other[k] + 1) % 8192
            expected.append(k)
        else:
            expected.append(None)
        ours.append(seq)
        theirs.append(other)
    got = mods.measure.greedy_agreement(ours, theirs)
    assert got["first_divergence"] == expected
    assert got["identical"] == expected.count(None)
    fractions = [1.0 if k is None else k / len(s) for k, s in zip(expected, ours, strict=True)]
    assert got["matching_prefix_fraction"] == pytest.approx(sum(fractions) / 6, abs=1e-4)
    with pytest.raises(ValueError):
        mods.measure.greedy_agreement(ours, theirs[:-1])


def test_cpu_list_and_env_pairs(mods: argparse.Namespace) -> None:
    assert mods.peer_runner.cpu_list({0, 1}) == "0-1"
    assert mods.peer_runner.cpu_list({3, 0, 1, 2, 7, 9, 10}) == "0-3,7,9-10"
    parse = mods.vllm_peer.parse_env_pairs
    assert parse(["A=1", "KMP_AFFINITY=granularity=fine,compact"]) == {
        "A": "1", "KMP_AFFINITY": "granularity=fine,compact"}
    assert parse(None) == {}
    with pytest.raises(ValueError, match="NAME=VALUE"):
        parse(["novalue"])


def test_mode_requests(mods: argparse.Namespace) -> None:
    reqs = mods.workload.mixed_workload(64)
    assert mods.workload.mode_requests(reqs, "batched") == reqs
    assert mods.workload.mode_requests(reqs, "batch1") == reqs[:8]
    assert mods.workload.mode_requests(reqs[:3], "batch1") == reqs[:3]
    with pytest.raises(ValueError, match="unknown mode"):
        mods.workload.mode_requests(reqs, "batch2")


def test_vllm_env_configs(mods: argparse.Namespace, tmp_path: Path,
                          monkeypatch: pytest.MonkeyPatch) -> None:
    vp = mods.vllm_peer
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env, info = vp.vllm_cpu_env(tmp_path, "best")
    assert env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == str(vp.KVCACHE_GIB)
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == mods.peer_runner.cpu_list(os.sched_getaffinity(0))
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    assert info["preload"]["intel_openmp"] == str(tmp_path / "lib" / "libiomp5.so")
    assert all(env[k] == v for k, v in vp.BEST_KMP.items())
    env, info = vp.vllm_cpu_env(tmp_path, "both-cores", {"KMP_BLOCKTIME": "7"})
    assert "LD_PRELOAD" not in env and info["preload"]["tcmalloc"] is None
    assert env["KMP_BLOCKTIME"] == "7" and info["env"]["KMP_BLOCKTIME"] == "7"
    env, _ = vp.vllm_cpu_env(tmp_path, "default")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    with pytest.raises(ValueError):
        vp.vllm_cpu_env(tmp_path, "fastest")


class FakeEngine:
    """A BenchEngine whose runs take `seconds`, optionally failing at one call, and whose
    'process' burns `idle_cpu` CPU seconds per second of wall time while others run."""

    def __init__(self, name: str, pid: int, tokens: int, calls: list, fail_at: int | None = None,
                 idle_cpu: float = 0.0, clock: dict | None = None):
        self.name, self._pid, self.tokens, self.calls = name, pid, tokens, calls
        self.fail_at, self.idle_cpu, self.clock = fail_at, idle_cpu, clock
        self.compute_dtype, self.info = "float32", {}

    @property
    def pid(self) -> int:
        return self._pid

    def cpu_seconds(self) -> float | None:
        return self.idle_cpu * time.perf_counter()

    def run(self, mode: str, return_token_ids: bool = False):
        self.calls.append((self.name, mode, return_token_ids))
        if self.fail_at is not None and len([c for c in self.calls if c[0] == self.name]) \
                == self.fail_at:
            raise RuntimeError("boom")
        time.sleep(0.01)
        ids = [[1] * self.tokens] if return_token_ids else None
        return sys.modules["workload"].RunResult(self.tokens, 0.5, ids)

    def close(self) -> None:
        pass


def test_measure_alternating_order_failure_and_idle(mods: argparse.Namespace) -> None:
    calls: list = []
    engines = {"a": FakeEngine("a", 1, 10, calls), "b": FakeEngine("b", 2, 20, calls),
               "c": FakeEngine("c", 3, 5, calls, fail_at=3, idle_cpu=0.5)}
    out = mods.measure.measure_alternating(engines, ["batched", "batch1"], warmup=1, runs=2,
                                           settle_s=0.0)
    order = [(n, m) for n, m, _ in calls]
    pairs = [(n, m) for n in "abc" for m in ("batched", "batch1")]
    # c fails on its third call (round 2, batched) and only that pair drops out
    assert order == pairs + pairs + [p for p in pairs if p != ("c", "batched")]
    assert [r for n, m, r in calls[-5:] if m == "batched"] == [True, True]
    res = out["results"]
    assert res["a"]["batched"] == {"output_tokens_per_s": 20.0, "runs_s": [0.5, 0.5],
                                   "output_tokens": 10}
    assert res["b"]["batch1"]["output_tokens_per_s"] == 40.0
    assert res["c"]["batched"] == {"output_tokens_per_s": None, "error": "RuntimeError: boom"}
    assert res["c"]["batch1"]["output_tokens_per_s"] == 10.0
    assert set(out["token_ids"]) == {"a", "b"}
    assert out["idle"]["c"]["share"] == pytest.approx(0.5, abs=1e-3)
    assert out["idle"]["a"]["share"] == 0.0


def test_settle_waits_for_a_busy_process(mods: argparse.Namespace) -> None:
    class Busy(FakeEngine):
        def cpu_seconds(self) -> float | None:  # busy for 0.5 s after creation, then idle
            return min(time.perf_counter() - self.t0, 0.5)

    busy = Busy("x", 9, 1, [])
    busy.t0 = time.perf_counter()
    waited = mods.measure.settle([busy], max_s=3.0)
    assert 0.4 < waited < 1.5
    assert mods.measure.settle([busy], max_s=3.0) < 0.5
    assert mods.measure.settle([Busy("y", 8, 1, [])], max_s=0.0) == 0.0


def test_process_tree_cpu_counts_children(mods: argparse.Namespace) -> None:
    # the child spins for 0.5 CPU seconds and then sleeps; the parent only sleeps
    child = ("import time\nwhile time.process_time() < 0.5: pass\ntime.sleep(60)")
    code = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]); "
            "time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline, used = time.monotonic() + 30, 0.0
        while time.monotonic() < deadline and (used or 0.0) < 0.45:
            time.sleep(0.1)
            used = mods.peer_runner.process_tree_cpu_s(parent.pid)
        assert used is not None and 0.45 <= used < 1.5
    finally:
        for proc_children in Path(f"/proc/{parent.pid}/task").glob("*/children"):
            for pid in proc_children.read_text().split():
                os.kill(int(pid), signal.SIGKILL)
        parent.kill()
        parent.wait()
    assert mods.peer_runner.process_tree_cpu_s(parent.pid) is None


def test_ratios_table_and_row_selection(tp: ModuleType) -> None:
    engines = {
        "moe-engine": {"compute_dtype": "bfloat16", "batched": {"output_tokens_per_s": 900.0},
                       "batch1": {"output_tokens_per_s": 100.0}},
        "vllm-cpu-bf16": {"compute_dtype": "bfloat16", "batched": {"output_tokens_per_s": 600.0},
                          "batch1": {"output_tokens_per_s": 250.0}},
        "vllm-cpu-fp32": {"compute_dtype": "float32", "batched": {"output_tokens_per_s": 750.0},
                          "batch1": {"output_tokens_per_s": None, "error": "E: x"}},
    }
    best = tp.add_ratios(engines, ["batched", "batch1"])
    assert best == {"batched": "vllm-cpu-fp32", "batch1": "vllm-cpu-bf16"}
    assert engines["moe-engine"]["batched"]["ratio_vs_best_peer"] == 1.2
    assert engines["moe-engine"]["batch1"]["ratio_vs_best_peer"] == 0.4
    table = tp.markdown_table({"modes": ["batched", "batch1"], "engines": engines,
                               "best_peer": best})
    lines = table.splitlines()
    assert len(lines) == 5 and lines[2].startswith("| moe-engine | bfloat16 | 900.0 | 1.20x |")
    assert "**750.0**" in lines[4] and "failed: E: x" in lines[4] and "**250.0**" in lines[3]
    args = tp.parse_args(["--engines", "moe-engine,vllm-cpu-fp32"])
    assert tp.selected_baselines(args) == ["vllm"] and args.quantization == "none"
    assert tp.row_selected("vllm-cpu-fp32", args) and not tp.row_selected("vllm-cpu-bf16", args)
    args = tp.parse_args(["--engines", "moe-engine-int4,transformers-static-batching"])
    assert args.quantization == "int4" and tp.selected_baselines(args) == ["transformers"]
    args = tp.parse_args(["--table", "--baseline", "all"])
    assert args.modes == ["batched", "batch1"] and args.quantization == "none,int4,int4-all"
    assert tp.selected_baselines(args) == list(tp.BASELINES)
    args = tp.parse_args(["--engines", "moe-engine-int4-all"])
    assert args.quantization == "int4-all"
    with pytest.raises(SystemExit):
        tp.parse_args(["--baseline", "nope"])


FAKE_VLLM = textwrap.dedent('''
    """Stand-in for vllm: LLM.generate returns, per prompt, n tokens (prompt[0] + i) % 8192."""
    import os
    import sys
    import types
    __version__ = "0.0-fake"
    print("fake vllm chatter on stdout", flush=True)  # must not reach the protocol channel

    class SamplingParams:
        def __init__(self, **kw):
            self.kw = kw

    class _Completion:
        def __init__(self, ids):
            self.token_ids = ids

    class _Output:
        def __init__(self, ids):
            self.outputs = [_Completion(ids)]

    class LLM:
        def __init__(self, **kw):
            assert kw["skip_tokenizer_init"] is True, kw
            assert kw["dtype"] in ("bfloat16", "float32"), kw
            assert os.environ["VLLM_TARGET_DEVICE"] == "cpu"
            config = types.SimpleNamespace(dtype="torch." + kw["dtype"])
            self.llm_engine = types.SimpleNamespace(model_config=config)
            self.calls = 0

        def generate(self, prompts, params, use_tqdm=True):
            # a protocol-looking line on stdout: the runner must keep it off its channel
            print('{"event": "run", "seconds": 0, "output_tokens": -1}', flush=True)
            print(f"generate call of {len(prompts)}", file=sys.stderr, flush=True)
            out = []
            for p, sp in zip(prompts, params):
                kw = sp.kw
                assert kw["temperature"] == 0 and kw["ignore_eos"] and not kw["detokenize"]
                assert kw["min_tokens"] == kw["max_tokens"]
                n = kw["max_tokens"] - int(os.environ.get("FAKE_VLLM_SHORT", "0"))
                out.append(_Output([(p["prompt_token_ids"][0] + i) % 8192 for i in range(n)]))
            return out
''')


def _runners(mods: argparse.Namespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
             n: int) -> list:
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setattr(mods.vllm_peer, "ensure_vllm_venv", lambda venv: Path(sys.executable))
    requests = mods.workload.mixed_workload(n)
    path = mods.workload.write_requests_file(requests)
    args = argparse.Namespace(vllm_venv=tmp_path, vllm_config="best,default", max_model_len=1024,
                              vllm_dtypes="bfloat16,float32", vllm_env=["KMP_BLOCKTIME=3"])
    ctx = mods.peer_runner.PeerContext(tmp_path / "ckpt", path, args)
    launches = mods.vllm_peer.vllm_launches(ctx)
    assert [x.name for x in launches] == ["vllm-cpu-bf16", "vllm-cpu-fp32",
                                          "vllm-cpu-bf16-default", "vllm-cpu-fp32-default"]
    assert all(x.env["KMP_BLOCKTIME"] == "3" for x in launches)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in launches[2].env
    for bad in ({"vllm_config": "fastest"}, {"vllm_dtypes": "float16"}):
        with pytest.raises(ValueError, match="is not one of"):
            mods.vllm_peer.vllm_launches(mods.peer_runner.PeerContext(
                ctx.ckpt, path, argparse.Namespace(**{**vars(args), **bad})))
    return [mods.peer_runner.PeerRunner(x, requests) for x in launches[:2]]


def test_vllm_runner_protocol_both_modes(mods: argparse.Namespace, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    n = random.randint(9, 12)
    requests = mods.workload.mixed_workload(n)
    runners = _runners(mods, tmp_path, monkeypatch, n)
    try:
        for runner, dtype in zip(runners, ("bfloat16", "float32"), strict=True):
            assert runner.info["vllm_version"] == "0.0-fake" and runner.info["dtype"] == dtype
            assert runner.info["num_requests"] == n and runner.compute_dtype == dtype
            res = runner.run("batched")
            assert res.output_tokens == sum(r.output_len for r in requests)
            assert res.token_ids is None and res.seconds >= 0
            res = runner.run("batch1", return_token_ids=True)
            assert res.output_tokens == sum(r.output_len for r in requests[:8])
            assert res.token_ids == [
                [(r.prompt_token_ids[0] + i) % 8192 for i in range(r.output_len)]
                for r in requests[:8]
            ]
            assert runner.cpu_seconds() is not None
    finally:
        for runner in runners:
            runner.close()
    assert [r.proc.returncode for r in runners] == [0, 0]


def test_vllm_runner_reports_short_outputs_and_bad_modes(
        mods: argparse.Namespace, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_SHORT", "1")
    runners = _runners(mods, tmp_path, monkeypatch, 2)
    try:
        with pytest.raises(RuntimeError, match="tokens, expected"):
            runners[0].run("batch1")
        with pytest.raises(ValueError, match="unknown mode"):
            runners[1].run("batch3")  # refused by the driver, and by the runner itself:
        runners[1].proc.stdin.write('{"cmd": "run", "mode": "batch3"}\n')
        runners[1].proc.stdin.flush()
        with pytest.raises(RuntimeError, match="unknown mode 'batch3'"):
            runners[1]._receive("run")
        assert runners[1].proc.wait(timeout=30) == 1
    finally:
        for runner in runners:
            runner.close()


def test_vllm_settings_parse_variant(tp: ModuleType) -> None:
    vs = _load("vllm_settings")
    assert vs.parse_variant("aff=best:KMP_BLOCKTIME=1;KMP_AFFINITY=granularity=fine,compact") \
        == ("aff", "best", {"KMP_BLOCKTIME": "1", "KMP_AFFINITY": "granularity=fine,compact"})
    assert vs.parse_variant("d=default") == ("d", "default", {})
    for bad in ("nolabel", "x=fastest", "x=best:NOEQUALS"):
        with pytest.raises(ValueError):
            vs.parse_variant(bad)


def test_a_users_omp_wait_policy_reaching_the_peers_is_noted(tp: ModuleType, monkeypatch) -> None:
    """The shell's OMP_WAIT_POLICY reaches llama.cpp's and vLLM's runners (peer_environ keeps
    the user's own); the report says so. moe-engine's default is stripped: no note."""
    peers = tp.parse_args(["--baseline", "vllm,llamacpp"])
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.delenv("MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT", raising=False)
    assert "OMP_WAIT_POLICY=PASSIVE from this shell" in tp.inherited_omp_note(peers)
    assert tp.inherited_omp_note(tp.parse_args(["--engines", "moe-engine"])) is None
    monkeypatch.setenv("MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT", "1")
    assert tp.inherited_omp_note(peers) is None
