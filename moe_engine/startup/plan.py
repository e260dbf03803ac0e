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
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moe_engine.errors import StartupError
from moe_engine.kv_cache.spec import (
    MLA_ATTENTION,
    AttentionGroup,
    KVCacheSpec,
    make_kv_cache_groups,
)
from moe_engine.startup.host_memory import (
    DEFAULT_CPU_MEMORY_UTILIZATION,
    HostMemory,
    HostSizing,
    activation_terms,
    read_host_memory,
)
from moe_engine.startup.model_shape import ModelShape

GiB = 1 << 30


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
        weight_bytes_packed: the copies the native kernels pack beside the dense
            projections and routers (`kernels.plan.KernelPlan.linear_copy_bytes`) and beside
            float routed experts (`expert_copy_bytes`); the weights stay, for weight updates;
            0 where torch's GEMM and experts run.
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
        graph_pool_bytes: the decode CUDA graphs' pool the KV budget left room for
            (`memory.graph_pool_estimate`); 0 without graphs, and always on a CPU.
        state_bytes_per_request: a request's linear-attention state over all linear layers
            (conv state in `dtype`, recurrent state in float32; `kv_cache.state.MambaSpec`);
            0 without linear layers.
        num_state_slots: state slots, one per running request (max_num_seqs); their memory
            comes out of the same budget as the KV blocks.
        max_model_len_note: why max_model_len is below the model's (`make_plan`'s
            shrink_to_fit), "" when it is not.
        host: on a CPU, the host-memory terms the budget was checked against
            (`host_memory.HostSizing`: --cpu-memory-utilization, memory in use, activations);
            None where the host was not consulted (CUDA, offline arithmetic).
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
    graph_pool_bytes: int = 0
    state_bytes_per_request: int = 0
    num_state_slots: int = 0
    weight_bytes_packed: int = 0
    host: HostSizing | None = None
    max_model_len_note: str = ""

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

    @property
    def planned_peak_bytes(self) -> int | None:
        """This rank's planned resident set at its peak on a CPU (what it held when it planned,
        weights held, activations, KV cache and state); None without host terms."""
        if self.host is None:
            return None
        return self.host.total_bytes(self.kv_cache_memory + self.state_memory)

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
            if spec.kind == MLA_ATTENTION:
                kind = "MLA latent + indexer keys" if spec.index_head_dim else "MLA latent"
            if spec.attention_chunk_size is not None:
                kind = f"chunked attention {spec.attention_chunk_size}"
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
        # a request's blocks over all groups (a sliding-window group holds fewer than its
        # length's), not concurrent tokens / max_model_len
        fits = self.num_blocks / max(1, self.blocks_per_request())
        return "\n".join([
            f"model: {s.architecture}, {s.num_layers} layers ({len(s.moe_layers)} MoE), "
            f"{s.num_experts} experts top-{s.top_k}, {dtype}",
            f"weights: {format_bytes(self.weight_bytes)} = "
            f"{format_bytes(self.weight_bytes_experts)} experts + "
            f"{format_bytes(self.weight_bytes_other)} other"
            + (f" + {format_bytes(self.weight_bytes_packed)} packed by the native kernels"
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
            *([self.max_model_len_note] if self.max_model_len_note else []),
            *self._host_lines(),
            *self.device_lines,
        ])

    def _host_lines(self) -> list[str]:
        """The describe() lines of the host-memory terms ([] where the host was not asked)."""
        if self.host is None:
            return []
        return [self.host.describe(),
                f"planned peak resident memory: {format_bytes(self.planned_peak_bytes or 0)} "
                f"(this process before loading {format_bytes(self.host.memory.process)} + "
                f"weights + activations + KV cache)"]

    def _state_lines(self) -> list[str]:
        """The describe() lines of the linear-attention state ([] without linear layers)."""
        if not self.state_bytes_per_request:
            return []
        per_token = max(self.kv_bytes_per_token, 1)
        conv, recurrent = self.shape.linear_state_shapes()
        parts = [f"conv {self.dtype_name}"] * bool(conv) + ["recurrent float32"] * bool(recurrent)
        return [
            f"linear-attention state: {format_bytes(self.state_bytes_per_request)} per request "
            f"over {len(self.shape.linear_attention_layers())} layers "
            f"({', '.join(parts)}; the KV of "
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
        keys = f" + indexer keys {s.index_head_dim}" if s.index_head_dim else ""
        return f" (MLA latent {s.kv_lora_rank + s.qk_rope_head_dim}{keys} x {s.num_layers} layers)"

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
        return _longest_fitting(self.blocks_per_request, self.max_model_len, self.num_blocks)


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
    host: HostMemory | None = None,
    cpu_memory_utilization: float = DEFAULT_CPU_MEMORY_UTILIZATION,
    ranks_on_host: int = 1,
    max_num_seqs: int | None = None,
    expert_bits_per_weight: float | None = None,
    dense_bits_per_weight: float | None = None,
    max_num_batched_tokens: int | None = None,
    attention_groups: list[AttentionGroup] | None = None,
    packed_bytes_per_weight: float = 0.0,
    expert_copy_bytes_per_weight: float = 0.0,
    shrink_to_fit: bool = False,
) -> Plan:
    """Weight and KV-cache arithmetic for one rank.

    Args:
        shape: the model.
        dtype: weight and KV-cache dtype (bytes per element from `dtype.itemsize`).
        block_size: tokens per KV block.
        max_model_len: longest request (tokens).
        kv_cache_memory: KV-cache budget (bytes); None derives it from the host's memory
            (`host_memory`: F x total - in use - weights held - activations), capped at what
            max_num_seqs requests of max_model_len can hold.
        num_blocks_override: exact number of blocks; wins over the budget.
        ep_size: expert-parallel ranks; each holds num_experts / ep_size experts.
        num_local_experts: expert slots of this rank when a placement says so (replicas
            included; ep_size then need not divide num_experts); None = num_experts / ep_size.
        host: the machine's memory before loading (`host_memory.read_host_memory`): the
            budget is checked against it (an explicit kv_cache_memory too); None: read it
            when the budget is derived, else no host check (CUDA, offline arithmetic).
        cpu_memory_utilization: F, the fraction of the host's total memory the engine may use.
        ranks_on_host: engine ranks sharing the host (each gets 1/ranks of it).
        shrink_to_fit: max_model_len is the model's own (no --max-model-len given): when one
            request of it does not fit in the derived budget, the plan's max_model_len becomes
            the longest that does (as llama.cpp's context defaults below the trained one), and
            `max_model_len_note` says so.
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
        expert_copy_bytes_per_weight: bytes per weight of the copy the float experts' kernel
            packs beside the routed experts (`KernelPlan.expert_copy_bytes`); 0: none (4-bit
            experts replace theirs).
        max_num_batched_tokens: the step's token budget: the longest prefill chunk, which
            bounds a sliding-window group's blocks per request; None: unbounded.
        attention_groups: the model's layers by attention kind (`MoeCausalLM.
            kv_cache_groups_for`); None: `shape.attention_groups()`. They are split into equal
            KV-cache groups (`kv_cache.make_kv_cache_groups`) whose layers share cache tensors,
            so one block costs the bytes of one group's layers.

    Raises:
        StartupError: when num_experts is not divisible by ep_size, or (host checked) the
            weights and activations leave no room for one max_model_len request, or an
            explicit kv_cache_memory exceeds what they leave.
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
    packed = math.ceil(packed_params * packed_bytes_per_weight
                       + expert_params * expert_copy_bytes_per_weight)
    kv_groups = make_kv_cache_groups(
        attention_groups or shape.attention_groups(),
        block_size=block_size,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        dtype=dtype,
        kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        index_head_dim=shape.index_head_dim,
    )
    kv_specs = tuple(g.spec for g in kv_groups)
    state_slots, state_bytes, state_memory = _state_budget(shape, dtype, max_num_seqs)
    per_token = sum(s.bytes_per_token for s in kv_specs)
    per_block = kv_specs[0].bytes_per_block  # every group has the same number of layers
    one_request = sum(s.max_blocks_held(max_model_len, max_num_batched_tokens) for s in kv_specs)
    sizing, note = None, ""
    if host is not None or (kv_cache_memory is None and num_blocks_override is None):
        step = max_num_batched_tokens or max_model_len
        per_token, logits = activation_terms(shape, max_num_seqs or 1, num_local_experts or 0)
        sizing = HostSizing(
            host or read_host_memory(), cpu_memory_utilization, ranks_on_host,
            experts + other + packed, step * per_token + logits, step, per_token)
    if num_blocks_override is not None:
        num_blocks, source = num_blocks_override, "num_blocks_override"
    elif kv_cache_memory is not None:
        if sizing is not None:
            check_host_fits(sizing, kv_cache_memory, "--kv-cache-memory",
                            experts_quantized=expert_bits_per_weight is not None)
        _check_state_fits(kv_cache_memory, "--kv-cache-memory", state_bytes, state_slots,
                          per_block * one_request)
        num_blocks = (kv_cache_memory - state_memory) // per_block
        source = "--kv-cache-memory"
    else:
        assert sizing is not None
        fits = _longest_fitting(
            lambda n: sum(s.max_blocks_held(n, max_num_batched_tokens) for s in kv_specs),
            max_model_len, max(0, sizing.kv_budget - state_memory) // per_block, step=256)
        if shrink_to_fit and per_block * one_request + state_memory > sizing.kv_budget:
            if fits >= min(max_model_len, MIN_SHRUNK_LEN):
                note = (f"max_model_len {fits}: the model's {max_model_len} tokens need "
                        f"{format_bytes(per_block * one_request)} of KV cache for one request, "
                        f"more than the {format_bytes(sizing.kv_budget)} left; pass "
                        f"--max-model-len to choose, or raise --cpu-memory-utilization")
                max_model_len, one_request = fits, sum(
                    s.max_blocks_held(fits, max_num_batched_tokens) for s in kv_specs)
        check_host_fits(sizing, per_block * one_request + state_memory,
                        f"one request of max_model_len {max_model_len}", fits,
                        expert_bits_per_weight is not None)
        budget = sizing.kv_budget
        source = f"cpu_memory_utilization {cpu_memory_utilization:g}"
        _check_state_fits(budget, source, state_bytes, state_slots, per_block * one_request)
        num_blocks = (budget - state_memory) // per_block
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
        state_bytes_per_request=state_bytes, num_state_slots=state_slots, host=sizing,
        max_model_len_note=note,
    )


#: The shortest max_model_len `make_plan` shrinks to; below it the model is refused instead.
MIN_SHRUNK_LEN = 2048


def _longest_fitting(need: Callable[[int], int], limit: int, blocks: int,
                     step: int = 1) -> int:
    """The longest request (tokens, at most `limit`, a multiple of `step`) whose `need(n)`
    blocks fit in `blocks`; 0 when none does. `need` is non-decreasing in the length."""
    lo, hi = 0, limit // step
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if need(mid * step) <= blocks:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


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
    conv, recurrent = shape.linear_state_shapes()
    per_layer = math.prod(conv) * dtype.itemsize if conv else 0
    per_layer += math.prod(recurrent) * 4 if recurrent else 0
    per_request = len(layers) * per_layer
    return max_num_seqs, per_request, per_request * (max_num_seqs + 1)


def check_host_fits(sizing: HostSizing, kv_bytes: int, what: str, fitting_len: int = 0,
                    experts_quantized: bool = False) -> None:
    """Refuse, before loading, a plan whose weights, activations and `kv_bytes` of cache
    (one max_model_len request's, or an explicit --kv-cache-memory) exceed this rank's share
    of --cpu-memory-utilization x total memory.

    Args:
        fitting_len: the longest max_model_len whose one request fits (0: none, or unknown).
        experts_quantized: the routed experts are 4-bit already (no advice to make them so).

    Raises:
        StartupError: naming every term and the flags that would make it fit.
    """
    left = sizing.kv_budget
    if kv_bytes <= left:
        return
    need = sizing.weights + sizing.activations + kv_bytes
    m = sizing.memory
    fixes = []
    util = (need * sizing.ranks + m.in_use) / m.total
    if util <= 0.95:
        fixes.append(f"--cpu-memory-utilization {math.ceil(util * 100) / 100:g}")
    if what == "--kv-cache-memory" and left > 0:
        fixes.append(f"--kv-cache-memory {max(left, 0)} or less")
    elif fitting_len:
        fixes.append(f"--max-model-len {fitting_len} or less")
    tokens = sizing.tokens_fitting(sizing.activations - (kv_bytes - left))
    if tokens >= 256:
        fixes.append(f"--max-num-batched-tokens {tokens} or less")
    if not experts_quantized:
        fixes.append("4-bit experts (--quantization int4, or mxfp4)")
    if kv_bytes - left < m.in_use:
        fixes.append(f"free {format_bytes(kv_bytes - left)} of memory")
    raise StartupError(
        f"the model does not fit in host memory: weights held {format_bytes(sizing.weights)} "
        f"+ activations {format_bytes(sizing.activations)} ({sizing.num_tokens} tokens per "
        f"step) + KV cache {format_bytes(kv_bytes)} ({what}) = {format_bytes(need)} "
        f"({need} bytes), but {format_bytes(m.total)} total x cpu_memory_utilization "
        f"{sizing.utilization:g} - {format_bytes(m.in_use)} in use"
        + (f", / {sizing.ranks} ranks on this host," if sizing.ranks > 1 else "")
        + (f" leaves {format_bytes(sizing.share)} ({sizing.share} bytes)" if sizing.share > 0
           else " leaves nothing")
        + "; try "
        + ", or ".join(fixes)
    )


def format_bytes(n: float) -> str:
    """`n` bytes in binary units: "512 B", "1.50 KiB", "229.0 MiB", "4.00 GiB"."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            value = n / scale
            return f"{value:.2f} {unit}" if value < 100 else f"{value:.1f} {unit}"
    return f"{int(n)} B"

