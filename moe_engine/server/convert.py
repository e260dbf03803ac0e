"""Conversions between the gRPC messages (`moe_engine.v1`, `pb/`) and the engine's types.

`sampling_params_from_proto` reads a GenerateRequest's sampling fields (unset optional fields
take vLLM's defaults: max_tokens 16, temperature 1.0); `response_from_output` writes one
streamed GenerateResponse from one engine output (a delta); the `*_to_proto` functions write
GetModelInfo's, GetServerStats's and GetExpertLoad's answers field by field. The router's
inverses live in `moe_engine.disagg.router_engine`.
"""

from __future__ import annotations

from typing import Any

import torch

from moe_engine.core.eplb_stats import EplbStats
from moe_engine.core.outputs import CoreStats, EngineCoreOutput, EngineStats, ExpertLoad, ModelInfo
from moe_engine.core.validation import param_error
from moe_engine.errors import ParamError
from moe_engine.instrumentation import balancedness, imbalance_ratio
from moe_engine.sampling_params import OUTPUT_FINAL_ONLY, SamplingParams, StructuredOutputsParams
from moe_engine.server.pb import moe_engine_pb2 as pb

#: Optional scalar fields of GenerateRequest copied into SamplingParams when set.
_OPTIONAL_PARAMS = (
    "max_tokens",
    "min_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "ignore_eos",
    "logprobs",
    "n",
    # logits processors, prompt truncation and priority
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "min_p",
    "truncate_prompt_tokens",
    "priority",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "return_routed_experts",
)


def sampling_params_from_proto(request: pb.GenerateRequest) -> SamplingParams:
    """SamplingParams from a GenerateRequest; unset optional fields keep the defaults.

    Raises:
        RequestError: INVALID_ARGUMENT naming the field SamplingParams refused.
    """
    kwargs: dict[str, Any] = {
        name: getattr(request, name) for name in _OPTIONAL_PARAMS if request.HasField(name)
    }
    kwargs["stop"] = list(request.stop)
    kwargs["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:
        kwargs["logit_bias"] = dict(request.logit_bias)
    if request.final_only:
        kwargs["output_kind"] = OUTPUT_FINAL_ONLY
    try:
        if request.json_schema or request.json_object:
            kwargs["structured_outputs"] = StructuredOutputsParams(
                json=request.json_schema or None, json_object=request.json_object
            )
        return SamplingParams(**kwargs)
    except ParamError as exc:
        raise param_error(exc) from exc


def response_from_output(out: EngineCoreOutput) -> pb.GenerateResponse:
    """One streamed GenerateResponse from one engine output (a delta); a finished output's
    `routed_experts` (raw little-endian int32 [tokens, moe_layers, top_k]) go out unchanged
    with their shape."""
    response = pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.new_token_ids,
        text=out.new_text,
        finished=out.finished,
        finish_reason=str(out.finish_reason) if out.finish_reason is not None else "",
        usage=pb.Usage(
            prompt_tokens=out.num_prompt_tokens, completion_tokens=out.num_output_tokens
        ),
        index=out.index,
        weight_version=out.weight_version,
    )
    if out.routed_experts is not None and out.routed_experts_shape is not None:
        response.routed_experts = out.routed_experts  # the core's int32 bytes, as they are
        response.routed_experts_shape.extend(out.routed_experts_shape)
    if out.weight_versions is not None:
        for version, start in out.weight_versions:
            response.weight_versions.add(weight_version=version, start=start)
    response.kv_from_other_weights = out.kv_from_other_weights
    if isinstance(out.stop_reason, str):
        response.stop_string = out.stop_reason
    elif isinstance(out.stop_reason, int):
        response.stop_token_id = out.stop_reason
    if out.logprobs:
        for token_id, (logprob, top) in zip(out.new_token_ids, out.logprobs, strict=False):
            entry = response.logprobs.add(token_id=token_id, logprob=logprob)
            for tok, lp in sorted(top.items(), key=lambda kv: -kv[1]):
                entry.top_logprobs.add(token_id=tok, logprob=lp)
    return response


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    """GetModelInfo's answer, field by field (one rank: its own experts as the only entry)."""
    per_rank = info.experts_per_rank or [info.local_experts]
    return pb.ModelInfo(
        model=info.model,
        architecture=info.architecture,
        dtype=info.dtype,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        num_layers=info.num_layers,
        num_experts=info.num_experts,
        num_experts_per_tok=info.num_experts_per_tok,
        hidden_size=info.hidden_size,
        block_size=info.block_size,
        num_kv_blocks=info.num_kv_blocks,
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        ep_size=info.ep_size,
        has_tokenizer=info.has_tokenizer,
        weight_bytes_experts=info.weight_bytes_experts,
        weight_bytes_attention=info.weight_bytes_attention,
        weight_bytes_embeddings=info.weight_bytes_embeddings,
        weight_bytes_other=info.weight_bytes_other,
        expert_weight_format=info.expert_weight_format,
        expert_group_size=info.expert_group_size,
        expert_checkpoint_format=info.expert_checkpoint_format,
        expert_zero_points=info.expert_zero_points,
        device=info.device,
        kernel_backends=info.kernel_backends,
        experts_per_rank=[pb.RankExperts(experts=e) for e in per_rank],
        weight_version=info.weight_version,
        eplb_enabled=info.eplb_enabled,
        eplb_rebalances=info.eplb_rebalances,
    )


