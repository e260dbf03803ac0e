"""bench/throughput.py's vLLM baseline without vLLM: the alternating measurement, the greedy
agreement, vLLM's environment, and bench/vllm_runner.py's line protocol driven by VllmRunner
against a stand-in `vllm` package (a fake LLM that echoes a seeded token pattern)."""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tp() -> ModuleType:
    return _load("throughput")


def test_greedy_agreement_finds_first_divergence(tp: ModuleType) -> None:
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
    got = tp.greedy_agreement(ours, theirs)
    assert got["first_divergence"] == expected
    assert got["identical"] == expected.count(None)
    fractions = [1.0 if k is None else k / len(s) for k, s in zip(expected, ours, strict=True)]
    assert got["matching_prefix_fraction"] == pytest.approx(sum(fractions) / 6, abs=1e-4)
    with pytest.raises(ValueError):
        tp.greedy_agreement(ours, theirs[:-1])


def test_cpu_list(tp: ModuleType) -> None:
    assert tp._cpu_list({0, 1}) == "0-1"
    assert tp._cpu_list({3, 0, 1, 2, 7, 9, 10}) == "0-3,7,9-10"


def test_vllm_env_configs(tp: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").write_bytes(b"")
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    env, info = tp.vllm_cpu_env(tmp_path, "best")
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    import os

    assert env["VLLM_CPU_OMP_THREADS_BIND"] == tp._cpu_list(os.sched_getaffinity(0))
    assert env["LD_PRELOAD"].split(":")[-1] == str(tmp_path / "lib" / "libiomp5.so")
    assert info["preload"]["intel_openmp"] == str(tmp_path / "lib" / "libiomp5.so")
    env, info = tp.vllm_cpu_env(tmp_path, "both-cores")
    assert "LD_PRELOAD" not in env and info["preload"]["tcmalloc"] is None
    env, _ = tp.vllm_cpu_env(tmp_path, "default")
    assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    with pytest.raises(ValueError):
        tp.vllm_cpu_env(tmp_path, "fastest")


def test_measure_alternating_order_and_failure(tp: ModuleType) -> None:
    calls: list[str] = []

    def engine(name: str, tokens: int, fail_at: int | None = None):
        def once() -> int:
            calls.append(name)
            if fail_at is not None and calls.count(name) == fail_at:
                raise RuntimeError("boom")
            return tokens
        return once

    args = argparse.Namespace(warmup=1, runs=3)
    results = tp.measure_alternating(
        {"a": engine("a", 10), "b": engine("b", 20), "c": engine("c", 5, fail_at=3)}, args)
    assert calls == ["a", "b", "c", "a", "b", "c", "a", "b", "c", "a", "b"]
    assert len(results["a"]["runs_s"]) == 3 and results["a"]["output_tokens"] == 10
    assert results["b"]["output_tokens_per_s"] > 0
    assert results["c"] == {"output_tokens_per_s": None, "error": "RuntimeError: boom"}


FAKE_VLLM = textwrap.dedent('''
    """Stand-in for vllm: LLM.generate returns, per prompt, n tokens (prompt[0] + i) % 8192."""
    import os
    import sys
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
            assert kw["skip_tokenizer_init"] is True and kw["dtype"] == "bfloat16", kw
            assert os.environ["VLLM_TARGET_DEVICE"] == "cpu"

        def generate(self, prompts, params, use_tqdm=True):
            # a protocol-looking line on stdout: the runner must keep it off its channel
            print('{"event": "run", "seconds": 0, "output_tokens": -1}', flush=True)
            out = []
            for p, sp in zip(prompts, params):
                kw = sp.kw
                assert kw["temperature"] == 0 and kw["ignore_eos"] and not kw["detokenize"]
                assert kw["min_tokens"] == kw["max_tokens"]
                n = kw["max_tokens"] - int(os.environ.get("FAKE_VLLM_SHORT", "0"))
                out.append(_Output([(p["prompt_token_ids"][0] + i) % 8192 for i in range(n)]))
            return out
''')


def _runner(tp: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int):
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setattr(tp, "ensure_vllm_venv", lambda venv: Path(sys.executable))
    args = argparse.Namespace(vllm_venv=tmp_path, vllm_config="best", max_model_len=1024)
    return tp.VllmRunner(tmp_path / "ckpt", tp.mixed_workload(n), args)


def test_vllm_runner_protocol(tp: ModuleType, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    n = random.randint(2, 6)
    requests = tp.mixed_workload(n)
    runner = _runner(tp, tmp_path, monkeypatch, n)
    try:
        assert runner.info["vllm_version"] == "0.0-fake"
        assert runner() == sum(r.output_len for r in requests)
        assert runner.last_token_ids is None
        runner.return_token_ids = True
        runner()
        assert runner.last_token_ids == [
            [(r.prompt_token_ids[0] + i) % 8192 for i in range(r.output_len)] for r in requests
        ]
    finally:
        runner.close()
    assert runner.proc.returncode == 0


def test_vllm_runner_reports_short_outputs(tp: ModuleType, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_VLLM_SHORT", "1")
    runner = _runner(tp, tmp_path, monkeypatch, 2)
    try:
        with pytest.raises(RuntimeError, match="tokens, expected"):
            runner()
    finally:
        runner.close()
