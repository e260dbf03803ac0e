"""bench/gpu_check.sh's CPU dry run, so that the prepared GPU script cannot rot unseen.

`--dry-run` runs every step of the GPU check here: the gpu-marked tests are collected and all
skip, bench/gpu_kernels.py produces its whole table under the Triton interpreter at tiny shapes,
and the mixed-64 command is parsed. About 30 s on 2 quiet cores (the pytest collection and the
interpreter dominate); the timeout only guards against a hang.
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
TIMEOUT_S = 300


def run_script(out: Path, *args: str) -> subprocess.CompletedProcess:
    """The script in its own session; on timeout the whole process group is killed."""
    env = {**os.environ, "OUT": str(out)}
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
    for step in ("env", "gpu-tests", "kernels", "throughput"):
        assert re.search(rf"^\| {step} \| 0 \| \d+ \|$", summary, re.M), (step, summary)
    assert (out / "gpu_check.log").read_text().count("=== ") >= 8  # every step logged


def test_dry_run_collects_the_gpu_tests_and_all_skip(dry_run) -> None:
    stdout = dry_run[0].stdout
    section = stdout.split("=== gpu-tests (")[1].split("=== gpu-tests: rc=")[0]
    final = [line for line in section.splitlines() if re.match(r"^\d+ \w+.* in [\d.]+s", line)]
    assert final and re.match(r"^\d+ skipped, \d+ deselected in", final[-1]), final
    assert "tests/test_gpu.py" in section  # this file's tests were collected, and skipped
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
    for row in report["moe"]:
        assert "error" not in row, row
        assert row["ms"] > 0 and row["gbs"] > 0 and row["pct_of_copy"] > 0, row
        assert 1 <= row["experts_hit"] and row["weight_bytes"] > 0, row
    attention = report["attention"]
    assert "error" not in attention, attention
    assert "ms" in attention or attention["missing"].startswith(
        "kernels.attention.triton_attention.paged_attention not importable"
    )
    table = (out / "gpu_kernels.md").read_text()
    for lay, f, t in got:
        assert re.search(rf"^\| {lay} \| {f} \| {t} \| .*\| ok \|$", table, re.M), (lay, f, t)
    assert re.search(r"^\| qwen3-30b-a3b decode \| 2 x 48 \|", table, re.M)


def test_dry_run_checks_the_throughput_command(dry_run) -> None:
    stdout = dry_run[0].stdout
    assert "bench/throughput.py --engines moe-engine --device cuda --json" in stdout
    assert "throughput.py parses the GPU command: device cuda engines moe-engine" in stdout
    assert not (dry_run[1] / "throughput.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: the real check would run")
def test_gpu_mode_without_cuda_and_bad_flags_exit_2(tmp_path: Path) -> None:
    result = run_script(tmp_path)
    assert result.returncode == 2, result.stdout[-2000:]
    assert "no CUDA device" in result.stdout
    result = run_script(tmp_path, "--bogus")
    assert result.returncode == 2 and "unknown argument '--bogus'" in result.stdout
