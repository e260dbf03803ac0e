"""moe-engine: a serving engine for Mixture-of-Experts models.

`LLM` and `SamplingParams` are the offline API (results are `RequestOutput`s of
`CompletionOutput`s, as vLLM's); `moe-serve` / `moe-client` the served one.

Importing it sets `OMP_WAIT_POLICY=PASSIVE` unless the environment names a policy: the
engine's CPU kernels run on their own thread pool (kernels/csrc/thread_pool.h), and torch's
OpenMP workers, which by default spin after every torch op, took the core from them (mixed-64
batched 16-25% slower, prefill 22%; bench/NOTES.md section 14). libgomp reads the variable
when torch loads: in a process that imported torch first it reaches only the processes this
one starts (the engine core of `moe-serve`, expert-parallel ranks), and `LLM` warns (torch
first without a policy measured mixed-64 27% slower offline on a quiet 2-core machine). It also
sets `MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT=1` then, so that a benchmark can give peer engines the
environment without it (bench/peer_runner.py `peer_environ`).
"""

import os
import sys

#: Whether torch was loaded before this package with no `OMP_WAIT_POLICY` in the environment,
#: so that the policy set here came too late for this process (`moe_engine.offline.llm` warns).
TORCH_LOADED_WITHOUT_WAIT_POLICY = "OMP_WAIT_POLICY" not in os.environ and "torch" in sys.modules

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT"] = "1"

from moe_engine.offline.outputs import CompletionOutput, Logprob, RequestOutput  # noqa: E402
from moe_engine.request import SamplingParams, StructuredOutputsParams  # noqa: E402

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]


def _version() -> str:
    """The version, from its one source, pyproject.toml: the installed distribution's metadata
    (`pip install -e .` included), else the pyproject.toml of the source tree this package sits
    in (run from a checkout without installing), else "0+unknown"."""
    from importlib import metadata

    try:
        return metadata.version("moe-engine")
    except metadata.PackageNotFoundError:
        pass
    import tomllib
    from pathlib import Path

    try:
        pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
        project = tomllib.loads(pyproject.read_text(encoding="utf-8")).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return "0+unknown"
    return str(project["version"]) if project.get("name") == "moe-engine" else "0+unknown"


__version__ = _version()


def __getattr__(name: str):
    # LLM pulls in torch and transformers: import it only when asked for.
    if name == "LLM":
        from moe_engine.offline.llm import LLM

        return LLM
    raise AttributeError(name)
