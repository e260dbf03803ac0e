"""Typed messages between the front end (`EngineClient`) and the engine core process.

Every message is a `msgspec.Struct` of a tagged union, encoded as a msgpack array whose first
element is the tag (the layout of vLLM's `EngineCoreRequest` / `EngineCoreOutputs`); one
`Encoder` and one `Decoder` per direction (`encode`, `decode_input`, `decode_output`). A field
renamed on one side fails to decode instead of reading as 0.

inputs (front end -> core; the PUSH socket the core's PULL binds)
    EngineCoreRequest   "add"          one new request, for `rank` under expert parallelism
    AbortRequests       "abort"        end live requests (unknown ids are ignored)
    GetStats            "stats"        -> StatsReply (EngineStats)
    GetExpertLoad       "expert_load"  -> ExpertLoadReply (ExpertLoad)
    GetModelInfo        "info"         -> ModelInfoReply (ModelInfo)
    Shutdown            "shutdown"     leave the loop and exit 0
    Heartbeat           "heartbeat"    on its own PUB socket, every second (`monitor.py`)
    PauseGeneration, ResumeGeneration, InitWeightUpdateGroup, DestroyWeightUpdateGroup,
    UpdateWeights       RL weight updates (`control.py`) -> ControlReply
outputs (core -> front end; the PUSH socket that connects to the front end's PULL)
    StartupProgress     "progress"     while the core starts: phase, detail, seconds left
    Ready               "ready"        once the model is loaded (ModelInfo)
    StartupFailed       "startup_failed"  then the process exits with status 1
    EngineCoreOutputs   "outputs"      one per step (and per abort) with outputs
    AddError            "add_error"    a refused EngineCoreRequest
    Fatal               "fatal"        the step loop failed; the process exits with status 1
    StatsReply, ExpertLoadReply, ModelInfoReply, ControlReply  answers, matched by reply_id
"""

from __future__ import annotations

from typing import Any

import msgspec

from moe_engine.errors import ErrorCode
from moe_engine.request import FinishReason, SamplingParams
from moe_engine.weight_update.messages import ControlInput, ControlReply

# ---------------------------------------------------------------------- payloads


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


