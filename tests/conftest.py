"""Session-wide set-up: the native kernels are built before any test starts a server, tiny
checkpoints are made once per session, and a session that leaves an engine process behind
fails (after killing it) instead of hanging at exit. Mooncake's transfer engine is loaded before
anything else and its state printed at session start; under MOE_ENGINE_CI=1 a test that must
run on CI fails instead of skipping (tests/ci_skips.py).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

# Mooncake's transfer engine (the disaggregation tests) is loaded first, before torch and before
# collection imports the test modules' libraries, so whether it loads does not depend on which
# tests run or what was loaded before it; `mooncake_unavailable_reason()` then finds it loaded
# (or, failing, says why; pytest_sessionstart prints that).
try:
    import mooncake.engine  # noqa: F401
except ImportError:
    pass

import torch  # noqa: E402

# Triton kernels run under the interpreter on a machine without a GPU. The switch must be set
# before anything imports triton (transformers and compressed-tensors may, during collection).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).parent))

from ci_skips import CI_ENV, ci_mode, pytest_runtest_makereport  # noqa: E402, F401
from fixtures import make_mxfp4_experts_checkpoint, make_tiny_checkpoint  # noqa: E402
from grpc_helpers import child_pids  # noqa: E402


def pytest_sessionstart(session: pytest.Session) -> None:
    """Build (or load) the native CPU kernels once, before any test: a server test must not pay
    for the build inside its start timeout. Progress goes to the terminal."""
    from kernels.native.library import native_unavailable_reason

    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def progress(message: str, eta_s: float | None) -> None:
        if reporter is not None:
            reporter.write_line(f"native kernels: {message}")

    start = time.monotonic()
    reason = native_unavailable_reason(progress=progress)
    if reporter is not None:
        reporter.write_line(
            f"native kernels: {'ready' if reason is None else 'unavailable: ' + reason} "
            f"in {time.monotonic() - start:.1f} s"
        )
    from moe_engine.disagg.transfer import mooncake_unavailable_reason

    reason = mooncake_unavailable_reason()
    if reporter is not None:
        reporter.write_line(
            "Mooncake transfer engine: ready" if reason is None else
            f"Mooncake transfer engine unavailable, the disaggregation tests "
            f"{'fail (' + CI_ENV + '=1)' if ci_mode() else 'skip'}: {reason}"
        )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Kill engine processes that outlived their tests, and fail the session if there were
    any (interpreter exit would otherwise wait for them)."""
    leftover = child_pids(os.getpid())
    for pid in leftover:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            continue
        sys.stderr.write(f"\nkilled process {pid} left behind by the tests: {cmdline[:200]!r}\n")
    if leftover:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_ckpt_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One directory for every tiny checkpoint of this session."""
    return tmp_path_factory.mktemp("tiny_ckpts")


@pytest.fixture(scope="session")
def qwen3_ckpt(tiny_ckpt_root: Path) -> Path:
    """Qwen3-MoE, float32, one safetensors file: 3 layers (layer 1 dense), norm_topk_prob true."""
    return make_tiny_checkpoint("qwen3_moe", tiny_ckpt_root)


@pytest.fixture(scope="session")
def qwen3_sharded_ckpt(tiny_ckpt_root: Path) -> Path:
    """The same architecture as `qwen3_ckpt`, saved in ~100 kB shards with an index file."""
    return make_tiny_checkpoint("qwen3_moe", tiny_ckpt_root, sharded=True)


@pytest.fixture(scope="session")
def qwen3_nonorm_ckpt(tiny_ckpt_root: Path) -> Path:
    """Qwen3-MoE, norm_topk_prob false, decoder_sparse_step 2 (layers 1, 3 MoE; 0, 2 dense)."""
    return make_tiny_checkpoint(
        "qwen3_moe",
        tiny_ckpt_root,
        num_hidden_layers=4,
        norm_topk_prob=False,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    )


@pytest.fixture(scope="session")
def mixtral_ckpt(tiny_ckpt_root: Path) -> Path:
    """Mixtral, float32, one safetensors file: 2 MoE layers, 8 experts, top-2."""
    return make_tiny_checkpoint("mixtral", tiny_ckpt_root)


@pytest.fixture(scope="session")
def gpt_oss_ckpt(tiny_ckpt_root: Path) -> Path:
    """gpt-oss, float32, one safetensors file: 4 layers alternating sliding (window 8) and full
    attention, YaRN rope, 8 experts top-2, non-zero sinks and biases (fixtures._KINDS)."""
    return make_tiny_checkpoint("gpt_oss", tiny_ckpt_root)


@pytest.fixture(scope="session")
def gpt_oss_mxfp4_ckpt(gpt_oss_ckpt: Path, tiny_ckpt_root: Path) -> Path:
    """`gpt_oss_ckpt` with its experts in the native MXFP4 `*_blocks` / `*_scales` layout and
    quantization_config {"quant_method": "mxfp4"} (written by `quant.mxfp4`)."""
    return make_mxfp4_experts_checkpoint(gpt_oss_ckpt, tiny_ckpt_root)


@pytest.fixture(scope="session")
def deepseek_v3_ckpt(tiny_ckpt_root: Path) -> Path:
    """DeepSeek-V3, float32: 3 layers (layer 0 dense), MLA with q LoRA, YaRN + mscale, 16
    experts in 4 groups (2 kept) top-4 by sigmoid with a non-zero correction bias, 1 shared."""
    return make_tiny_checkpoint("deepseek_v3", tiny_ckpt_root)


@pytest.fixture(scope="session")
def deepseek_v2_ckpt(tiny_ckpt_root: Path) -> Path:
    """DeepSeek-V2, float32: 3 layers (layer 0 dense), MLA without q LoRA, 16 experts in 4
    groups, softmax group_limited_greedy top-4, 2 shared experts."""
    return make_tiny_checkpoint("deepseek_v2", tiny_ckpt_root)


@pytest.fixture(scope="session")
def glm4_moe_ckpt(tiny_ckpt_root: Path) -> Path:
    """GLM-4.5 (glm4_moe), float32: 3 layers (layer 0 dense), GQA with q/k/v biases and q/k norm,
    partial rotary 0.5, 16 experts in 2 groups (1 kept) top-4 sigmoid + bias, 1 shared."""
    return make_tiny_checkpoint("glm4_moe", tiny_ckpt_root)


@pytest.fixture(scope="session")
def qwen2_moe_ckpt(tiny_ckpt_root: Path) -> Path:
    """Qwen2-MoE, float32: 3 layers (layer 1 dense), q/k/v biases, 8 experts softmax top-2 not
    renormalised, a sigmoid-gated shared expert of width 48."""
    return make_tiny_checkpoint("qwen2_moe", tiny_ckpt_root)


@pytest.fixture(scope="session")
def qwen3_next_ckpt(tiny_ckpt_root: Path) -> Path:
    """Qwen3-Next, float32: 4 layers, Gated DeltaNet except layer 1 (gated full attention),
    layer 2 a dense MLP, 8 experts top-2 renormalised and a gated shared expert."""
    return make_tiny_checkpoint("qwen3_next", tiny_ckpt_root)
