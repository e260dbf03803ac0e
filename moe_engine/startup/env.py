"""The engine's environment knobs: the compute dtype and intra-op threads.

The kernels' own settings (cache directory, AMX choice, thread-pool knobs, ISA) are in
`kernels.env`; this module adds what the engine decides from them.
"""

from __future__ import annotations

import os

import torch

from kernels.env import check_kernel_environment, env_int
from kernels.native.library import NativeUnavailable, choose_isa


def native_bf16_matmul() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 / AMX), per oneDNN."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def compute_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the CPU path computes in for weights of `weight_dtype`.

    bfloat16 without native support is emulated by oneDNN at a fraction of float32's speed
    (measured 19 vs 159 GFLOP/s on an AVX2 core pair), so such CPUs compute in float32 on the
    bfloat16-rounded weights unless MOE_ENGINE_FORCE_BF16=1.
    """
    if weight_dtype != torch.bfloat16 or os.environ.get("MOE_ENGINE_FORCE_BF16") == "1":
        return weight_dtype
    return torch.bfloat16 if native_bf16_matmul() else torch.float32


def default_threads() -> int:
    """Intra-op CPU threads: MOE_ENGINE_THREADS, else every core this process may run on.

    A server's engine core takes every core too, beside its gRPC front end: the native kernels'
    pool (kernels/native/csrc/thread_pool.h) never waits for a thread the front end displaced, so
    sharing a core costs the front end's own time only. (With OpenMP barriers it did not:
    steps ran up to 10x slower, and an earlier default left one core to the front end, which
    cost a third of the served throughput on 2 cores; issue 17's note has the measurements.)

    Raises:
        ValueError: MOE_ENGINE_THREADS is not a positive integer.
    """
    threads = env_int("MOE_ENGINE_THREADS", minimum=1)
    if threads is not None:
        return threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_cpu_environment() -> None:
    """Check the CPU knobs of the environment before anything starts (moe-serve calls it
    before its port opens): those of `kernels.env.check_kernel_environment`, then
    MOE_ENGINE_CPU_ISA (`kernels.native.library.choose_isa`: auto, avx2, avx512, one this CPU
    runs).

    Raises:
        ValueError: the first bad one, naming the variable, its value and what it accepts.
    """
    check_kernel_environment()
    try:
        choose_isa()
    except NativeUnavailable:  # no AVX2 under auto: the torch kernels run, as logged later
        pass
