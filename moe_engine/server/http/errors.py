"""Errors of the HTTP API in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Status codes: 400 a bad field (the engine's own validation message, naming the field, the
value and the limit; pydantic's validation errors become 400 naming the field, not FastAPI's
422), 401 a missing or wrong API key, 404 an unknown model or path, 413 a body over
--max-message-bytes, 429 the waiting queue is full, 503 not ready, draining or the engine down.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from moe_engine.errors import ErrorCode, RequestError

#: HTTP status of each engine refusal.
HTTP_STATUS = {
    ErrorCode.INVALID_ARGUMENT: 400,
    ErrorCode.OUT_OF_RANGE: 400,
    ErrorCode.RESOURCE_EXHAUSTED: 429,
    ErrorCode.ALREADY_EXISTS: 409,
    ErrorCode.UNAVAILABLE: 503,
}
#: OpenAI's error `type` for each status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """An HTTP error answered in OpenAI's shape.

    Args:
        status: the HTTP status code.
        message: what is wrong, naming the field, the value and the limit.
        param: the request field at fault, or None.
        code: a short machine-readable code (OpenAI's `code`), or None.
    """

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def from_request_error(cls, exc: RequestError) -> OpenAIError:
        """The HTTP error for an engine refusal (its field becomes `param`)."""
        status = HTTP_STATUS.get(exc.code, 500)
        field = _HTTP_FIELDS.get(exc.field, exc.field)
        message = exc.message
        if field != exc.field and message.startswith(exc.field):
            message = field + message[len(exc.field):]
        return cls(status, message, field, exc.code.value.lower())


#: The engine's (gRPC's) field names that the HTTP API calls otherwise.
_HTTP_FIELDS = {"prompt_ids": "prompt"}


def error_body(status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    """The JSON body of an error."""
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: OpenAIError) -> JSONResponse:
    """A JSONResponse for `exc` (401 also carries WWW-Authenticate)."""
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    body = error_body(exc.status, exc.message, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=headers)


def error_bytes(exc: OpenAIError) -> bytes:
    """The JSON body of `exc` as bytes (for the ASGI middleware and SSE error events)."""
    return json.dumps(error_body(exc.status, exc.message, exc.param, exc.code)).encode()


#: Names pydantic puts in an error's location for the branch of a union.
_TYPE_NAMES = frozenset({"str", "int", "bool", "float", "list", "dict", "none"})


def _field_path(loc: tuple[Any, ...]) -> str | None:
    """`("body", "messages", 0, "role")` -> `"messages[0].role"`; the pydantic union branch
    names (e.g. `list[int]`, `function-after[...]`) are dropped."""
    parts: list[str] = []
    for item in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif "[" in str(item) or str(item) in _TYPE_NAMES:
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The 400 for a body pydantic refused: malformed JSON, an unknown field, a wrong type."""
    errors = exc.errors()
    first = errors[0] if errors else {"type": "", "loc": (), "msg": "invalid request body"}
    if first["type"] == "json_invalid":
        detail = first.get("ctx", {}).get("error", "")
        return OpenAIError(400, f"the body is not valid JSON: {detail}".rstrip(": "),
                           None, "invalid_json")
    field = _field_path(tuple(first["loc"]))
    if first["type"] == "extra_forbidden":
        message = (f"{field}: unknown field (not one this server implements; refused rather "
                   f"than ignored)")
    elif first["type"] == "missing" and field is None:
        message = "the body is required: a JSON object"
    elif first["type"] == "missing":
        message = f"{field}: field required"
    elif field is None:
        message = f"the body must be a JSON object: {first['msg']}"
    else:
        value = first.get("input")
        shown = json.dumps(value)[:80] if _jsonable(value) else repr(value)[:80]
        message = f"{field}: {first['msg']} (got {shown})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problem(s))"
    return OpenAIError(400, message, field, "invalid_value")


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def install_handlers(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape: ours, the engine's, pydantic's and routing's."""

    @app.exception_handler(OpenAIError)
    async def _openai(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestError)
    async def _engine(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(OpenAIError.from_request_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            detail = f"{request.method} {request.url.path}: no such endpoint"
        return error_response(OpenAIError(exc.status_code, detail))
