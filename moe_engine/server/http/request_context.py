"""Per-request context of the HTTP API: the `X-Request-Id` header and the unknown-field policy.

`RequestContextMiddleware` (pure ASGI, outermost) reads the client's `X-Request-Id` (or makes
one), puts it on every response, errors included, and scopes it, with the app's unknown-field
policy (`--allow-unknown-fields`), to the request through context variables: a request's
handlers and body validation run in its own task, so they see their own request's values and
nothing else does. As vLLM's server, a client's `X-Request-Id` is also the base of the request's
id (`chatcmpl-<X-Request-Id>`, `HttpState.open_streams`).
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

from moe_engine.server.http.errors import OpenAIError, error_bytes

logger = logging.getLogger(__name__)

#: The header, as vLLM's server reads and writes it.
REQUEST_ID_HEADER = "x-request-id"
#: Longest client request id accepted (characters).
MAX_REQUEST_ID_CHARS = 256

_REQUEST_ID: ContextVar[str | None] = ContextVar("moe_engine_http_request_id", default=None)
_ALLOW_UNKNOWN: ContextVar[bool] = ContextVar("moe_engine_http_allow_unknown", default=False)
#: Unknown field names already warned about (one warning per name per process).
_warned: set[str] = set()


def current_request_id() -> str | None:
    """The client's `X-Request-Id` of the request being handled, or None (none sent, or not
    inside a request)."""
    return _REQUEST_ID.get()


def drop_unknown_fields(model: str, data: Any, known: Iterable[str]) -> Any:
    """`data` without the keys not in `known` when the app allows unknown fields (a warning
    names each such field once per process); `data` unchanged otherwise (pydantic then refuses
    them). Called by `protocol.RequestBody` before validation.

    Args:
        model: the body part's class name (for the warning).
        data: the raw JSON value of that part.
        known: its field names and aliases.
    """
    if not _ALLOW_UNKNOWN.get() or not isinstance(data, dict):
        return data
    known = set(known)
    unknown = [key for key in data if key not in known]
    if not unknown:
        return data
    for key in unknown:
        name = f"{model}.{key}"
        if name not in _warned:
            _warned.add(name)
            logger.warning("ignoring the unknown request field %r (in %s; "
                           "--allow-unknown-fields): it has no effect on this server", key, model)
    return {k: v for k, v in data.items() if k in known}


def _check_request_id(value: str) -> None:
    if not 0 < len(value) <= MAX_REQUEST_ID_CHARS or not value.isascii() or \
            not value.isprintable():
        raise OpenAIError(
            400, f"X-Request-Id: must be 1..{MAX_REQUEST_ID_CHARS} printable ASCII characters, "
            f"got {value[:40]!r}{'...' if len(value) > 40 else ''}", "X-Request-Id",
            "invalid_value",
        )


class RequestContextMiddleware:
    """Echo `X-Request-Id` on every HTTP response and scope the request context (ASGI).

    Args:
        app: the wrapped ASGI app.
        allow_unknown_fields: ignore unknown request fields with a warning instead of
            refusing them (`--allow-unknown-fields`).
    """

    def __init__(self, app: Any, allow_unknown_fields: bool = False) -> None:
        self.app = app
        self.allow_unknown_fields = allow_unknown_fields

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = None
        for key, value in scope["headers"]:
            if key.decode("latin-1").lower() == REQUEST_ID_HEADER:
                given = value.decode("latin-1")
        request_id = given if given is not None else uuid.uuid4().hex
        header = (b"x-request-id", request_id.encode("latin-1"))

        async def send_with_id(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)

        if given is not None:
            try:
                _check_request_id(given)
            except OpenAIError as exc:
                await _send_error(send, exc)  # a bad id is not echoed
                return
        id_token = _REQUEST_ID.set(given)
        policy_token = _ALLOW_UNKNOWN.set(self.allow_unknown_fields)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            _REQUEST_ID.reset(id_token)
            _ALLOW_UNKNOWN.reset(policy_token)


async def _send_error(send: Callable, exc: OpenAIError) -> None:
    body = error_bytes(exc)
    await send({"type": "http.response.start", "status": exc.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
