"""Device memory sizing as vLLM users know it: `--gpu-memory-utilization F`.

On CUDA the engine may use F x the device's total memory. After the weights are loaded, one
profile forward at the largest step (`max_num_batched_tokens` tokens, as prefill) measures the
activation peak; what is left becomes KV blocks (vLLM's `determine_available_memory`):

    kv_cache_bytes = F * total - weights - activations peak - CUDA graph pool - non-torch memory
    num_blocks     = kv_cache_bytes // bytes per block

"non-torch memory" is device memory outside torch's caching allocator (the CUDA context,
NCCL buffers, other processes). The "CUDA graph pool" is the private memory pool the decode
graphs are captured into (`runner.cuda_graphs`): their activations stay reserved there, beside
the eager steps' own peak. The graphs record the KV cache's addresses, so they can only be
captured after it is allocated; the pool is therefore estimated before, from one more profile
forward, a decode step at the largest capture size over max_model_len keys (the graphs share
one pool, captured largest first, so the smaller ones reuse its blocks), plus
`GRAPH_POOL_SLACK` for the allocator's segment rounding and each graph's live output; the
capture then logs what it took beside the estimate. vLLM profiles its graph pool before
sizing the KV cache the same way (`profile_cudagraph_memory`, on by default); the term is 0
with --enforce-eager and on a CPU, where the plan does not print it.

The arithmetic (`check_weights_fit`, `size_kv_cache`) is pure: it takes a `DeviceMemory` and
the measured peaks, so tests inject them without a GPU. A configuration that cannot hold one
`max_model_len` request fails with a `StartupError` that names the bytes and the flags that
would fix it. On a CPU none of this runs: the KV cache is
sized before loading from --cpu-memory-utilization (`host_memory`, in `plan.make_plan`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from moe_engine.errors import StartupError
from moe_engine.startup.plan import Plan, format_bytes


@dataclass(frozen=True)
class DeviceMemory:
    """A device's memory at one moment (bytes).

    Attributes:
        total: the device's capacity.
        free: what the driver reports free (all processes counted).
        non_torch: in use outside this process's torch allocator (CUDA context, NCCL,
            other processes): total - free - torch's reserved bytes.
    """

    total: int
    free: int
    non_torch: int = 0


def cuda_device_memory(device: torch.device | str) -> DeviceMemory:
    """`DeviceMemory` of a CUDA device, from `torch.cuda.mem_get_info` and the allocator."""
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return DeviceMemory(total=total, free=free, non_torch=max(0, total - free - reserved))


def profile_activation_peak(run: Callable[[], None], device: torch.device) -> int:
    """The activation peak (bytes) of `run` (one profile forward) on a CUDA `device`:
    torch's peak allocated bytes during it minus what was allocated before.

    Raises:
        ValueError: `device` is not a CUDA device (a CPU has no allocator statistics).
    """
    if device.type != "cuda":
        raise ValueError(f"profile_activation_peak measures CUDA devices only, not {device}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(0, peak)


#: Added to the profiled decode peak for the graph pool: the caching allocator's segment
#: rounding (a 1-10 MB request takes a 20 MiB segment) and the graphs' outputs (bytes).
GRAPH_POOL_SLACK = 64 << 20


def graph_pool_estimate(decode_peak: int) -> int:
    """The decode graphs' pool (bytes) from the activation peak of an eager decode forward at
    the largest capture size (`profile_activation_peak`): that peak plus `GRAPH_POOL_SLACK`."""
    return max(0, decode_peak) + GRAPH_POOL_SLACK


@dataclass(frozen=True)
class KVCacheSizing:
    """The terms of the device's KV-cache budget (bytes), as the startup plan prints them.

    Attributes:
        total: device memory; utilization: the fraction the engine may use (F).
        weights: this rank's weights; activation_peak: the profiled forward's peak;
        non_torch: memory used outside torch's allocator.
        graph_pool: the decode graphs' memory pool (estimated, `graph_pool_estimate`); 0
            without graphs. graph_note: why it is what it is (printed beside it).
        kv_cache_bytes: F * total - weights - activation_peak - graph_pool - non_torch (may
            be < 0).
        bytes_per_block: one KV block over all groups; block_size: tokens per block.
        num_blocks: usable KV blocks (kv_cache_bytes // bytes_per_block, >= 0).
    """

    total: int
    utilization: float
    weights: int
    activation_peak: int
    non_torch: int
    kv_cache_bytes: int
    bytes_per_block: int
    block_size: int
    num_blocks: int
    graph_pool: int = 0
    graph_note: str = "no CUDA graphs"

    @property
    def budget(self) -> int:
        """F * total (bytes)."""
        return int(self.utilization * self.total)

    @property
    def max_concurrent_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        """The sizing's lines for the startup plan."""
        return "\n".join([
            f"device memory: {format_bytes(self.total)} total x gpu_memory_utilization "
            f"{self.utilization:g} = {format_bytes(self.budget)}",
            f"  - weights {format_bytes(self.weights)} - activations peak "
            f"{format_bytes(self.activation_peak)} (profiled) - CUDA graphs "
            f"{format_bytes(self.graph_pool)} ({self.graph_note}) - non-torch "
            f"{format_bytes(self.non_torch)} = KV cache {format_bytes(self.kv_cache_bytes)}",
            f"  = {self.num_blocks} blocks of {format_bytes(self.bytes_per_block)} = "
            f"{self.max_concurrent_tokens} concurrent tokens",
        ])


def _fix_flags(need_bytes: int, total: int, utilization: float, used: int) -> str:
    """The flags that would make `need_bytes` more fit, most specific first."""
    needed_f = (used + need_bytes) / total if total else math.inf
    raise_f = (
        f", or a higher --gpu-memory-utilization (at least {math.ceil(needed_f * 100) / 100:g})"
        if utilization < needed_f <= 1
        else ""
    )
    return (
        "pass a smaller --max-model-len, --max-num-seqs or --max-num-batched-tokens, a larger "
        "--ep-size, 4-bit experts (--quantization int4 or mxfp4)" + raise_f
    )


def check_weights_fit(memory: DeviceMemory, utilization: float, weight_bytes: int) -> None:
    """Refuse, before loading, weights that alone exceed F x total.

    Raises:
        StartupError: naming the bytes, F and the flags that would fix it.
    """
    budget = int(utilization * memory.total)
    if weight_bytes + memory.non_torch <= budget:
        return
    raise StartupError(
        f"weights need {weight_bytes} bytes ({format_bytes(weight_bytes)}) per rank, but "
        f"--gpu-memory-utilization {utilization:g} of the device's {memory.total} bytes "
        f"({format_bytes(memory.total)}) allows {budget} bytes"
        + (f" (less {format_bytes(memory.non_torch)} used outside torch)" if memory.non_torch
           else "")
        + "; "
        + _fix_flags(0, memory.total, utilization, weight_bytes + memory.non_torch)
    )


def size_kv_cache(
    memory: DeviceMemory,
    utilization: float,
    weight_bytes: int,
    activation_peak: int,
    plan: Plan,
    max_model_len: int,
    graph_pool: int = 0,
    graph_note: str = "no CUDA graphs",
) -> KVCacheSizing:
    """The KV blocks a device's budget buys after the weights, the activation peak and the
    decode graphs' pool.

    Args:
        memory: the device's memory after loading and profiling (its non_torch counts).
        utilization: F in (0, 1].
        weight_bytes: this rank's weights (bytes, as loaded).
        activation_peak: the profiled forward's peak (bytes, `profile_activation_peak`).
        plan: the startup plan (bytes per block, blocks per max_model_len request).
        max_model_len: longest request (tokens).
        graph_pool: the decode graphs' pool (bytes, `graph_pool_estimate`; 0 without graphs);
            graph_note: what it is, for the plan.

    Raises:
        StartupError: one max_model_len request does not fit; the message gives each term
            in bytes and the flags that would fix it.
    """
    budget = int(utilization * memory.total)
    used = weight_bytes + activation_peak + graph_pool + memory.non_torch
    kv_bytes = budget - used
    num_blocks = max(0, kv_bytes // plan.kv_bytes_per_block)
    sizing = KVCacheSizing(
        total=memory.total, utilization=utilization, weights=weight_bytes,
        activation_peak=activation_peak, non_torch=memory.non_torch, kv_cache_bytes=kv_bytes,
        bytes_per_block=plan.kv_bytes_per_block, block_size=plan.block_size,
        num_blocks=num_blocks, graph_pool=graph_pool, graph_note=graph_note,
    )
    need = plan.blocks_per_request(max_model_len)
    if num_blocks >= need:
        return sizing
    need_bytes = need * plan.kv_bytes_per_block
    fits = apply_sizing(plan, sizing).max_fitting_len()
    raise StartupError(
        f"KV cache too small for one request of max_model_len {max_model_len} tokens: it needs "
        f"{need} blocks ({need_bytes} bytes), but --gpu-memory-utilization {utilization:g} x "
        f"{memory.total} bytes total = {budget} bytes, less weights {weight_bytes}, "
        f"activations peak {activation_peak}, CUDA graphs {graph_pool} and non-torch "
        f"{memory.non_torch} bytes, leaves {max(kv_bytes, 0)} bytes ({num_blocks} blocks); "
        + _fix_flags(need_bytes, memory.total, utilization, used)
        + (" or --enforce-eager (no graph pool)" if graph_pool else "")
        + (f" (--max-model-len {fits} fits)" if fits >= 2 else "")
    )


def apply_sizing(plan: Plan, sizing: KVCacheSizing) -> Plan:
    """`plan` with its KV blocks as `sizing` says (source "gpu_memory_utilization F")."""
    return replace(
        plan,
        num_blocks=sizing.num_blocks,
        max_concurrent_tokens=sizing.max_concurrent_tokens,
        kv_cache_memory=sizing.num_blocks * plan.kv_bytes_per_block,
        kv_cache_source=f"gpu_memory_utilization {sizing.utilization:g}",
    )


def kv_plan_after_profile(
    plan: Plan,
    *,
    utilization: float,
    max_model_len: int,
    weight_bytes: int,
    profile: Callable[[], int],
    memory: Callable[[], DeviceMemory],
    graph_pool: Callable[[], int] | None = None,
    graph_note: str = "no CUDA graphs",
) -> Plan:
    """The startup plan with its KV blocks sized on the device: `profile()` runs the profile
    forward and returns its activation peak (bytes; `profile_activation_peak`), then
    `graph_pool()` (when decode graphs will be captured) estimates their pool (bytes,
    `graph_pool_estimate`), `memory()` reads the device (`cuda_device_memory`), and
    `size_kv_cache` does the rest. All are injectable, so this runs in tests without a GPU.

    Returns:
        `plan` with num_blocks, kv_cache_memory and kv_cache_source from the sizing, and the
        sizing's terms as its `device_lines` (printed by `Plan.describe`).

    Raises:
        StartupError: from `size_kv_cache`.
    """
    peak = profile()
    pool = graph_pool() if graph_pool is not None else 0
    sizing = size_kv_cache(
        memory(), utilization, weight_bytes, peak, plan, max_model_len, pool, graph_note
    )
    return replace(
        apply_sizing(plan, sizing),
        device_lines=(*plan.device_lines, *sizing.describe().splitlines()),
        graph_pool_bytes=pool,
    )
