"""The CPU knobs of the environment (MOE_ENGINE_THREADS, _SPIN_US, _AMX, _CPU_ISA) are checked
before moe-serve loads anything or opens its port: a bad value exits 1 with one line naming the
variable, its value and what it accepts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_engine.cli.serve import main as serve_main
from moe_engine.startup.env import check_cpu_environment, default_threads


@pytest.mark.parametrize("name,value,message", [
    ("MOE_ENGINE_THREADS", "abc", "MOE_ENGINE_THREADS='abc': must be an integer >= 1"),
    ("MOE_ENGINE_THREADS", "0", "MOE_ENGINE_THREADS='0': must be an integer >= 1"),
    ("MOE_ENGINE_SPIN_US", "-5", "MOE_ENGINE_SPIN_US='-5': must be an integer >= 0"),
    ("MOE_ENGINE_SPIN_US", "2e3", "MOE_ENGINE_SPIN_US='2e3': must be an integer >= 0"),
    ("MOE_ENGINE_AMX", "all", "MOE_ENGINE_AMX='all': must be one of 0, 1"),
    ("MOE_ENGINE_AMX", "yes", "MOE_ENGINE_AMX='yes': must be one of 0, 1"),
    ("MOE_ENGINE_CPU_ISA", "sse2", "MOE_ENGINE_CPU_ISA=sse2: unknown instruction set"),
])
def test_a_bad_value_is_refused_naming_it(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError) as info:
        check_cpu_environment()
    assert message in str(info.value)


def test_moe_serve_exits_1_before_loading(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MOE_ENGINE_THREADS", "two")
    # the model directory does not exist: the environment is checked first
    assert serve_main(["--model", str(tmp_path / "missing"), "--port", "0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "moe-serve: error: MOE_ENGINE_THREADS='two': must be an integer >= 1"


def test_good_values_pass_and_threads_are_read(monkeypatch):
    for name, value in (("MOE_ENGINE_THREADS", " 3 "), ("MOE_ENGINE_SPIN_US", "0"),
                        ("MOE_ENGINE_AMX", "0"), ("MOE_ENGINE_CPU_ISA", "auto")):
        monkeypatch.setenv(name, value)
    check_cpu_environment()
    assert default_threads() == 3
    monkeypatch.setenv("MOE_ENGINE_THREADS", "")
    assert default_threads() >= 1


@pytest.mark.parametrize("given,want", [(None, "PASSIVE"), ("ACTIVE", "ACTIVE")])
def test_importing_the_engine_makes_torch_openmp_workers_sleep_unless_told(given, want):
    """`import moe_engine` sets OMP_WAIT_POLICY=PASSIVE before torch loads (a policy the
    environment names stays), so that torch's OpenMP workers do not spin on the cores the
    engine's own pool needs."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if given is not None:
        env["OMP_WAIT_POLICY"] = given
    code = "import moe_engine, os; print(os.environ['OMP_WAIT_POLICY'])"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True, cwd=Path(__file__).parent.parent).stdout.split()
    assert out[0] == want
