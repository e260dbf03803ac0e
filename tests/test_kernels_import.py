"""Our top-level `kernels` package must not pass for the Hugging Face hub `kernels` package.

`transformers` probes an importable top-level `kernels` (`is_kernels_available`: the package's
spec, then its distribution version, importing it as a last resort) before using hub kernels.
Ours must make that probe say False, and importing it must stay cheap (no torch, no triton).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter (from the repo root) and parse the JSON it prints."""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_transformers_does_not_see_hub_kernels() -> None:
    result = run_python(
        "import importlib.util, json\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "spec = importlib.util.find_spec('kernels')\n"
        "print(json.dumps({'available': is_kernels_available(),\n"
        "                  'origin': spec.origin if spec else None}))\n"
    )
    assert result["origin"] is not None
    assert Path(result["origin"]).resolve() == REPO / "kernels" / "__init__.py"
    assert result["available"] is False


def test_import_kernels_is_cheap() -> None:
    result = run_python(
        "import json, sys, time\n"
        "t0 = time.perf_counter()\n"
        "import kernels\n"
        "dt = time.perf_counter() - t0\n"
        "print(json.dumps({'seconds': dt, 'torch': 'torch' in sys.modules,\n"
        "                  'triton': 'triton' in sys.modules}))\n"
    )
    assert result["torch"] is False and result["triton"] is False
    assert result["seconds"] < 0.5, result