def eplb_stats_to_proto(stats: EplbStats | None) -> pb.EplbStats | None:
    """ServerStats.eplb (None when EPLB is off)."""
    if stats is None:
        return None
    return pb.EplbStats(
        num_rebalances=stats.num_rebalances,
        num_decisions=stats.num_decisions,
        moving=stats.moving,
        experts_moved=stats.experts_moved,
        bytes_sent=stats.bytes_sent,
        bytes_received=stats.bytes_received,
        transfer_seconds=stats.transfer_s,
        commit_seconds=stats.commit_s,
        balancedness=stats.balancedness,
        balancedness_predicted=stats.balancedness_predicted,
        last_rebalance_step=stats.last_rebalance_step,
        rebalances=[
            pb.RebalanceStats(
                step=r.step, committed_step=r.committed_step, experts_moved=r.experts_moved,
                bytes_sent=r.bytes_sent, bytes_received=r.bytes_received,
                transfer_seconds=r.transfer_s, commit_seconds=r.commit_s,
                move_steps=r.move_steps, balancedness_before=r.balancedness_before,
                balancedness_after_predicted=r.balancedness_after_predicted,
                balancedness_after_measured=r.balancedness_after_measured,
            )
            for r in stats.rebalances
        ],
    )


def rank_stats_to_proto(stats: CoreStats) -> pb.RankStats:
    """One rank's entry of ServerStats.ranks."""
    return pb.RankStats(
        rank=stats.rank,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        kv_blocks_total=stats.kv_blocks_total,
        kv_blocks_free=stats.kv_blocks_free,
        tokens_received=stats.tokens_received,
        dispatch_bytes_sent=stats.dispatch_bytes_sent,
        combine_bytes_sent=stats.combine_bytes_sent,
    )


