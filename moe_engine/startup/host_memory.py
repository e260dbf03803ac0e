"""Host memory sizing on a CPU: `--cpu-memory-utilization F`, the CPU twin of
`--gpu-memory-utilization` (moe_engine/startup/memory.py).

The engine may use F x the machine's total memory. Before any weight is read, the startup plan
takes from that what is already in use (other processes, and this one's interpreter, torch and
kernels), then everything the engine will hold besides the KV cache, and gives the rest to the
KV cache (vLLM's `determine_available_memory`, with the activation peak estimated instead of
profiled: a profile forward of `max_num_batched_tokens` tokens takes a minute at real size on
a few cores, and the plan must refuse before loading):

    kv_cache_bytes = (F * total - (total - available)) / ranks on this host
                     - weights held (as loaded + the kernels' packed copies)
                     - activation peak of one step of max_num_batched_tokens tokens

`available` is the kernel's MemAvailable (free + reclaimable page cache). The default F = 0.8
leaves a fifth of the machine to the OS and the page cache (the checkpoint's pages are read
through it at load). A configuration that cannot hold one `max_model_len` request, or whose
explicit `--kv-cache-memory` exceeds what is left, raises `StartupError` before loading, naming
the bytes and the flags that would make it fit. The arithmetic is pure: tests pass a
`HostMemory`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from dataclasses import dataclass
from pathlib import Path

from moe_engine.startup.model_shape import ModelShape

#: Default `--cpu-memory-utilization`: a fifth of the machine stays with the OS and page cache.
DEFAULT_CPU_MEMORY_UTILIZATION = 0.8
#: Sampling works on the last position's logits per request (float32), a few arrays of them at
#: once (logits, probabilities / sorted values, the processed copy).
LOGITS_COPIES = 3


@dataclass(frozen=True)
class HostMemory:
    """The machine's memory at one moment (bytes).

    Attributes:
        total: MemTotal. available: MemAvailable (free + reclaimable page cache).
        process: this process's resident set (VmRSS) then: its interpreter, torch and
            kernels, part of `in_use`.
    """

    total: int
    available: int
    process: int = 0

    @property
    def in_use(self) -> int:
        """What other processes and this one so far hold (total - available)."""
        return max(0, self.total - self.available)

    @classmethod
    def unlimited(cls) -> HostMemory:
        """A machine that fits anything (offline arithmetic: bench/plan_configs.py)."""
        return cls(total=1 << 60, available=1 << 60)


def read_host_memory(cgroup: Path = Path("/sys/fs/cgroup")) -> HostMemory:
    """MemTotal and MemAvailable from /proc/meminfo (where it does not exist, the physical
    memory from sysconf, half of it counted available), bounded by this process's cgroup
    memory limit when it has one (a container's `--memory`: cgroup v2 `memory.max` and
    `memory.current`, v1 `memory.limit_in_bytes` and `memory.usage_in_bytes` under
    `cgroup`), so that the plan sizes against what the container may use."""
    fields = _kib_fields("/proc/meminfo", ("MemTotal", "MemAvailable"))
    process = _kib_fields("/proc/self/status", ("VmRSS",)).get("VmRSS", 0)
    if len(fields) == 2:
        total, available = fields["MemTotal"], fields["MemAvailable"]
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        available = total // 2
    limit = cgroup_limit(cgroup)
    if limit is not None and limit[0] < total:
        total, available = limit[0], min(available, max(0, limit[0] - limit[1]))
    return HostMemory(total, available, process)


def cgroup_limit(root: Path) -> tuple[int, int] | None:
    """(limit, usage) bytes of the cgroup memory controller at `root` (v2, else v1); None
    without a limit ("max", or a v1 limit near 2^63) or a readable controller."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes",
                                    "memory/memory.usage_in_bytes")):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None
        return int(limit_text), usage
    return None


