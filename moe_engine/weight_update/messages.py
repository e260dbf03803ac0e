"""Typed control messages for RL rollouts: pause and resume generation, new weights.

Part of the front end <-> core union of `messages.py` (same msgpack tagged-array encoding):

inputs (front end -> core)
    PauseGeneration         "pause"              stop stepping (mode abort | keep | retract)
    ResumeGeneration        "resume"             step again
    InitWeightUpdateGroup   "init_weight_group"  join a trainer's torch.distributed group
    DestroyWeightUpdateGroup "destroy_weight_group"  leave it
    UpdateWeights           "update_weights"     new weights from disk or from the group
outputs (core -> front end)
    ControlReply            "control_reply"      the answer to any of them, by reply_id

The semantics (SGLang's `pause_generation` / `update_weights_from_disk` /
`update_weights_from_distributed`, vLLM's RLHF examples) are in `moe_engine.weight_update`.
"""

from __future__ import annotations

import msgspec

from moe_engine.errors import ErrorCode, RequestError

#: Pause modes: end in-flight requests with finish_reason "abort"; keep them (their KV stays,
#: decoding continues on the new weights after resume); retract them (KV freed, recomputed on
#: the new weights after resume, as a preemption).
PAUSE_MODES = ("abort", "keep", "retract")
#: Where `UpdateWeights` reads the tensors.
WEIGHT_SOURCES = ("disk", "distributed")
#: The defaults every side uses (messages, RPCs, HTTP, `LLM`, `moe_engine.rl`).
DEFAULT_PAUSE_MODE = "keep"
DEFAULT_GROUP_NAME = "weight_update"
DEFAULT_BACKEND = "gloo"
DEFAULT_GROUP_TIMEOUT_S = 60.0
#: Longest weight_version (characters): every later response and log line carries it.
MAX_WEIGHT_VERSION_CHARS = 256


def weight_version_problem(version: str) -> str | None:
    """Why `version` cannot name weights (empty, over `MAX_WEIGHT_VERSION_CHARS`, control
    characters, which would split log lines), as a message naming the field; None if it can."""
    if not version:
        return "weight_version: required, must not be empty (every later response carries it)"
    if len(version) > MAX_WEIGHT_VERSION_CHARS:
        return (f"weight_version: {len(version)} characters, at most "
                f"{MAX_WEIGHT_VERSION_CHARS}")
    if not version.isprintable():
        return (f"weight_version: {version!r} holds control characters (it goes into logs "
                f"and every response)")
    return None


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    """One tensor of an update: its checkpoint name (as in the model's safetensors), dtype
    ("bfloat16", "float32", "float16"; "uint8" for MXFP4 blocks/scales) and shape."""

    name: str
    dtype: str
    shape: list[int]


class PauseGeneration(msgspec.Struct, tag="pause", array_like=True):
    """Stop stepping until `ResumeGeneration`; `mode` (`PAUSE_MODES`) says what happens to the
    requests in flight. New requests are still accepted and wait."""

    reply_id: int
    mode: str = DEFAULT_PAUSE_MODE


class ResumeGeneration(msgspec.Struct, tag="resume", array_like=True):
    """Step again (a no-op when not paused)."""

    reply_id: int


class InitWeightUpdateGroup(msgspec.Struct, tag="init_weight_group", array_like=True):
    """Join the trainer's weight-update group: a TCPStore at master_address:master_port (the
    trainer is rank 0 and hosts it), world_size ranks in all, this engine's ranks at
    rank_offset + ep rank; backend "gloo" (CPU) or "nccl" (CUDA); timeout_s for joining and for
    every later collective of the group (seconds)."""

    reply_id: int
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    backend: str = DEFAULT_BACKEND
    group_name: str = DEFAULT_GROUP_NAME
    timeout_s: float = DEFAULT_GROUP_TIMEOUT_S


class DestroyWeightUpdateGroup(msgspec.Struct, tag="destroy_weight_group", array_like=True):
    """Leave the weight-update group `group_name` (a no-op when not joined)."""

    reply_id: int
    group_name: str = DEFAULT_GROUP_NAME


class UpdateWeights(msgspec.Struct, tag="update_weights", array_like=True):
    """Replace weights, atomically: every tensor is checked before any weight changes.

    Attributes:
        weight_version: the version string every later output carries.
        source: "disk" (`path`: a checkpoint folder of the same architecture, all or some
            tensors) or "distributed" (`tensors`, in the order the trainer broadcasts them over
            the group `group_name`, packed into buckets of up to `bucket_bytes`).
        flush_cache: drop the prefix cache (its blocks hold the old weights' K/V).
    """

    reply_id: int
    weight_version: str
    source: str
    path: str = ""
    tensors: list[TensorMeta] = []
    group_name: str = DEFAULT_GROUP_NAME
    bucket_bytes: int = 0
    flush_cache: bool = True


class ControlReply(msgspec.Struct, tag="control_reply", array_like=True):
    """The answer to a control message (summed over ranks under expert parallelism).

    Attributes:
        code: None when done, else the status of the refusal (`field` and `message` say why;
            a refused update changed nothing).
        weight_version: the version serving now; paused: whether generation is paused now.
        num_aborted / num_kept / num_retracted: requests a pause ended / left in place / sent
            back to the queue.
        num_tensors / num_bytes: checkpoint tensors and bytes an update took (bytes the ranks
            kept, summed); seconds: the update's wall time on the slowest rank.
    """

    reply_id: int
    code: ErrorCode | None = None
    field: str = ""
    message: str = ""
    weight_version: str = ""
    paused: bool = False
    num_aborted: int = 0
    num_kept: int = 0
    num_retracted: int = 0
    num_tensors: int = 0
    num_bytes: int = 0
    seconds: float = 0.0

    def checked(self) -> ControlReply:
        """This reply when the core did what was asked.

        Raises:
            RequestError: the core's refusal (its code, field and message).
        """
        if self.code is not None:
            raise RequestError(self.code, self.field, self.message)
        return self

    def result(self) -> dict:
        """What a caller reports of a done request: version, pause state, counts, seconds
        (the WeightControlResponse fields; the HTTP endpoints' body)."""
        return {name: getattr(self, name) for name in RESULT_FIELDS}


#: `ControlReply.result`'s fields.
RESULT_FIELDS = ("weight_version", "paused", "num_aborted", "num_kept", "num_retracted",
                 "num_tensors", "num_bytes", "seconds")


ControlInput = (
    PauseGeneration | ResumeGeneration | InitWeightUpdateGroup | DestroyWeightUpdateGroup
    | UpdateWeights
)


def merge_replies(replies: list[ControlReply]) -> ControlReply:
    """One reply from every rank's: the first refusal that says why (not the "refused by
    another rank" of the ranks that agreed), else rank 0's with the counts summed and the
    slowest rank's seconds."""
    refusals = [r for r in replies if r.code is not None]
    if refusals:
        return next((r for r in refusals if r.field != "ranks"), refusals[0])
    first = replies[0]
    return msgspec.structs.replace(
        first,
        num_aborted=sum(r.num_aborted for r in replies),
        num_kept=sum(r.num_kept for r in replies),
        num_retracted=sum(r.num_retracted for r in replies),
        num_bytes=sum(r.num_bytes for r in replies),
        seconds=max(r.seconds for r in replies),
    )
