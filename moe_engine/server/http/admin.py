"""SGLang's RL admin endpoints over the same engine as the gRPC rollout RPCs:

    POST /pause_generation           {"mode": "abort" | "keep" | "retract"}   (default "keep";
                                     SGLang's "in_place" is "keep")
    POST /continue_generation        {}
    POST /update_weights_from_disk   {"model_path": PATH, "weight_version": V,
                                      "flush_cache": true}

Each answers `{"success": bool, "message": str, "weight_version": str, "paused": bool, ...}`
(SGLang's shape, with the counts of `WeightControlResponse`): 200 when done; a refusal is
`success: false` with the message naming the tensor or field, and `field`, at the status of the
engine's code (400 for a bad update: nothing changed; 503 when the engine is not serving). The
API key of the other endpoints applies (`app.AccessMiddleware`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import StrictBool, StrictStr

from moe_engine.errors import ErrorCode, RequestError
from moe_engine.server.http.errors import HTTP_STATUS
from moe_engine.server.http.protocol import RequestBody
from moe_engine.server.http.state import HttpState
from moe_engine.server.weight_rpcs import (
    PAUSE_TIMEOUT_S,
    UPDATE_TIMEOUT_S,
    check_mode,
    disk_update,
    with_reply_id,
)
from moe_engine.weight_update.messages import (
    DEFAULT_PAUSE_MODE,
    ControlReply,
    PauseGeneration,
    ResumeGeneration,
)

router = APIRouter()

#: SGLang's names of the pause modes that are called otherwise here.
_MODE_ALIASES = {"in_place": "keep"}
#: The engine's names of the fields that these bodies call otherwise.
_HTTP_FIELDS = {"path": "model_path"}


class PauseGenerationBody(RequestBody):
    mode: StrictStr = DEFAULT_PAUSE_MODE


class ContinueGenerationBody(RequestBody):
    pass


class UpdateWeightsFromDiskBody(RequestBody):
    model_path: StrictStr
    weight_version: StrictStr = ""
    flush_cache: StrictBool = True


def _state(request: Request) -> HttpState:
    return request.app.state.http


def _check_engine(state: HttpState, draining_ok: bool) -> None:
    """Raises RequestError UNAVAILABLE unless the engine serves (or, with `draining_ok`, is
    up and draining: resuming lets paused requests finish)."""
    ready, detail = state.status()
    engine = state.engine
    if ready or (draining_ok and engine.model_info is not None and not engine.dead.is_set()):
        return
    raise RequestError(ErrorCode.UNAVAILABLE, "engine", detail)


def _answer(state: HttpState, reply: ControlReply | None, message: str,
            error: RequestError | None = None) -> JSONResponse:
    info = state.engine.model_info
    body: dict = {
        "success": error is None,
        "message": message if error is None else error.message,
        "weight_version": reply.weight_version if reply is not None else (
            info.weight_version if info is not None else ""),
    }
    if error is not None:
        field = _HTTP_FIELDS.get(error.field, error.field)
        if field != error.field and error.message.startswith(error.field):
            body["message"] = field + error.message[len(error.field):]
        body["field"] = field
        return JSONResponse(body, status_code=HTTP_STATUS.get(error.code, 500))
    assert reply is not None
    return JSONResponse({**body, **reply.result()})


async def _run(state: HttpState, call: Callable[[], Awaitable[ControlReply]],
               done: str) -> JSONResponse:
    try:
        reply = (await call()).checked()
    except RequestError as exc:
        return _answer(state, None, "", exc)
    return _answer(state, reply, done)


@router.post("/pause_generation")
async def pause_generation(request: Request,
                           body: PauseGenerationBody | None = None) -> JSONResponse:
    state = _state(request)
    raw = body.mode if body is not None else "keep"

    async def call() -> ControlReply:
        _check_engine(state, draining_ok=False)
        mode = check_mode(_MODE_ALIASES.get(raw, raw))
        return await state.engine.control(lambda rid: PauseGeneration(rid, mode),
                                          PAUSE_TIMEOUT_S)

    return await _run(state, call, f"Generation paused ({raw}).")


@router.post("/continue_generation")
async def continue_generation(request: Request,
                              body: ContinueGenerationBody | None = None) -> JSONResponse:
    state = _state(request)

    async def call() -> ControlReply:
        _check_engine(state, draining_ok=True)
        return await state.engine.control(ResumeGeneration, PAUSE_TIMEOUT_S)

    return await _run(state, call, "Generation continued.")


@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskBody,
                                   request: Request) -> JSONResponse:
    state = _state(request)

    async def call() -> ControlReply:
        _check_engine(state, draining_ok=False)
        message = disk_update(0, body.model_path, body.weight_version, body.flush_cache)
        return await state.engine.control(with_reply_id(message), UPDATE_TIMEOUT_S)

    return await _run(state, call, f"Weights updated from {body.model_path}.")