def _kib_fields(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """The `keys` of a /proc file of "Key: N kB" lines, in bytes ({} where it is missing)."""
    fields: dict[str, int] = {}
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key in keys:
                fields[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return fields


def activation_peak_bytes(shape: ModelShape, num_tokens: int, max_num_seqs: int,
                          local_experts: int) -> int:
    """The most bytes one step's activations hold at once on a CPU: a forward of `num_tokens`
    tokens (`max_num_batched_tokens`), all in float32 (the CPU kernels compute in float32),
    then sampling for `max_num_seqs` requests.

    Per token, the residual stream, the normed input and the layer's output ([3, H]) live
    throughout; on top, the larger of the attention block (QKV and the rotated q/k copies
    [2 (Hq + 2 Hkv) D], the attention output and its projection [Hq D + H]; MLA: its widest
    projection in place of QKV) and the MoE block (per routed pair, the gate/up output and the
    activated half [3 I], and the float32 copy of the input and the combined output [2 H]; a
    dense MLP's [3 I_dense] where that is wider). The last positions' logits add
    `LOGITS_COPIES` x max_num_seqs x vocab floats. Measured against VmHWM on gpt-oss- and
    Qwen3-shaped checkpoints (tests/test_host_memory.py): the estimate is an upper bound
    within about 20% at 512-2048 tokens.

    Args:
        shape: the model. num_tokens: tokens in the largest step. max_num_seqs: requests
        sampled in one step. local_experts: experts on this rank (bounds the routed pairs'
        distinct experts; the pairs themselves are num_tokens x top_k).
    """
    per_token, fixed = activation_terms(shape, max_num_seqs, local_experts)
    return num_tokens * per_token + fixed


def activation_terms(shape: ModelShape, max_num_seqs: int, local_experts: int
                     ) -> tuple[int, int]:
    """(bytes per token of the step, bytes of the sampled logits) of `activation_peak_bytes`."""
    h = shape.hidden_size
    if shape.kv_lora_rank:
        qkv = shape.num_heads * (shape.qk_nope_head_dim + shape.qk_rope_head_dim + shape.v_head_dim)
    else:
        qkv = (shape.num_heads + 2 * shape.num_kv_heads) * shape.head_dim
    attention = 2 * qkv + shape.num_heads * shape.head_dim + h
    pairs = min(shape.top_k, local_experts) if shape.num_experts else 0
    moe = pairs * 3 * shape.moe_intermediate_size + 2 * h
    moe += 3 * shape.shared_expert_intermediate_size
    dense = 3 * shape.intermediate_size if shape.num_dense_layers else 0
    per_token = 3 * h + max(attention, moe, dense)
    return 4 * per_token, 4 * LOGITS_COPIES * max_num_seqs * shape.vocab_size


@dataclass(frozen=True)
class HostSizing:
    """The terms of the KV-cache budget on a CPU (bytes), as the startup plan prints them.

    Attributes:
        memory: the machine's memory before loading. utilization: F.
        ranks: engine ranks sharing this machine (expert parallelism on one host).
        weights: this rank's weights as held (packed copies included).
        activations: `activation_peak_bytes` at max_num_batched_tokens.
        num_tokens: max_num_batched_tokens.
        activation_per_token: the per-token part of `activations` (bytes).
    """

    memory: HostMemory
    utilization: float
    ranks: int
    weights: int
    activations: int
    num_tokens: int
    activation_per_token: int = 0

    def tokens_fitting(self, activations: int) -> int:
        """The most tokens per step whose activations take at most `activations` bytes
        (rounded down to a multiple of 256; 0 when none or unknown)."""
        fixed = self.activations - self.num_tokens * self.activation_per_token
        if self.activation_per_token <= 0 or activations <= fixed:
            return 0
        return (activations - fixed) // self.activation_per_token // 256 * 256

    @property
    def share(self) -> int:
        """This rank's part of F x total after what is in use already."""
        usable = int(self.utilization * self.memory.total) - self.memory.in_use
        return usable // max(1, self.ranks)

    @property
    def kv_budget(self) -> int:
        """What the KV cache (and linear-attention state) may take; negative when even the
        weights and activations do not fit."""
        return self.share - self.weights - self.activations

    def describe(self) -> str:
        m, gib = self.memory, float(1 << 30)
        fraction = (f"{m.total / gib:.2f} GiB total x cpu_memory_utilization "
                    f"{self.utilization:g} - {m.in_use / gib:.2f} GiB in use")
        if self.ranks > 1:
            fraction = f"({fraction}) / {self.ranks} ranks on this host"
        return (
            f"host memory: {fraction} - "
            f"{self.weights / gib:.2f} GiB weights held - {self.activations / gib:.2f} GiB "
            f"activations ({self.num_tokens} tokens per step) = {self.kv_budget / gib:.2f} GiB "
            f"for the KV cache"
        )

    def total_bytes(self, kv_bytes: int) -> int:
        """What this rank's process is planned to hold at its peak (its resident set) with
        `kv_bytes` of cache: what it held when it planned (interpreter, torch, kernels), the
        weights, the activations and the cache."""
        return self.memory.process + self.weights + self.activations + kv_bytes


def release_free_heap() -> bool:
    """Hand the C heap's free pages back to the OS (glibc `malloc_trim(0)`): loading and
    packing free many temporaries of a few MiB, which glibc keeps in the heap (its mmap
    threshold rises as large blocks are freed), so without this the resident set stays a
    quarter GiB or more above what the engine holds. Returns whether it ran (False where the
    C library is not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        trim = None
    if trim is None:
        return False
    trim(0)
    return True
