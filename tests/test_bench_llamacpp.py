"""llama.cpp as a peer of bench/throughput.py: the config grammar, row names, launches and the
`--baseline` / `--engines` wiring without llama.cpp; and, where bench/setup_llamacpp.sh's build
and an f32 GGUF exist, the real runner through bench/peer_runner.py in both modes."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from types import ModuleType

import pytest
from bench_loader import BENCH, load_bench

_load = load_bench


@pytest.fixture(scope="module")
def tp() -> ModuleType:
    return _load("throughput")  # puts bench/ on sys.path for the modules below


@pytest.fixture(scope="module")
def lp(tp: ModuleType) -> ModuleType:
    import llamacpp_peer

    return llamacpp_peer


def test_parse_config_scopes_env_and_errors(lp: ModuleType) -> None:
    text = "threads=2,q4_0:extra_bufts=off,env.OMP_X=a=b,threads=1,kv_unified=1,f32:type_k=f32"
    flags, env = lp.parse_config(text, "q4_0")
    assert flags == ["--threads", "1", "--extra-bufts", "off", "--kv-unified"]
    assert env == {"OMP_X": "a=b"}
    flags, _ = lp.parse_config(text + ",kv_unified=off", "f32")
    assert flags == ["--threads", "1", "--type-k", "f32"]
    assert lp.parse_config("", "bf16") == ([], {})
    for bad, match in (("threads", "is not"), ("q5_0:threads=1", "is not one of"),
                       ("thread=2", "unknown key"), ("=3", "is not")):
        with pytest.raises(ValueError, match=match):
            lp.parse_config(bad, "f32")


def test_launches_rows_flags_and_env(lp: ModuleType, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    python = tmp_path / "venv" / "bin" / "python"
    made: list[list[str]] = []

    def fake_ggufs(ckpt: Path, root: Path, types: list[str]) -> dict[str, Path]:
        made.append(types)
        return {t: root / "gguf" / f"model-{t}.gguf" for t in types}

    monkeypatch.setattr(lp, "ensure_llamacpp", lambda root: python)
    monkeypatch.setattr(lp, "ensure_ggufs", fake_ggufs)
    args = argparse.Namespace(llamacpp_dir=tmp_path, llamacpp_types="f32,q4_0",
                              llamacpp_config=["", "threads=1,env.OMP_WAIT_POLICY=passive"])
    ctx = _peer_runner().PeerContext(tmp_path / "ckpt", tmp_path / "reqs.json", args)
    launches = lp.llamacpp_launches(ctx)
    assert [x.name for x in launches] == [
        "llama.cpp-f32", "llama.cpp-q4_0", "llama.cpp-f32-threads=1+env.OMP_WAIT_POLICY=passive",
        "llama.cpp-q4_0-threads=1+env.OMP_WAIT_POLICY=passive"]
    assert [x.compute_dtype for x in launches] == ["f32", "q4_0"] * 2 and made == [["f32", "q4_0"]]
    f32, q4, _, q4_t1 = launches
    assert f32.argv[:2] == [str(python), str(BENCH / "llamacpp_runner.py")]
    assert f32.argv[f32.argv.index("--model") + 1] == str(tmp_path / "gguf" / "model-f32.gguf")
    assert f32.argv[f32.argv.index("--requests") + 1] == str(tmp_path / "reqs.json")
    assert f32.argv[f32.argv.index("--type-k") + 1] == "f32" and "--type-k" not in q4.argv
    assert q4.argv[q4.argv.index("--flash-attn") + 1] == "off"
    assert q4.argv[q4.argv.index("--threads") + 1] == str(len(os.sched_getaffinity(0)))
    assert q4_t1.argv[q4_t1.argv.index("--threads") + 1] == "1"
    assert q4_t1.env["OMP_WAIT_POLICY"] == "passive" and "OMP_WAIT_POLICY" not in q4.settings["env"]
    assert f32.env["LLAMA_CPP_LIB_PATH"] == str(tmp_path / "build" / "bin")
    for bad in ({"llamacpp_types": "q5_0"}, {"llamacpp_config": ["nope=1"]}):
        with pytest.raises(ValueError):
            lp.llamacpp_launches(_peer_runner().PeerContext(
                ctx.ckpt, ctx.requests_path, argparse.Namespace(**{**vars(args), **bad})))


def _peer_runner() -> ModuleType:
    import peer_runner

    return peer_runner


def test_throughput_wiring(tp: ModuleType) -> None:
    assert tp.PEERS["llamacpp"].row_prefix == "llama.cpp"
    args = tp.parse_args(["--table", "--baseline", "vllm,llamacpp", "--llamacpp-types", "q4_0",
                          "--llamacpp-config", "threads=1"])
    assert tp.selected_baselines(args) == ["vllm", "llamacpp"]
    assert args.llamacpp_types == "q4_0" and args.llamacpp_config == ["threads=1"]
    assert "llamacpp" in tp.selected_baselines(tp.parse_args(["--baseline", "all"]))
    args = tp.parse_args(["--engines", "moe-engine,llama.cpp-q4_0"])
    assert tp.selected_baselines(args) == ["llamacpp"] and args.quantization == "none"
    assert tp.row_selected("llama.cpp-q4_0", args) and not tp.row_selected("llama.cpp-f32", args)
    assert tp.row_selected("llama.cpp-q4_0-threads=1", args)
    assert tp.is_peer("llama.cpp-f32")


def _installed_f32_gguf(lp: ModuleType) -> tuple[Path, Path] | None:
    root = Path(os.environ.get("LLAMACPP_DIR", lp.DEFAULT_ROOT))
    ggufs = sorted(root.glob("gguf/*/model-f32.gguf"))
    python = root / "venv" / "bin" / "python"
    return (root, ggufs[0]) if ggufs and python.is_file() else None


@pytest.mark.slow  # loads the bench checkpoint's f32 GGUF (458 MB) in a real runner
def test_real_runner_both_modes_and_idle(lp: ModuleType, tmp_path: Path) -> None:
    found = _installed_f32_gguf(lp)
    if found is None:
        pytest.skip("no llama.cpp build with an f32 GGUF (bash bench/setup_llamacpp.sh, then "
                    "python bench/llamacpp_gguf.py --model CKPT)")
    import workload

    root, gguf = found
    pr = _peer_runner()
    requests = workload.mixed_workload(3)
    path = workload.write_requests_file(requests)
    # One thread: two threads meet at a spinning OpenMP barrier after every op, which beside a
    # busy neighbour (an unlocked benchmark) turns this second-long test into minutes, and
    # slows that neighbour as much (bench/NOTES.md, the llama.cpp section).
    flags, env = lp.parse_config(lp.DEFAULT_CONFIG + ",threads=1", "f32")
    lib = root / "build" / "bin"
    launch = pr.PeerLaunch(
        "llama.cpp-f32", [str(root / "venv" / "bin" / "python"), str(BENCH / "llamacpp_runner.py"),
                          "--model", str(gguf), "--requests", str(path), "--lib-dir", str(lib),
                          *flags],
        {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib), **env}, "f32")
    runner = pr.PeerRunner(launch, requests)
    try:
        assert runner.info["num_requests"] == 3 and runner.info["load_s"] >= 0
        assert runner.info["config"]["type_k"] == "f32" and runner.info["config"]["threads"] == 1
        res = runner.run("batched", return_token_ids=True)
        assert [len(t) for t in res.token_ids] == [r.output_len for r in requests]
        assert all(0 <= t < 8192 for ids in res.token_ids for t in ids)
        res = runner.run("batch1")
        assert res.output_tokens == sum(r.output_len for r in requests)  # 3 < 8: all of them
        before = runner.cpu_seconds()
        time.sleep(1.0)
        assert runner.cpu_seconds() - before < 0.05  # idle between commands: no spinning
    finally:
        runner.close()
        path.unlink(missing_ok=True)
    assert runner.proc.returncode == 0


def test_peers_do_not_inherit_the_engines_openmp_wait_policy(tp: ModuleType, monkeypatch) -> None:
    """OMP_WAIT_POLICY=PASSIVE is moe-engine's setting for its own process (`import moe_engine`
    marks it as its default); a peer's runner gets the environment without it, but with a
    policy the user set, and with what the peer's own row names."""
    import peer_runner

    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT", "1")
    env = peer_runner.peer_environ(LLAMA_CPP_LIB_PATH="/x")
    assert "OMP_WAIT_POLICY" not in env and "MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT" not in env
    assert env["LLAMA_CPP_LIB_PATH"] == "/x"
    assert peer_runner.peer_environ(OMP_WAIT_POLICY="passive")["OMP_WAIT_POLICY"] == "passive"
    monkeypatch.delenv("MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT")
    assert peer_runner.peer_environ()["OMP_WAIT_POLICY"] == "PASSIVE"  # the user's own
