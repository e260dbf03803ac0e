"""grpc.aio server interceptors: the API-key check and a clear status for undecodable requests;
and the one way every handler ends a refused call (`abort_with_refusal`).

`ApiKeyInterceptor` runs first: a call without `authorization: Bearer <key>` matching the
server's key (compared in constant time, `hmac.compare_digest`) gets UNAUTHENTICATED before its
payload is even parsed; the health service is exempt unless configured otherwise.
`DecodeErrorInterceptor` turns a request that does not parse as its protobuf message (invalid
UTF-8 in a string field, a corrupt wire format) into INVALID_ARGUMENT naming the field
"request", where gRPC itself would answer UNKNOWN ("Unexpected DecodeError").
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from moe_engine.errors import ErrorCode, RequestError
from moe_engine.server.security import API_KEY_ENV, AUTH_METADATA_KEY, AUTH_SCHEME

logger = logging.getLogger(__name__)

#: Methods of the standard health service (`grpc.health.v1.Health/Check` and `/Watch`).
HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"
#: Trailing metadata key naming the field at fault (the servicer uses the same key).
FIELD_METADATA_KEY = "moe-field"
#: The gRPC status of each refusal code.
STATUS_OF = {
    ErrorCode.INVALID_ARGUMENT: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.OUT_OF_RANGE: grpc.StatusCode.OUT_OF_RANGE,
    ErrorCode.RESOURCE_EXHAUSTED: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.ALREADY_EXISTS: grpc.StatusCode.ALREADY_EXISTS,
    ErrorCode.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
}


async def abort_with_refusal(context: grpc.aio.ServicerContext, exc: RequestError) -> None:
    """End the RPC with the status for `exc` and its field in the `moe-field` trailing
    metadata (raises grpc's AbortError)."""
    status = STATUS_OF.get(exc.code, grpc.StatusCode.INTERNAL)
    await context.abort(status, exc.message, trailing_metadata=((FIELD_METADATA_KEY, exc.field),))

_Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]]


def _refusing_handler(
    handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str
) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that ends every call with `code`, never parsing the request
    (raw bytes in, so a refused caller's payload costs nothing)."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    if handler.request_streaming and handler.response_streaming:
        make = grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        make = grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        make = grpc.unary_stream_rpc_method_handler
    else:
        make = grpc.unary_unary_rpc_method_handler
    return make(refuse, request_deserializer=None, response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for every call whose metadata lacks `authorization: Bearer <api_key>`.

    Args:
        api_key: the key clients must send (printable ASCII, see `security.check_api_key`).
        exempt_prefixes: method-name prefixes served without a key (default: the health
            service, so load balancers can probe; pass () to require the key there too).
        on_denied: called once per refused call (e.g. a metrics counter), or None.
    """

    def __init__(
        self,
        api_key: str,
        exempt_prefixes: Sequence[str] = (HEALTH_METHOD_PREFIX,),
        on_denied: Callable[[], None] | None = None,
    ) -> None:
        self._expected = api_key.encode()
        self._exempt = tuple(exempt_prefixes)
        self._on_denied = on_denied

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        method = handler_call_details.method
        problem = None if method.startswith(self._exempt) else self._problem(handler_call_details)
        handler = await continuation(handler_call_details)
        if problem is None or handler is None:
            return handler
        logger.debug("refused %s: %s", method, problem)
        if self._on_denied is not None:
            self._on_denied()
        return _refusing_handler(handler, grpc.StatusCode.UNAUTHENTICATED, problem)

    def _problem(self, details: grpc.HandlerCallDetails) -> str | None:
        """None when a matching key was sent, else why the call is refused."""
        values = [
            value
            for key, value in details.invocation_metadata or ()
            if key == AUTH_METADATA_KEY and isinstance(value, str)
        ]
        if not values:
            return (
                f"missing API key: send the metadata '{AUTH_METADATA_KEY}: {AUTH_SCHEME} <key>' "
                f"(moe-client --api-key KEY or ${API_KEY_ENV})"
            )
        for value in values:
            scheme, _, token = value.strip().partition(" ")
            if scheme.lower() == AUTH_SCHEME.lower() and hmac.compare_digest(
                token.strip().encode(), self._expected
            ):
                return None
        return f"invalid API key in the '{AUTH_METADATA_KEY}' metadata"


class _Undecodable:
    """What the safe deserializer returns for bytes that do not parse."""

    def __init__(self, error: str) -> None:
        self.error = error


def _safe_deserializer(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure of untrusted bytes
            return _Undecodable(str(exc) or type(exc).__name__)

    return parse


def _checked(behavior: Callable[..., Any]) -> Callable[..., Any]:
    """`behavior` preceded by an INVALID_ARGUMENT abort for an undecodable request."""

    async def refuse(request: _Undecodable, context: grpc.aio.ServicerContext) -> None:
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"request: not a valid protobuf message for this method ({request.error})",
            trailing_metadata=((FIELD_METADATA_KEY, "request"),),
        )

    if inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, _Undecodable):
                await refuse(request, context)
            async for response in behavior(request, context):
                yield response

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            await refuse(request, context)
        return await behavior(request, context)

    return call


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """INVALID_ARGUMENT (field "request") for a unary request that does not parse.

    Streaming-request methods (reflection) keep gRPC's own handling. The wrapped handler of
    each method is made once and reused.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self, continuation: _Continuation, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        wrapped = self._wrapped.get(method)
        if wrapped is None:
            wrapped = self._wrapped[method] = _wrap(handler)
        return wrapped


def _wrap(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    deserializer = _safe_deserializer(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _checked(handler.unary_stream), deserializer, serializer
        )
    return grpc.unary_unary_rpc_method_handler(
        _checked(handler.unary_unary), deserializer, serializer
    )
