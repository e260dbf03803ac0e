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

import msgspec

from moe_engine.core.outputs import EngineCoreOutput, EngineStats, ExpertLoad, ModelInfo
from moe_engine.errors import ErrorCode
from moe_engine.sampling_params import SamplingParams
from moe_engine.weight_update.messages import ControlInput, ControlReply

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
