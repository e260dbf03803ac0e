"""What an engine core reports: per-request output deltas, its stats, its expert load and the
model it serves (`msgspec.Struct`s, so that the engine's messages carry them as they are).
"""

from __future__ import annotations

from typing import Any

import msgspec

from moe_engine.core.eplb_stats import EplbStats, merge_eplb_stats
from moe_engine.request import FinishReason


class EngineCoreOutput(msgspec.Struct, array_like=True, gc=False):
    """What one step produced for one request (a delta, streamed to the client).

    Attributes:
        request_id: the request's id.
        new_token_ids: tokens generated since the previous output.
        new_text: text since the previous output (held back while it may start a stop string).
        finished: True on the last output of the request.
        finish_reason: set when finished.
        num_prompt_tokens / num_output_tokens: usage so far (tokens).
        logprobs: per new token, the sampled token's logprob and the top-n {token_id: logprob}.
        error: set when the engine could not run the request at all.
        index: which completion of the request this is (0..n-1; `SamplingParams.n`). With
            n > 1 `request_id` is still the request's own id, `finished` ends only this
            completion, and the request is done when all n have sent a finished output.
        stop_reason: set with finish_reason "stop": the stop string or the stop token id
            (from `stop_token_ids`) that ended the completion; None for EOS (as vLLM).
        weight_version: the weights that computed these tokens (`UpdateWeights`).
        decode_s: on the finished output of an `output_kind` "final_only" request, seconds
            from its first token to this output (the front end dates the first token, and so
            the time to first token, from it); None otherwise.
        queue_s, prefill_s: on the finished output, seconds from the core queueing the request
            to its first scheduling, and from then to its first token (vLLM's queue and
            prefill intervals, from the core's own clock: the front end cannot see those
            events); None where the request never got that far.
        routed_experts: on the finished output of a request with `return_routed_experts`:
            the top-k logical expert ids of every MoE layer for every token the model ran for
            this completion (prompt, then outputs but the last: positions [0, seqlen - 1)),
            raw little-endian int32 bytes of shape `routed_experts_shape`
            [tokens, moe_layers, top_k] (the front ends base64 them, as SGLang); None
            otherwise.
        routed_experts_shape: [tokens, moe_layers, top_k] of `routed_experts`, or None.
        weight_versions: on the finished output: every weight version that computed this
            completion's output tokens with the output-token index it begins at,
            [(version, start), ...] in order (start 0 first); None before the end.
        kv_from_other_weights: on the finished output: some K/V (or state) this completion's
            tokens attended to was computed with other weights than the tokens reading it
            (a weight update landed while it ran without `retract`, or it reused cached
            blocks of older weights).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[tuple[float, dict[int, float]]] | None = None
    error: str | None = None
    index: int = 0
    stop_reason: int | str | None = None
    weight_version: str = ""
    decode_s: float | None = None
    queue_s: float | None = None
    prefill_s: float | None = None
    routed_experts: bytes | None = None
    routed_experts_shape: tuple[int, int, int] | None = None
    weight_versions: list[tuple[str, int]] | None = None
    kv_from_other_weights: bool = False


class ModelInfo(msgspec.Struct, kw_only=True):
    """Static facts about the served model and the engine's limits (the proto's ModelInfo,
    plus what expert parallelism adds).

    Attributes:
        vocab_size, max_model_len, block_size, num_kv_blocks (blocks), max_num_seqs,
        max_num_batched_tokens (tokens): the limits requests are validated against.
        weight_bytes_*: bytes of this rank's weights by kind (`EngineCore.weight_info`).
        rank / local_experts: the rank that answered and its global expert ids.
        experts_per_rank: every rank's expert ids (index = rank); empty for one rank.
        rank_pids: every rank's process id (expert parallelism only); pid: this rank's.
        device: "cpu" or "cuda"; kernel_backends: op -> backend chosen at startup, and
            "native_cpu_isa" -> the native library's variant where it runs
            (`kernels.registry.KernelPlan.info`).
        weight_version: the weights serving now (`--weight-version`, then each update's).
        eplb_enabled: runtime EPLB is on (--enable-eplb): `experts_per_rank` changes while
            serving, so the front end asks for it afresh; eplb_rebalances: rebalances
            committed so far.
    """

    model: str
    architecture: str
    dtype: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_experts: int
    num_experts_per_tok: int
    hidden_size: int
    block_size: int
    num_kv_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    ep_size: int = 1
    has_tokenizer: bool = False
    weight_bytes_experts: int = 0
    weight_bytes_attention: int = 0
    weight_bytes_embeddings: int = 0
    weight_bytes_other: int = 0
    expert_weight_format: str = "none"
    expert_group_size: int = 0
    expert_checkpoint_format: str = ""
    expert_zero_points: bool = False
    rank: int = 0
    local_experts: list[int] = []
    experts_per_rank: list[list[int]] = []
    rank_pids: list[int] = []
    pid: int = 0
    device: str = "cpu"
    kernel_backends: dict[str, str] = {}
    weight_version: str = ""
    eplb_enabled: bool = False
    eplb_rebalances: int = 0


class KVCacheGroupStats(msgspec.Struct, kw_only=True):
    """One KV-cache group: its kind, window (0 for full attention), layers, K+V bytes per
    token, and the distinct blocks live requests hold in it."""

    group: int
    kind: str
    sliding_window: int
    num_layers: int
    kv_bytes_per_token: int
    blocks_used: int


class CoreStats(msgspec.Struct, kw_only=True):
    """One rank's queue, KV-cache and token counters (totals since startup unless noted).

    Attributes:
        num_running / num_waiting: requests now in the batch / waiting for it.
        kv_blocks_total / _free / _used: KV blocks of the pool now; kv_cached_blocks: blocks
            in the prefix-cache map now.
        prefix_cache_queries / _hits: prompt tokens looked up in / found in the prefix cache.
        num_preemptions, num_finished, num_aborted, num_rejected (queue full), num_steps.
        prompt_tokens_total / generation_tokens_total: tokens admitted / generated.
        dispatch_bytes_sent, combine_bytes_sent, min_dispatch_bytes (bytes), tokens_in,
            tokens_received (tokens): the expert-parallel communicator's counters
            (`comm.stats.CommCounts`), 0 for one rank.
        kv_groups: per KV-cache group; phase_seconds: wall seconds per forward phase.
        spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens: request-steps that
            verified drafts, drafts verified, drafts accepted (`SpecDecodeStats`);
            spec_decode_num_accepted_tokens_per_pos: per draft position, drafts accepted.
        state_slots_total, state_slots_free: linear-attention state slots (`kv_cache.state`;
            0 without linear layers).
        paused: generation is paused (`PauseGeneration`); weight_version: the weights now.
        rank: the rank these are from.
        eplb: runtime EPLB's counters (`eplb_stats.EplbStats`), None when it is off.
    """

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    kv_blocks_used: int
    kv_cached_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_finished: int
    num_aborted: int
    num_rejected: int
    num_steps: int
    dispatch_bytes_sent: int = 0
    combine_bytes_sent: int = 0
    min_dispatch_bytes: int = 0
    tokens_in: int = 0
    tokens_received: int = 0
    kv_groups: list[KVCacheGroupStats] = []
    phase_seconds: dict[str, float] = {}
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    state_slots_total: int = 0
    state_slots_free: int = 0
    paused: bool = False
    weight_version: str = ""
    rank: int = 0
    eplb: EplbStats | None = None

    @property
    def kv_cache_usage(self) -> float:
        """kv_blocks_used / kv_blocks_total, in [0, 1] (0 without blocks)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """1 + accepted / request-steps with drafts (0 before any)."""
        n = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / n if n else 0.0


class EngineStats(msgspec.Struct, kw_only=True):
    """The whole engine's stats: `total` summed over the ranks (`sum_stats`), and each rank's."""

    ep_size: int
    total: CoreStats
    ranks: list[CoreStats]


def sum_stats(per_rank: list[CoreStats]) -> CoreStats:
    """Counters summed over ranks; KV groups by group (blocks_used summed), phase seconds by
    phase; `rank` is 0."""
    first = per_rank[0]
    summed: dict[str, Any] = {}
    for name in first.__struct_fields__:
        value = getattr(first, name)
        if isinstance(value, int) and not isinstance(value, bool):
            summed[name] = sum(getattr(s, name) for s in per_rank)
    summed["rank"] = 0
    summed["paused"] = any(s.paused for s in per_rank)
    summed["weight_version"] = first.weight_version
    per_pos = [s.spec_decode_num_accepted_tokens_per_pos for s in per_rank]
    width = max(len(p) for p in per_pos)
    summed["spec_decode_num_accepted_tokens_per_pos"] = [
        sum(p[i] for p in per_pos if i < len(p)) for i in range(width)
    ]
    groups = [s.kv_groups for s in per_rank]
    if all(len(g) == len(groups[0]) for g in groups):
        summed["kv_groups"] = [
            msgspec.structs.replace(group, blocks_used=sum(g[i].blocks_used for g in groups))
            for i, group in enumerate(groups[0])
        ]
    phases: dict[str, float] = {}
    for s in per_rank:
        for phase, seconds in s.phase_seconds.items():
            phases[phase] = phases.get(phase, 0.0) + seconds
    eplb = [s.eplb for s in per_rank if s.eplb is not None]
    summed["eplb"] = merge_eplb_stats(eplb) if len(eplb) == len(per_rank) else None
    return CoreStats(**summed, phase_seconds=phases)


def engine_stats(per_rank: list[CoreStats]) -> EngineStats:
    """EngineStats of `per_rank` (each rank's CoreStats, in rank order)."""
    total = per_rank[0] if len(per_rank) == 1 else sum_stats(per_rank)
    return EngineStats(ep_size=len(per_rank), total=total, ranks=list(per_rank))


class ExpertLoad(msgspec.Struct, kw_only=True):
    """Tokens routed to each expert of each MoE layer, and per-layer summaries.

    Attributes:
        moe_layers: decoder-layer indices of the MoE layers.
        counts: [num_moe_layers][num_experts] token-expert pairs since startup.
        window_counts: the same over the last `window_steps` steps.
        imbalance_ratio / balancedness: per MoE layer, max/mean and mean/max of `counts`.
        rank_tokens: [num_moe_layers][ep_size] pairs each rank's experts processed, with its
            rank_imbalance_ratio / rank_balancedness (expert parallelism only).
    """

    moe_layers: list[int]
    counts: list[list[int]]
    window_counts: list[list[int]]
    window_steps: int
    imbalance_ratio: list[float]
    balancedness: list[float]
    rank_tokens: list[list[int]] | None = None
    rank_imbalance_ratio: list[float] | None = None
    rank_balancedness: list[float] | None = None
