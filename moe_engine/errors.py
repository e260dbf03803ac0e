"""Errors the engine raises for a request it refuses, mapped to gRPC status codes by the server."""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """The gRPC status a refusal maps to (names as in grpc.StatusCode)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    OUT_OF_RANGE = "OUT_OF_RANGE"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    UNAVAILABLE = "UNAVAILABLE"


class RequestError(ValueError):
    """A request the engine refuses.

    Attributes:
        code: the status it maps to.
        field: the request field at fault ("prompt", "max_tokens", ...).
        message: names the field, the value and the limit.
    """

    def __init__(self, code: ErrorCode, field: str, message: str) -> None:
        super().__init__(message)
        self.code = ErrorCode(code)
        self.field = field
        self.message = message


class ParamError(ValueError):
    """A sampling parameter outside its limits (raised by `SamplingParams` at construction).

    Attributes:
        field: the parameter at fault ("temperature", "stop", ...).
        message: names the field, the value and the limit.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message


class StartupError(RuntimeError):
    """The engine cannot start with this configuration; the message gives numbers and flags."""
