"""Startup arithmetic from config.json alone, before any weight is loaded.

`ModelShape` (moe_engine/startup/model_shape.py) holds the sizes that matter, read from a Hugging
Face
config dict by the architecture's file (`moe_engine.models`); `make_plan` turns them
into weight bytes (experts vs the rest), KV-cache bytes per token and per block, the number of KV
blocks the memory budget buys, and the most tokens that can be cached at once. `Plan.check`
refuses a configuration in which one `max_model_len` request cannot fit, naming the numbers and
the flag that fixes it (DESIGN.md section 4, "Capacity is derived, not guessed").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_engine.errors import StartupError
from moe_engine.kv_cache.spec import (
    MLA_ATTENTION,
    AttentionGroup,
    KVCacheSpec,
    make_kv_cache_groups,
)
from moe_engine.startup.model_shape import ModelShape

GiB = 1 << 30
#: Upper bound of the default KV-cache budget (bytes) when --kv-cache-memory is not given.
DEFAULT_KV_CACHE_CAP = 4 * GiB
#: Fraction of (available memory - weights) the default KV-cache budget takes.
DEFAULT_KV_CACHE_FRACTION = 0.5



@dataclass(frozen=True)
class Plan:
    """What the memory budget buys. All sizes in bytes, lengths in tokens.

    Attributes:
        shape: the model.
        dtype: weight and KV-cache dtype.
        ep_size: expert-parallel ranks; expert bytes are per rank.
        block_size: tokens per KV block.
        max_model_len: longest request (prompt + output, tokens).
        weight_bytes_experts: routed-expert weights held by one rank.
        weight_bytes_other: every other weight (replicated on each rank).
        weight_bytes_packed: the copies the native linear kernels pack beside the dense
            projections and routers at their first forward (the weights stay, for weight
            updates; `kernels.plan.KernelPlan.linear_copy_bytes`); 0 where torch's GEMM runs.
        kv_bytes_per_token: K and V (MLA: the latent) of one token over all layers (what a
            cache without sliding-window groups holds per token): the sum of the groups'
            `KVCacheSpec.bytes_per_token`.
        kv_bytes_per_block: bytes of one block id: the K and V of block_size tokens in one
            layer of each group slot (= `kv_bytes_per_token * block_size` with one group; with
            G equal groups, 1/G of it, as each block belongs to one group).
        num_blocks: usable KV blocks in the pool (the null block, block 0, comes on top).
        max_concurrent_tokens: `num_blocks * block_size`.
        kv_cache_memory: bytes the pool takes (`num_blocks * kv_bytes_per_block`).
        kv_cache_source: where the budget came from ("--kv-cache-memory", "derived from free
            memory", "num_blocks_override").
        kv_specs: one spec per KV-cache group (`kv_cache.make_kv_cache_groups`).
        max_num_batched_tokens: the most tokens a step feeds one request (bounds what a
            sliding-window group holds during a prefill chunk); None: unbounded.
        device_lines: extra lines for `describe` about the device's memory (the
            `memory.KVCacheSizing` terms on CUDA; on a CPU the note that
            --gpu-memory-utilization is ignored there).
        state_bytes_per_request: a request's linear-attention state over all linear layers
            (conv state in `dtype`, recurrent state in float32; `kv_cache.state.MambaSpec`);
            0 without linear layers.
        num_state_slots: state slots, one per running request (max_num_seqs); their memory
            comes out of the same budget as the KV blocks.
    """

    shape: ModelShape
    dtype: torch.dtype
    ep_size: int
    block_size: int
    max_model_len: int
    weight_bytes_experts: int
    weight_bytes_other: int
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    num_blocks: int
    max_concurrent_tokens: int
    kv_cache_memory: int
    kv_cache_source: str = "--kv-cache-memory"
    kv_specs: tuple[KVCacheSpec, ...] = ()
    max_num_batched_tokens: int | None = None
    device_lines: tuple[str, ...] = ()
    state_bytes_per_request: int = 0
    num_state_slots: int = 0
    weight_bytes_packed: int = 0

    @property
    def state_memory(self) -> int:
        """Bytes the linear-attention state slots take (null slot included)."""
        slots = self.num_state_slots + 1 if self.num_state_slots else 0
        return self.state_bytes_per_request * slots

    @property
    def weight_bytes(self) -> int:
        """All weights one rank holds (as loaded; `held_bytes` adds the kernels' copies)."""
        return self.weight_bytes_experts + self.weight_bytes_other

    @property
    def held_bytes(self) -> int:
        """What one rank's weights take once the kernels have run: the weights and the linear
        kernels' packed copies (the KV budget derived from free memory leaves room for both)."""
        return self.weight_bytes + self.weight_bytes_packed

    def blocks_per_request(self, num_tokens: int | None = None) -> int:
        """The most KV blocks one request of `num_tokens` (default max_model_len) holds at
        once, over all groups (a sliding-window group's share is capped by its window)."""
        n = num_tokens or self.max_model_len
        if not self.kv_specs:
            return math.ceil(n / self.block_size)
        return sum(s.max_blocks_held(n, self.max_num_batched_tokens) for s in self.kv_specs)

    def group_lines(self, num_tokens: int | None = None) -> list[str]:
        """One line per KV-cache group: kind, layers, KV bytes per token, the most blocks one
        request of `num_tokens` (default max_model_len) holds in it."""
        n = num_tokens or self.max_model_len
        lines = []
        for g, spec in enumerate(self.kv_specs):
            kind = "full attention" if spec.sliding_window is None else (
                f"sliding window {spec.sliding_window}"
            )
            kind = "MLA latent" if spec.kind == MLA_ATTENTION else kind
            held = spec.max_blocks_held(n, self.max_num_batched_tokens)
            lines.append(
                f"KV group {g}: {kind}, {spec.num_layers} layers, "
                f"{format_bytes(spec.bytes_per_token)} per token, at most {held} blocks "
                f"({format_bytes(held * spec.bytes_per_block)}) per request of {n} tokens"
            )
        return lines

    def describe(self) -> str:
        """A few lines for the startup log: weights, KV bytes, blocks, concurrent tokens."""
        s = self.shape
        dtype = str(self.dtype).removeprefix("torch.")
        fits = self.max_concurrent_tokens / self.max_model_len
        return "\n".join([
            f"model: {s.architecture}, {s.num_layers} layers ({len(s.moe_layers)} MoE), "
            f"{s.num_experts} experts top-{s.top_k}, {dtype}",
            f"weights: {format_bytes(self.weight_bytes)} = "
            f"{format_bytes(self.weight_bytes_experts)} experts + "
            f"{format_bytes(self.weight_bytes_other)} other"
            + (f" + {format_bytes(self.weight_bytes_packed)} packed by the linear kernels"
               if self.weight_bytes_packed else "")
            + (f" (per rank, ep_size {self.ep_size})" if self.ep_size > 1 else ""),
            f"KV cache: {format_bytes(self.kv_bytes_per_token)} per token over all layers"
            + self._mla_note() + ", "
            f"{format_bytes(self.kv_bytes_per_block)} per block of {self.block_size} tokens"
            + (f" ({len(self.kv_specs)} groups)" if len(self.kv_specs) > 1 else ""),
            *(self.group_lines() if len(self.kv_specs) > 1 else []),
            f"KV blocks: {self.num_blocks} ({format_bytes(self.kv_cache_memory)}, "
            f"{self.kv_cache_source}) = {self.max_concurrent_tokens} concurrent tokens "
            f"({fits:.1f} requests of max_model_len {self.max_model_len})",
            *self._state_lines(),
            *self.device_lines,
        ])

    def _state_lines(self) -> list[str]:
        """The describe() lines of the linear-attention state ([] without linear layers)."""
        if not self.state_bytes_per_request:
            return []
        per_token = max(self.kv_bytes_per_token, 1)
        return [
            f"linear-attention state: {format_bytes(self.state_bytes_per_request)} per request "
            f"over {len(self.shape.linear_attention_layers())} layers (conv {self.dtype_name}, "
            f"recurrent float32; the KV of "
            f"{self.state_bytes_per_request / per_token:.0f} tokens), "
            f"{self.num_state_slots} slots (max_num_seqs) + 1 null slot = "
            f"{format_bytes(self.state_memory)} "
            f"beside the KV blocks; concurrent requests: {self.num_state_slots} by their state, "
            f"{self.max_concurrent_tokens // self.max_model_len} of max_model_len by the KV"
        ]

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    def _mla_note(self) -> str:
        """The describe() note for MLA latents, e.g. ' (MLA latent 576 x 61 layers)'; ''
        when the cache holds K and V."""
        s = self.shape
        if not s.kv_lora_rank:
            return ""
        return f" (MLA latent {s.kv_lora_rank + s.qk_rope_head_dim} x {s.num_layers} layers)"

    def check(self, max_model_len: int | None = None) -> None:
        """Refuse a configuration in which one request of `max_model_len` tokens cannot run.

        Raises:
            StartupError: when max_model_len exceeds the model's max_position_embeddings, or
                when its KV blocks exceed the pool; the message gives the numbers and the flag
                (--max-model-len, --kv-cache-memory) that fixes it.
        """
        max_model_len = max_model_len or self.max_model_len
        self.check_context(max_model_len)
        need = self.blocks_per_request(max_model_len)
        if self.num_blocks >= need:
            return
        need_bytes = need * self.kv_bytes_per_block
        groups = (
            " (" + "; ".join(self.group_lines(max_model_len)) + ")"
            if len(self.kv_specs) > 1
            else ""
        )
        fits = self.max_fitting_len()
        raise StartupError(
            f"KV cache too small for one request of max_model_len {max_model_len} tokens: it "
            f"needs {need} blocks of {self.block_size} tokens ({need_bytes} bytes, "
            f"{format_bytes(need_bytes)} at {self.kv_bytes_per_token} bytes per token){groups} "
            f"but the cache has {self.num_blocks} blocks ({self.kv_cache_memory} bytes, "
            f"{self.kv_cache_source}), {self.max_concurrent_tokens} tokens. Pass "
            f"--kv-cache-memory {need_bytes} or more"
            + (f", or --max-model-len {fits} or less." if fits >= 2 else ".")
        )

    def check_context(self, max_model_len: int | None = None) -> None:
        """Refuse a max_model_len beyond the model's max_position_embeddings (what `check`
        tests before the blocks; alone where the blocks are sized later, on CUDA).

        Raises:
            StartupError: naming both lengths and the --max-model-len that fits.
        """
        max_model_len = max_model_len or self.max_model_len
        if max_model_len > self.shape.max_position_embeddings:
            raise StartupError(
                f"max_model_len {max_model_len} tokens exceeds the model's "
                f"max_position_embeddings {self.shape.max_position_embeddings}; "
                f"pass --max-model-len {self.shape.max_position_embeddings} or less"
            )

    def max_fitting_len(self) -> int:
        """The longest request (tokens, at most max_model_len) whose blocks fit in the pool;
        0 when none does."""
        lo, hi = 0, self.max_model_len
        while lo < hi:  # blocks_per_request is non-decreasing in the length
            mid = (lo + hi + 1) // 2
            if self.blocks_per_request(mid) <= self.num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def make_plan(
    shape: ModelShape,
    dtype: torch.dtype,
    *,
    block_size: int,
    max_model_len: int,
    kv_cache_memory: int | None,
    num_blocks_override: int | None = None,
    ep_size: int = 1,
    num_local_experts: int | None = None,
    available_memory: int | None = None,
    max_num_seqs: int | None = None,
    expert_bits_per_weight: float | None = None,
    dense_bits_per_weight: float | None = None,
    max_num_batched_tokens: int | None = None,
    attention_groups: list[AttentionGroup] | None = None,
    packed_bytes_per_weight: float = 0.0,
) -> Plan:
    """Weight and KV-cache arithmetic for one rank.

    Args:
        shape: the model.
        dtype: weight and KV-cache dtype (bytes per element from `dtype.itemsize`).
        block_size: tokens per KV block.
        max_model_len: longest request (tokens).
        kv_cache_memory: KV-cache budget (bytes); None derives min(4 GiB, 0.5 x (available -
            weights)), raised to one max_model_len request when that still fits in available.
        num_blocks_override: exact number of blocks; wins over the budget.
        ep_size: expert-parallel ranks; each holds num_experts / ep_size experts.
        num_local_experts: expert slots of this rank when a placement says so (replicas
            included; ep_size then need not divide num_experts); None = num_experts / ep_size.
        available_memory: bytes free for weights + cache; None reads MemAvailable.
        max_num_seqs: when the budget is derived, no more blocks than max_num_seqs requests of
            max_model_len can ever hold are reserved.
        expert_bits_per_weight: storage of routed experts when quantized (e.g. 4.25 for int4 at
            group 128 with fp32 scales, or MXFP4); None = `dtype`.
        dense_bits_per_weight: with `--quantized-layers all`, the 4-bit copies' storage that
            the dense projections hold beside their `dtype` weights (counted in `other`, from
            `ModelShape.dense_projection_params`); None: no copies.
        packed_bytes_per_weight: bytes per weight of the copy the linear kernel packs beside
            each float dense projection and router (`KernelPlan.linear_copy_bytes`; the
            projections that are 4-bit under `dense_bits_per_weight` get none); 0: none.
        max_num_batched_tokens: the step's token budget: the longest prefill chunk, which
            bounds a sliding-window group's blocks per request; None: unbounded.
        attention_groups: the model's layers by attention kind (`MoeCausalLM.
            kv_cache_groups_for`); None: `shape.attention_groups()`. They are split into equal
            KV-cache groups (`kv_cache.make_kv_cache_groups`) whose layers share cache tensors,
            so one block costs the bytes of one group's layers.

    Raises:
        StartupError: when num_experts is not divisible by ep_size, or the weights alone do
            not fit in available memory (only when the budget is derived).
    """
    if num_local_experts is None and (
        ep_size < 1 or (shape.num_experts and shape.num_experts % ep_size)
    ):
        raise StartupError(
            f"num_experts {shape.num_experts} is not divisible by ep_size {ep_size}; "
            f"choose an ep_size that divides it"
        )
    itemsize = dtype.itemsize
    if num_local_experts is None:
        num_local_experts = shape.num_experts // ep_size if shape.num_experts else 0
    share = num_local_experts / shape.num_experts if shape.num_experts else 0.0
    expert_params = round(shape.expert_params() * share)
    if expert_bits_per_weight is None:
        experts = expert_params * itemsize
    else:
        experts = math.ceil(expert_params * expert_bits_per_weight / 8)
    experts += round(shape.expert_bias_params() * share) * itemsize
    other = shape.other_params() * itemsize + shape.float32_params() * (4 - itemsize)
    if dense_bits_per_weight is not None:
        other += math.ceil(shape.dense_projection_params() * dense_bits_per_weight / 8)
    packed_params = len(shape.moe_layers) * shape.router_params() + (
        shape.dense_projection_params() if dense_bits_per_weight is None else 0
    )
    packed = math.ceil(packed_params * packed_bytes_per_weight)
    kv_groups = make_kv_cache_groups(
        attention_groups or shape.attention_groups(),
        block_size=block_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
    )
    kv_specs = tuple(g.spec for g in kv_groups)
    state_slots, state_bytes, state_memory = _state_budget(shape, dtype, max_num_seqs)
    per_token = sum(s.bytes_per_token for s in kv_specs)
    per_block = kv_specs[0].bytes_per_block  # every group has the same number of layers
    one_request = sum(s.max_blocks_held(max_model_len, max_num_batched_tokens) for s in kv_specs)
    if num_blocks_override is not None:
        num_blocks, source = num_blocks_override, "num_blocks_override"
    elif kv_cache_memory is not None:
        _check_state_fits(kv_cache_memory, "--kv-cache-memory", state_bytes, state_slots,
                          per_block * one_request)
        num_blocks = (kv_cache_memory - state_memory) // per_block
        source = "--kv-cache-memory"
    else:
        budget = default_kv_cache_memory(
            experts + other + packed, per_block * one_request + state_memory, available_memory
        )
        _check_state_fits(budget, "derived from free memory", state_bytes, state_slots,
                          per_block * one_request)
        num_blocks, source = (budget - state_memory) // per_block, "derived from free memory"
        if max_num_seqs is not None:
            most = max_num_seqs * one_request
            if most < num_blocks:
                num_blocks, source = most, "max_num_seqs x max_model_len"
    return Plan(
        shape=shape, dtype=dtype, ep_size=ep_size, block_size=block_size,
        max_model_len=max_model_len, weight_bytes_experts=experts, weight_bytes_other=other,
        weight_bytes_packed=packed,
        kv_bytes_per_token=per_token, kv_bytes_per_block=per_block, num_blocks=num_blocks,
        max_concurrent_tokens=num_blocks * block_size, kv_cache_memory=num_blocks * per_block,
        kv_cache_source=source, kv_specs=kv_specs, max_num_batched_tokens=max_num_batched_tokens,
        state_bytes_per_request=state_bytes, num_state_slots=state_slots,
    )


def _check_state_fits(budget: int, source: str, per_request: int, slots: int,
                      one_request_kv: int) -> None:
    """Refuse a budget that the state slots fill before one max_model_len request's KV fits.

    Raises:
        StartupError: naming the state bytes, max_num_seqs, the budget and what fits.
    """
    if not per_request or per_request * (slots + 1) + one_request_kv <= budget:
        return
    fits = (budget - one_request_kv) // per_request - 1
    advice = f"lower --max-num-seqs to {fits} or less, or " if fits >= 1 else ""
    raise StartupError(
        f"the linear-attention state of max_num_seqs {slots} requests ({slots} + 1 null slots "
        f"x {format_bytes(per_request)} = {format_bytes(per_request * (slots + 1))}) and one "
        f"max_model_len request's KV ({format_bytes(one_request_kv)}) exceed the KV-cache "
        f"budget {format_bytes(budget)} ({source}); {advice}raise --kv-cache-memory"
    )


def _state_budget(shape: ModelShape, dtype: torch.dtype, max_num_seqs: int | None
                  ) -> tuple[int, int, int]:
    """(state slots, bytes per request, bytes of all slots with the null one) of the
    linear-attention layers; zeros without them. One slot per running request.

    Raises:
        StartupError: linear layers without max_num_seqs to size the slots by.
    """
    layers = shape.linear_attention_layers()
    if not layers:
        return 0, 0, 0
    if not max_num_seqs:
        raise StartupError("a model with linear-attention layers needs max_num_seqs to size "
                           "its state slots")
    (c, w), (hv, dk, dv) = shape.linear_state_shapes()
    per_request = len(layers) * (c * w * dtype.itemsize + hv * dk * dv * 4)
    return max_num_seqs, per_request, per_request * (max_num_seqs + 1)


def default_kv_cache_memory(
    weight_bytes: int, one_request_bytes: int, available_memory: int | None = None
) -> int:
    """The KV-cache budget (bytes) when --kv-cache-memory is not given.

    min(4 GiB, 0.5 x (available - weights)), but at least one max_model_len request
    (`one_request_bytes`) as long as that fits in what the weights leave.

    Raises:
        StartupError: when the weights alone exceed available memory.
    """
    available = available_memory if available_memory is not None else mem_available()
    left = available - weight_bytes
    if left <= 0:
        raise StartupError(
            f"weights need {format_bytes(weight_bytes)} but only {format_bytes(available)} "
            f"memory is available; free memory, store the routed experts in 4 bits "
            f"(--quantization int4 or mxfp4), or spread them over more ranks (--ep-size)"
        )
    budget = min(DEFAULT_KV_CACHE_CAP, int(DEFAULT_KV_CACHE_FRACTION * left))
    return max(budget, min(one_request_bytes, left))


def mem_available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable in /proc/meminfo);
    falls back to total physical memory / 2 where /proc/meminfo does not exist."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2


def format_bytes(n: float) -> str:
    """`n` bytes in binary units: "512 B", "1.50 KiB", "229.0 MiB", "4.00 GiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if value < 100 else f"{value:.1f} {unit}"
    return f"{int(n)} B"

