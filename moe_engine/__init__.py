"""moe-engine: a serving engine for Mixture-of-Experts models.

`LLM` and `SamplingParams` are the offline API (results are `RequestOutput`s of
`CompletionOutput`s, as vLLM's); `moe-serve` / `moe-client` the served one.

Importing it sets `OMP_WAIT_POLICY=PASSIVE` unless the environment names a policy (`moe_engine._omp`
has why), before anything here imports torch.
"""

from moe_engine._omp import TORCH_LOADED_WITHOUT_WAIT_POLICY  # noqa: F401 (first: sets the policy)
from moe_engine.offline.outputs import CompletionOutput, Logprob, RequestOutput
from moe_engine.sampling_params import SamplingParams, StructuredOutputsParams

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