def server_stats_to_proto(stats: EngineStats) -> pb.ServerStats:
    """GetServerStats's answer, field by field (a test checks that every field has a source):
    totals over the ranks, and one RankStats per rank under expert parallelism."""
    t = stats.total
    return pb.ServerStats(
        num_running=t.num_running,
        num_waiting=t.num_waiting,
        kv_blocks_total=t.kv_blocks_total,
        kv_blocks_free=t.kv_blocks_free,
        kv_blocks_used=t.kv_blocks_used,
        num_preemptions=t.num_preemptions,
        prompt_tokens_total=t.prompt_tokens_total,
        generation_tokens_total=t.generation_tokens_total,
        num_finished=t.num_finished,
        num_aborted=t.num_aborted,
        kv_cache_usage=t.kv_cache_usage,
        num_rejected=t.num_rejected,
        ep_size=stats.ep_size,
        dispatch_bytes_sent=t.dispatch_bytes_sent,
        combine_bytes_sent=t.combine_bytes_sent,
        min_dispatch_bytes=t.min_dispatch_bytes,
        tokens_dispatched=t.tokens_in,
        tokens_received=t.tokens_received,
        ranks=[rank_stats_to_proto(r) for r in stats.ranks] if stats.ep_size > 1 else [],
        prefix_cache_queries=t.prefix_cache_queries,
        prefix_cache_hits=t.prefix_cache_hits,
        kv_cached_blocks=t.kv_cached_blocks,
        kv_groups=[
            pb.KVCacheGroupStats(
                group=g.group,
                kind=g.kind,
                sliding_window=g.sliding_window,
                num_layers=g.num_layers,
                kv_bytes_per_token=g.kv_bytes_per_token,
                blocks_used=g.blocks_used,
            )
            for g in t.kv_groups
        ],
        spec_decode_num_drafts=t.spec_decode_num_drafts,
        spec_decode_num_draft_tokens=t.spec_decode_num_draft_tokens,
        spec_decode_num_accepted_tokens=t.spec_decode_num_accepted_tokens,
        spec_decode_num_accepted_tokens_per_pos=t.spec_decode_num_accepted_tokens_per_pos,
        spec_decode_mean_acceptance_length=t.spec_decode_mean_acceptance_length,
        state_slots_total=t.state_slots_total,
        state_slots_free=t.state_slots_free,
        paused=t.paused,
        weight_version=t.weight_version,
        eplb=eplb_stats_to_proto(t.eplb),
    )


def expert_load_to_proto(load: ExpertLoad, window: bool, ep_size: int) -> pb.ExpertLoad:
    """GetExpertLoad's answer: per MoE layer the token-expert pairs per expert (the whole run's,
    or the last window's when `window`), their imbalance_ratio (max / mean) and balancedness
    (mean / max), and under expert parallelism the same per rank.

    Args:
        load: the engine's counts (`ExpertLoad`: [L][E] counts, [L][N] rank_tokens).
        window: answer with the recent window's counts instead of the totals.
        ep_size: N ranks, reported as is.
    """
    counts = load.window_counts if window else load.counts
    table = torch.tensor(counts, dtype=torch.float64)
    ratios, balanced = imbalance_ratio(table).tolist(), balancedness(table).tolist()
    rank_tokens = load.rank_tokens
    rank_ratio = rank_bal = None
    if rank_tokens:
        rank_table = torch.tensor(rank_tokens, dtype=torch.float64)
        rank_ratio = imbalance_ratio(rank_table).tolist()
        rank_bal = balancedness(rank_table).tolist()
    layers = []
    for i, layer in enumerate(load.moe_layers):
        entry = pb.LayerExpertLoad(
            layer=layer,
            tokens_per_expert=counts[i],
            imbalance_ratio=ratios[i],
            balancedness=balanced[i],
        )
        if rank_tokens:
            entry.tokens_per_rank.extend(rank_tokens[i])
            entry.rank_imbalance_ratio, entry.rank_balancedness = rank_ratio[i], rank_bal[i]
        layers.append(entry)
    return pb.ExpertLoad(
        layers=layers,
        ep_size=ep_size,
        window_steps=load.window_steps if window else 0,
    )


def first_logprobs_from_proto(request: pb.GenerateRequest) -> tuple[float, dict[int, float]] | None:
    """A decode request's `remote_first_logprob` as an EngineCoreOutput logprobs entry."""
    if not request.HasField("remote_first_logprob"):
        return None
    entry = request.remote_first_logprob
    return entry.logprob, {t.token_id: t.logprob for t in entry.top_logprobs}