# ---------------------------------------------------------------------- inputs


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True):
    """Add one request. arrival_time: time.time() seconds; rank: the target rank (0 for one).

    Disaggregation (`moe_engine.disagg`): on a prefill instance `kv_placement` (a decode
    instance's `PrepareDecodeReply.placement`) makes it a prefill whose blocks are written
    there before its one output; on a decode instance `remote_first_token` continues the
    request `PrepareDecode` parked, whose K/V has arrived, from that token, with
    `remote_first_logprobs` its logprobs entry (`EngineCoreOutput.logprobs`' shape) when the
    request asks for logprobs.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    rank: int = 0
    kv_placement: bytes | None = None
    remote_first_token: int | None = None
    remote_first_logprobs: tuple[float, dict[int, float]] | None = None


class PrepareDecode(msgspec.Struct, tag="prepare_decode", array_like=True):
    """Decode instance: validate `request`, allocate its prompt's blocks and say where they
    are (answered by PrepareDecodeReply). Under expert parallelism `request.rank` answers: the
    rank whose KV cache takes the request (its later EngineCoreRequest goes there too)."""

    reply_id: int
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """End these live requests; each gets one final output with finish_reason "abort"."""

    request_ids: list[str]


class GetStats(msgspec.Struct, tag="stats", array_like=True):
    """Ask for EngineStats (answered by StatsReply with the same reply_id)."""

    reply_id: int


class GetExpertLoad(msgspec.Struct, tag="expert_load", array_like=True):
    """Ask for ExpertLoad (answered by ExpertLoadReply)."""

    reply_id: int


class GetModelInfo(msgspec.Struct, tag="info", array_like=True):
    """Ask for ModelInfo (answered by ModelInfoReply)."""

    reply_id: int


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    """Leave the loop and exit 0."""


class Heartbeat(msgspec.Struct, tag="heartbeat", array_like=True):
    """The front end is alive (sent every `HEARTBEAT_INTERVAL_S`; sent_at: time.time() s)."""

    sent_at: float


CoreInput = (
    EngineCoreRequest | AbortRequests | GetStats | GetExpertLoad | GetModelInfo | Shutdown
    | Heartbeat | ControlInput | PrepareDecode
)

# ---------------------------------------------------------------------- outputs


class StartupProgress(msgspec.Struct, tag="progress", array_like=True):
    """What the starting core is doing: `phase` ("building native CPU kernels", "loading
    weights", ...), a `detail` line (may be empty) and the seconds it expects the phase to
    take still (None: unknown)."""

    phase: str
    detail: str = ""
    eta_s: float | None = None


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """The model is loaded; `info` has the limits requests are validated against."""

    info: ModelInfo


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    """Building the core failed (the process then exits with status 1)."""

    error_type: str
    message: str
    traceback: str = ""


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """One step's (or one abort's) outputs."""

    outputs: list[EngineCoreOutput]


class AddError(msgspec.Struct, tag="add_error", array_like=True):
    """A refused EngineCoreRequest: the status code, the field at fault and the message."""

    request_id: str
    code: ErrorCode
    field: str
    message: str


class Fatal(msgspec.Struct, tag="fatal", array_like=True):
    """The step loop failed (the process then exits with status 1)."""

    message: str
    traceback: str = ""


class StatsReply(msgspec.Struct, tag="stats_reply", array_like=True):
    reply_id: int
    stats: EngineStats


class ExpertLoadReply(msgspec.Struct, tag="expert_load_reply", array_like=True):
    reply_id: int
    load: ExpertLoad


class ModelInfoReply(msgspec.Struct, tag="info_reply", array_like=True):
    reply_id: int
    info: ModelInfo


class PrepareDecodeReply(msgspec.Struct, tag="prepare_decode_reply", array_like=True):
    """Where the parked request's K/V goes (`disagg.handoff.KVPlacement`, msgpack), or the
    refusal (code, field, message as AddError's; placement empty then)."""

    reply_id: int
    placement: bytes = b""
    code: str = ""
    field: str = ""
    message: str = ""


CoreOutput = (
    StartupProgress | Ready | StartupFailed | EngineCoreOutputs | AddError | Fatal | StatsReply
    | ExpertLoadReply | ModelInfoReply | ControlReply | PrepareDecodeReply
)
Reply = StatsReply | ExpertLoadReply | ModelInfoReply | ControlReply | PrepareDecodeReply

# ---------------------------------------------------------------------- codec

_encoder = msgspec.msgpack.Encoder()
_input_decoder = msgspec.msgpack.Decoder(CoreInput)
_output_decoder = msgspec.msgpack.Decoder(CoreOutput)


def encode(message: CoreInput | CoreOutput) -> bytes:
    """One message as msgpack bytes (call from one thread; `Codec` for another thread)."""
    return _encoder.encode(message)


def decode_input(frame: bytes) -> CoreInput:
    """A front-end message.

    Raises:
        msgspec.DecodeError: not msgpack; msgspec.ValidationError: not a CoreInput (an unknown
            tag or a field of the wrong type; a `SamplingParams` that refuses its values has
            its `ParamError` as `__cause__`).
    """
    return _input_decoder.decode(frame)


def decode_output(frame: bytes) -> CoreOutput:
    """A core message (raises as `decode_input` does)."""
    return _output_decoder.decode(frame)


class Codec:
    """A private encoder and heartbeat decoder for a thread other than the loop's."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._heartbeat = msgspec.msgpack.Decoder(Heartbeat)

    def encode(self, message: CoreInput | CoreOutput) -> bytes:
        return self._encoder.encode(message)

    def decode_heartbeat(self, frame: bytes) -> Heartbeat:
        return self._heartbeat.decode(frame)
