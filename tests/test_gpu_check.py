"""bench/gpu_check.sh's CPU dry run, so that the prepared GPU script cannot rot unseen.

`--dry-run` runs every step of the GPU check here: the compile check for sm_90 (quick subset),
bench/gpu_kernels.py's whole table under the Triton interpreter at tiny shapes (every row checked
against float64), bench/gpu_e2e.py's plan of the real cuts and one end-to-end case (the
DeepSeek-V2-Lite cut, MLA + shared experts: the widest code path) on the CPU at tiny widths.
About 45 s on 2 quiet cores; the timeout only guards against a hang.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
LAYERS = ("qwen3-30b-a3b", "gpt-oss-20b")
FORMATS = ("bf16", "int4", "mxfp4")
TOKENS = (1, 8, 64, 512)
TIMEOUT_S = 400
E2E_CASE = "deepseek-v2-lite-bf16"


def run_script(out: Path, *args: str) -> subprocess.CompletedProcess:
    """The script in its own session; on timeout the whole process group is killed."""
    env = {**os.environ, "OUT": str(out), "GPU_CHECK_E2E_CASES": E2E_CASE,
           "GPU_CHECK_WORKDIR": str(out / "e2e")}
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"bench/gpu_check.sh {' '.join(args)} ran past {TIMEOUT_S} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, None)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check_out")
    return run_script(out, "--dry-run"), out


def test_dry_run_passes_every_step(dry_run) -> None:
    result, out = dry_run
    assert result.returncode == 0, result.stdout[-4000:]
    summary = (out / "summary.md").read_text()
    assert "DRY RUN" in summary
    for step in ("env", "compile", "gpu-tests", "kernels", "load-rss", "e2e-plan",
                 f"e2e-{E2E_CASE}"):
        assert re.search(rf"^\| {step} \| 0 \| \d+ \|$", summary, re.M), (step, summary)
    assert (out / "gpu_check.log").read_text().count("=== ") >= 10  # every step logged


def test_dry_run_collects_the_gpu_tests_and_all_skip(dry_run) -> None:
    stdout = dry_run[0].stdout
    section = stdout.split("=== gpu-tests (")[1].split("=== gpu-tests: rc=")[0]
    final = [line for line in section.splitlines() if re.match(r"^\d+ \w+.* in [\d.]+s", line)]
    assert final and re.match(r"^\d+ skipped, \d+ deselected in", final[-1]), final
    assert "tests/test_gpu.py" in section  # its kernel and engine tests were collected, skipped
    assert "needs a CUDA device" in section
    assert "error" not in final[-1] and "failed" not in final[-1]


def test_dry_run_kernel_table_has_every_row(dry_run) -> None:
    _, out = dry_run
    report = json.loads((out / "gpu_kernels.json").read_text())
    assert report["dry_run"] and report["triton_interpret"] and report["complete"]
    assert report["copy_bandwidth_gbs"] > 0
    got = {(r["layer"], r["format"], r["tokens"]) for r in report["moe"]}
    assert got == {(lay, f, t) for lay in LAYERS for f in FORMATS for t in TOKENS}
    assert len(report["moe"]) == len(got)
    for row in report["moe"] + report["attention"]:
        assert "error" not in row, row
        assert row["ok"] and 0 < row["err"] < row["tol"], row  # checked against float64
        assert row["ms"] > 0 and row["gbs"] > 0 and row["pct_of_copy"] > 0, row
    kinds = {(r["kind"], r["splits"] > 1) for r in report["attention"]}
    assert kinds == {("decode", False), ("decode", True), ("prefill", False), ("mla", False),
                     ("mla", True)}, kinds  # the merge of split decode ran, MLA too
    assert any("sinks + window" in r["name"] and r["splits"] > 1 for r in report["attention"])
    table = (out / "gpu_kernels.md").read_text()
    for lay, f, t in got:
        assert re.search(rf"^\| {lay} \| {f} \| {t} \| .*\| ok \|$", table, re.M), (lay, f, t)
    assert re.search(r"^\| deepseek-v2-lite mla decode, batch 1 \(split\) \| mla \|", table, re.M)


def test_dry_run_e2e_case_and_plan(dry_run) -> None:
    result, out = dry_run
    r = json.loads((out / f"e2e-{E2E_CASE}.json").read_text())
    assert r["ok"] and r["dry_run"] and not r.get("errors"), r
    assert r["fp32_exact"] and r["graphs_equal_eager"], r
    assert [s["batch"] for s in r["steps"]] == [1, 8, 64]
    assert all(s["step_ms"] > 0 and s["roofline_bytes"] > 0 for s in r["steps"]), r["steps"]
    plan = [json.loads(line) for line in result.stdout.splitlines()
            if line.startswith('{"case": ') and '"roofline_mib_per_step"' in line]
    assert {p["case"] for p in plan} == {"qwen3-30b-a3b-bf16", "qwen3-30b-a3b-int4",
                                         "gpt-oss-20b-mxfp4", "deepseek-v2-lite-bf16"}
    assert all(p["layers"] == 3 and p["checkpoint_gib"] > 1 for p in plan), plan
    summary = (out / "summary.md").read_text()
    assert re.search(rf"^\| {E2E_CASE} \| True \| True \|.*\| ok \|$", summary, re.M), summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the real check would run")
def test_gpu_mode_without_cuda_and_bad_flags_exit_2(tmp_path: Path) -> None:
    result = run_script(tmp_path)
    assert result.returncode == 2, result.stdout[-2000:]
    assert "no CUDA device" in result.stdout
    result = run_script(tmp_path, "--bogus")
    assert result.returncode == 2 and "unknown argument '--bogus'" in result.stdout
