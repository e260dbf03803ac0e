"""The RL rollout RPCs of the gRPC servicer: PauseGeneration, ResumeGeneration, UpdateWeights,
InitWeightUpdateGroup, DestroyWeightUpdateGroup (SGLang's pause_generation /
update_weights_from_disk / update_weights_from_distributed; semantics in
`moe_engine.weight_update.control`).

Each request is checked here first for what needs no model (a pause mode, a required
weight_version, a port, ranks that fit the group), then converted to its control message
(`engine.control`) and sent to the core through `EngineClient.control`; the core's refusal (a
tensor of the wrong shape, a name the model lacks, a folder that is not a checkpoint) becomes the
gRPC status of the same name with the message naming the tensor or field, and that field in the
trailing metadata `moe-field`, as every other refusal of the servicer. A refused update changed
nothing. The checks and conversions are module functions, so the HTTP admin endpoints share them.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable

import grpc
import msgspec

from moe_engine.engine.client import EngineClient
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.server.interceptors import abort_with_refusal
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.weight_update.group import BACKENDS
from moe_engine.weight_update.messages import (
    DEFAULT_BACKEND,
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    DEFAULT_PAUSE_MODE,
    PAUSE_MODES,
    ControlInput,
    ControlReply,
    DestroyWeightUpdateGroup,
    InitWeightUpdateGroup,
    PauseGeneration,
    ResumeGeneration,
    TensorMeta,
    UpdateWeights,
    weight_version_problem,
)

#: How long the front end waits for the core to answer a pause or resume (seconds).
PAUSE_TIMEOUT_S = 30.0
#: ... an update or a group join (seconds; a join waits for every member, up to its own
#: timeout_s, and a big update reads or receives gigabytes).
UPDATE_TIMEOUT_S = 600.0
#: Beyond a join's own timeout_s, how long the front end waits for its answer (seconds).
JOIN_SLACK_S = 60.0
_PORT_MAX = 65535


def _invalid(field: str, message: str) -> RequestError:
    return RequestError(ErrorCode.INVALID_ARGUMENT, field, message)


def check_mode(mode: str) -> str:
    """The pause mode (`DEFAULT_PAUSE_MODE` when empty).

    Raises:
        RequestError: INVALID_ARGUMENT ("mode") for a mode not in abort, keep, retract.
    """
    mode = mode or DEFAULT_PAUSE_MODE
    if mode not in PAUSE_MODES:
        raise _invalid("mode", f"mode: {mode!r} is not one of {', '.join(PAUSE_MODES)}")
    return mode


def check_weight_version(version: str) -> str:
    """`version` if it can name the weights (`control.weight_version_problem`).

    Raises:
        RequestError: INVALID_ARGUMENT ("weight_version") when empty, too long or not
            printable.
    """
    problem = weight_version_problem(version)
    if problem is not None:
        raise _invalid("weight_version", problem)
    return version


#: Longest group name the front end passes on (it keys the trainer's TCPStore).
MAX_GROUP_NAME_CHARS = 128


def check_group_name(name: str) -> str:
    """`name` (default "weight_update" when empty) if it can name a group.

    Raises:
        RequestError: INVALID_ARGUMENT ("group_name") when too long or not printable.
    """
    name = name or DEFAULT_GROUP_NAME
    if len(name) > MAX_GROUP_NAME_CHARS or not name.isprintable():
        raise _invalid("group_name", f"group_name: {name[:40]!r}{'...' if len(name) > 40 else ''}"
                                     f" must be printable and at most {MAX_GROUP_NAME_CHARS} "
                                     f"characters ({len(name)})")
    return name


def disk_update(reply_id: int, path: str, weight_version: str, flush_cache: bool
                ) -> UpdateWeights:
    """The UpdateWeights message of an update from the checkpoint folder `path`.

    Raises:
        RequestError: INVALID_ARGUMENT naming weight_version or path (empty).
    """
    check_weight_version(weight_version)
    if not path:
        raise _invalid("path", "path: required (a checkpoint folder on the server), got ''")
    return UpdateWeights(reply_id, weight_version, "disk", path=path, flush_cache=flush_cache)


def update_message(request: pb.UpdateWeightsRequest) -> UpdateWeights:
    """The UpdateWeights message `request` describes (reply id 0: see `with_reply_id`).

    Raises:
        RequestError: INVALID_ARGUMENT naming the field: weight_version empty, no source,
            no path, no tensors, a tensor without a name or with a negative dimension.
    """
    version = check_weight_version(request.weight_version)
    flush = request.flush_cache if request.HasField("flush_cache") else True
    source = request.WhichOneof("source")
    if source == "from_disk":
        return disk_update(0, request.from_disk.path, version, flush)
    if source == "from_distributed":
        dist = request.from_distributed
        if not dist.tensors:
            raise _invalid("tensors", "tensors: from_distributed names no tensor")
        tensors = []
        for meta in dist.tensors:
            if not meta.name:
                raise _invalid("tensors", "tensors: a tensor has no name")
            if any(d < 0 for d in meta.shape):
                raise _invalid(meta.name, f"tensor {meta.name!r}: shape {list(meta.shape)} has "
                                          f"a negative dimension")
            tensors.append(TensorMeta(meta.name, meta.dtype, list(meta.shape)))
        return UpdateWeights(0, version, "distributed", tensors=tensors,
                             group_name=check_group_name(dist.group_name),
                             bucket_bytes=dist.bucket_bytes, flush_cache=flush)
    raise _invalid("source", "source: set from_disk (a checkpoint folder) or from_distributed "
                             "(tensors a trainer broadcasts)")


def join_message(request: pb.InitWeightUpdateGroupRequest, ep_size: int
                 ) -> InitWeightUpdateGroup:
    """The InitWeightUpdateGroup message `request` describes (reply id 0); the engine's
    `ep_size` ranks take ranks rank_offset .. rank_offset + ep_size - 1.

    Raises:
        RequestError: INVALID_ARGUMENT naming the field: no master_address, a port outside
            1..65535, world_size < 2, ranks outside [1, world_size), an unknown backend, a
            timeout that is not a positive number.
    """
    r = request
    if not r.master_address:
        raise _invalid("master_address", "master_address: required (the trainer's TCPStore "
                                         "host), got ''")
    if not 1 <= r.master_port <= _PORT_MAX:
        raise _invalid("master_port", f"master_port: must be in 1..{_PORT_MAX}, got "
                                      f"{r.master_port}")
    if r.world_size < 2:
        raise _invalid("world_size", f"world_size: must be >= 2 (the trainer and this engine's "
                                     f"{ep_size} rank(s)), got {r.world_size}")
    last = r.rank_offset + ep_size - 1
    if r.rank_offset < 1 or last > r.world_size - 1:
        span = f"{r.rank_offset}" if ep_size == 1 else f"{r.rank_offset}..{last}"
        raise _invalid("rank_offset", f"rank_offset: this engine's {ep_size} rank(s) would be "
                                      f"rank {span}, outside [1, {r.world_size - 1}] (rank 0 is "
                                      f"the trainer; world_size {r.world_size})")
    backend = r.backend or DEFAULT_BACKEND
    if backend not in BACKENDS:
        raise _invalid("backend", f"backend: {backend!r} is not one of {', '.join(BACKENDS)}")
    timeout = r.timeout_s or DEFAULT_GROUP_TIMEOUT_S
    if not (math.isfinite(timeout) and timeout > 0):
        raise _invalid("timeout_s", f"timeout_s: must be a finite number of seconds > 0, got "
                                    f"{r.timeout_s}")
    return InitWeightUpdateGroup(0, r.master_address, r.master_port, r.rank_offset,
                                 r.world_size, backend, check_group_name(r.group_name), timeout)


def with_reply_id(message: ControlInput) -> Callable[[int], ControlInput]:
    """`message` as `EngineClient.control` takes it: a factory of the same message with the
    reply id it is given."""
    return lambda rid: msgspec.structs.replace(message, reply_id=rid)


class WeightControlRpcs:
    """The five RL rollout RPCs, mixed into `MoeEngineServicer` (which provides `engine` and
    `_check_ready`). Pause, update and join need a serving engine; resume and leaving a group
    are also served while the server drains (so paused requests can finish)."""

    engine: EngineClient
    _check_ready: Callable[..., None]

    async def PauseGeneration(  # noqa: N802 - gRPC method name
        self, request: pb.PauseGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightControlResponse:
        async def call() -> ControlReply:
            self._check_ready()
            mode = check_mode(request.mode)
            return await self.engine.control(lambda rid: PauseGeneration(rid, mode),
                                             PAUSE_TIMEOUT_S)

        return await self._answer(context, call)

    async def ResumeGeneration(  # noqa: N802
        self, request: pb.ResumeGenerationRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightControlResponse:
        async def call() -> ControlReply:
            self._check_ready(draining_ok=True)
            return await self.engine.control(ResumeGeneration, PAUSE_TIMEOUT_S)

        return await self._answer(context, call)

    async def UpdateWeights(  # noqa: N802
        self, request: pb.UpdateWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightControlResponse:
        async def call() -> ControlReply:
            self._check_ready()
            message = update_message(request)
            return await self.engine.control(with_reply_id(message), UPDATE_TIMEOUT_S)

        return await self._answer(context, call)

    async def InitWeightUpdateGroup(  # noqa: N802
        self, request: pb.InitWeightUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightControlResponse:
        async def call() -> ControlReply:
            self._check_ready()
            info = self.engine.model_info
            message = join_message(request, info.ep_size if info is not None else 1)
            timeout = max(UPDATE_TIMEOUT_S, message.timeout_s + JOIN_SLACK_S)
            return await self.engine.control(with_reply_id(message), timeout)

        return await self._answer(context, call)

    async def DestroyWeightUpdateGroup(  # noqa: N802
        self, request: pb.DestroyWeightUpdateGroupRequest, context: grpc.aio.ServicerContext
    ) -> pb.WeightControlResponse:
        async def call() -> ControlReply:
            self._check_ready(draining_ok=True)
            group = check_group_name(request.group_name)
            return await self.engine.control(lambda rid: DestroyWeightUpdateGroup(rid, group),
                                             PAUSE_TIMEOUT_S)

        return await self._answer(context, call)

    async def _answer(
        self, context: grpc.aio.ServicerContext, call: Callable[[], Awaitable[ControlReply]]
    ) -> pb.WeightControlResponse:
        """`call()`'s reply as a response; a refusal (ours or the core's) as its status."""
        try:
            reply = (await call()).checked()
        except RequestError as exc:
            await abort_with_refusal(context, exc)
        return pb.WeightControlResponse(**reply.result())

