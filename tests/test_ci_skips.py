"""tests/ci_skips.py: under MOE_ENGINE_CI=1 a skip of a `ci_must_run` test or a skip for a
missing install fails with its reason; gpu-marked tests, other skips and xfails are left alone;
without CI mode every skip stays a skip. Runs an inner pytest on a file made here."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

INNER = '''
import pytest

@pytest.mark.ci_must_run
def test_marked():
    pytest.skip("needs a thing")

def test_install_problem():
    pytest.importorskip("no_such_module_here")

def test_plain_skip():
    pytest.skip("the CPU lacks AMX")

@pytest.mark.gpu
def test_gpu():
    pytest.skip("deep_ep not installed")

@pytest.mark.ci_must_run
@pytest.mark.xfail(reason="known")
def test_xfail():
    raise AssertionError

def test_passes():
    pass
'''


def _outcomes(tmp_path: Path, ci: str | None) -> dict[str, str]:
    """test name -> "passed", "skipped", "failed" (an error in set-up counts as failed)."""
    (tmp_path / "test_inner.py").write_text(INNER)
    env = {k: v for k, v in os.environ.items() if k != "MOE_ENGINE_CI"}
    if ci is not None:
        env["MOE_ENGINE_CI"] = ci
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    junit = tmp_path / f"junit-{ci}.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "ci_skips", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), "-c", os.devnull, f"--junitxml={junit}",
         str(tmp_path / "test_inner.py")],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    outcomes = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        kinds = {child.tag for child in case}
        outcome = ("failed" if kinds & {"failure", "error"} else
                   "skipped" if "skipped" in kinds else "passed")
        outcomes[case.get("name")] = outcome
    return outcomes


def test_ci_mode_fails_the_skips_that_must_run(tmp_path: Path) -> None:
    assert _outcomes(tmp_path, "1") == {
        "test_marked": "failed", "test_install_problem": "failed", "test_plain_skip": "skipped",
        "test_gpu": "skipped", "test_xfail": "skipped", "test_passes": "passed",
    }


def test_without_ci_mode_skips_stay_skips(tmp_path: Path) -> None:
    for ci in (None, "0"):
        assert _outcomes(tmp_path, ci) == {
            "test_marked": "skipped", "test_install_problem": "skipped",
            "test_plain_skip": "skipped", "test_gpu": "skipped", "test_xfail": "skipped",
            "test_passes": "passed",
        }
