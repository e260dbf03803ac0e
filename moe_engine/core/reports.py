"""What an engine core reports about itself: stats, expert load, weights and model info.

Functions of an `EngineCore` (its methods `get_stats`, `get_expert_load`, `weight_info` and
`model_info` call them), read from its parts: scheduler, KV cache, timer, expert-load recorder,
drafter, rollout control and the rank's communicator.
"""

from __future__ import annotations

from typing import Any

from moe_engine.core.outputs import CoreStats, ExpertLoad, KVCacheGroupStats, ModelInfo
from moe_engine.instrumentation import balancedness, imbalance_ratio
from quant.mxfp4 import MXFP4_BLOCK_SIZE

#: An `EngineCore` (not imported: `engine_core` imports this module).
Core = Any


def core_stats(core: Core) -> CoreStats:
    """Queue, KV and token counters (see the contract in the server's GetServerStats)."""
    pool = core.kv.pool
    comm = comm_counts(core)
    return CoreStats(
        num_running=len(core.scheduler.running),
        num_waiting=len(core.scheduler.waiting),
        kv_blocks_total=pool.num_blocks,
        kv_blocks_free=pool.num_free_blocks,
        kv_blocks_used=pool.num_blocks - pool.num_free_blocks,
        prefix_cache_queries=core.kv.prefix_cache_queries,
        prefix_cache_hits=core.kv.prefix_cache_hits,
        kv_cached_blocks=pool.num_cached_blocks,
        kv_groups=kv_group_stats(core),
        num_preemptions=core.scheduler.num_preemptions,
        **core.counters,
        dispatch_bytes_sent=comm.dispatch_bytes_sent if comm else 0,
        combine_bytes_sent=comm.combine_bytes_sent if comm else 0,
        min_dispatch_bytes=comm.min_dispatch_bytes if comm else 0,
        tokens_in=comm.tokens_in if comm else 0,
        tokens_received=comm.tokens_received if comm else 0,
        phase_seconds=core.timer.snapshot(),
        **spec_stats(core),
        state_slots_total=core.kv.state_slots.num_slots if core.kv.state_slots else 0,
        state_slots_free=core.kv.state_slots.num_free if core.kv.state_slots else 0,
        paused=core.rollout.paused,
        weight_version=core.rollout.weight_version,
        rank=core.rank_context.rank if core.rank_context else 0,
        eplb=eplb.snapshot() if (eplb := getattr(core, "eplb", None)) is not None else None,
    )


def spec_stats(core: Core) -> dict[str, Any]:
    """The speculative-decoding counters of `CoreStats` (zeros when it is off)."""
    if core.drafter is None:
        return {}
    s = core.drafter.stats
    return dict(
        spec_decode_num_drafts=s.num_drafts,
        spec_decode_num_draft_tokens=s.num_draft_tokens,
        spec_decode_num_accepted_tokens=s.num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=list(s.accepted_per_pos),
    )


def kv_group_stats(core: Core) -> list[KVCacheGroupStats]:
    """Per KV-cache group: kind, window (0 for full attention), layers, KV bytes per token
    and the distinct blocks live requests hold in it."""
    used = core.kv.blocks_used_per_group()
    return [
        KVCacheGroupStats(
            group=g,
            kind=spec.kind,
            sliding_window=spec.sliding_window or 0,
            num_layers=spec.num_layers,
            kv_bytes_per_token=spec.bytes_per_token,
            blocks_used=used[g],
        )
        for g, spec in enumerate(core.kv.specs)
    ]


def comm_counts(core: Core) -> Any:
    """This rank's dispatch/combine counters since startup (`comm.stats.CommCounts`:
    tokens and bytes), None for one rank."""
    if core.rank_context is None:
        return None
    stats = getattr(core.rank_context.communicator, "stats", None)
    return stats.total if stats is not None else None


def expert_load(core: Core) -> ExpertLoad:
    """Tokens routed to each expert of each MoE layer since startup, and per-layer summaries
    (`rank_tokens`: this rank's column of the per-rank load, under expert parallelism)."""
    counts = core.expert_load.snapshot()
    rank_tokens = None
    if core.rank_context is not None:
        rank_tokens = core.expert_load.rank_tokens.tolist()
    return ExpertLoad(
        moe_layers=list(core.expert_load.moe_layers),
        counts=counts.tolist(),
        window_counts=core.expert_load.window_counts().tolist(),
        window_steps=min(core.expert_load.num_steps, core.expert_load.window_steps),
        imbalance_ratio=imbalance_ratio(counts).tolist(),
        balancedness=balancedness(counts).tolist(),
        rank_tokens=rank_tokens,
    )


def weight_info(core: Core) -> dict:
    """Weight bytes of this rank by kind (`MoeCausalLM.weight_bytes_by_kind`, read from the
    loaded tensors) and how the routed experts are stored.

    Returns:
        weight_bytes_experts / _attention / _embeddings / _other (bytes);
        expert_weight_format "none" | "int4" | "mxfp4"; expert_group_size (values per
        scale, 0 for none); expert_checkpoint_format ("" when quantized at load time or
        not at all); expert_zero_points (int4 asymmetric).
    """
    q = core.config.quant
    group_size = {"int4": q.group_size, "mxfp4": MXFP4_BLOCK_SIZE}.get(q.method, 0)
    info = {f"weight_bytes_{k}": v for k, v in core.model.weight_bytes_by_kind().items()}
    return dict(
        info,
        expert_weight_format=q.method,
        expert_group_size=group_size,
        expert_checkpoint_format=q.checkpoint_format or "",
        expert_zero_points=q.method == "int4" and not q.symmetric,
    )


def model_info(core: Core) -> ModelInfo:
    """Static facts about the served model and the engine's limits (with `weight_info`)."""
    s, c = core.spec, core.config
    return ModelInfo(
        **weight_info(core),
        model=c.model.model,
        architecture=core.architecture,
        dtype=str(core.dtype).removeprefix("torch."),
        vocab_size=s.vocab_size,
        max_model_len=core.max_model_len,
        num_layers=s.num_layers,
        num_experts=s.num_experts,
        num_experts_per_tok=s.top_k,
        hidden_size=s.hidden_size,
        block_size=c.cache.block_size,
        num_kv_blocks=core.plan.num_blocks,
        max_num_seqs=c.scheduler.max_num_seqs,
        max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
        ep_size=c.parallel.ep_size,
        has_tokenizer=core.tokenizer is not None,
        device=core.kernels.device,
        kernel_backends=core.kernels.info(),
        weight_version=core.rollout.weight_version,
        rank=core.rank_context.rank if core.rank_context else 0,
        local_experts=list(core.rank_context.local_experts)
        if core.rank_context
        else list(range(s.num_experts)),
        **eplb_info(core),
    )


def eplb_info(core: Core) -> dict[str, Any]:
    """ModelInfo's EPLB fields: whether it is on and how many rebalances it committed."""
    eplb = getattr(core, "eplb", None)
    if eplb is None:
        return {}
    return dict(eplb_enabled=True, eplb_rebalances=eplb.stats.num_rebalances)
