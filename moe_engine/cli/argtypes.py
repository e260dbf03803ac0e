"""argparse value types shared by the command-line tools (`moe-client`, `moe-skew`, bench/)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum` (the error names the bound and the value)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected an integer >= {minimum}, got {text!r}"
            ) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def positive_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds > 0, got {text}")
    return value


def non_negative_seconds(text: str) -> float:
    """An argparse type: a finite number of seconds >= 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value >= 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def server_address(text: str) -> str:
    """An argparse type: a gRPC server address HOST:PORT (IPv6 as [ADDR]:PORT), port 1..65535.

    The port is required: gRPC would otherwise silently pick 443, not moe-serve's 50051.

    Raises:
        argparse.ArgumentTypeError: no port, an empty host, a bare IPv6 address, or a port that
            is not an integer in 1..65535.
    """
    example = "HOST:PORT, e.g. 127.0.0.1:50051 or [::1]:50051"
    if text.startswith("["):  # [IPv6]:PORT
        end = text.find("]")
        host, rest = (text[: end + 1], text[end + 1 :]) if end > 1 else (text, "")
        if end <= 1 or any(c.isspace() for c in host):
            raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}")
        sep, port = rest[:1], rest[1:]
        if sep != ":" or not port:
            raise argparse.ArgumentTypeError(f"expected {example}; {text!r} has no port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not port or ":" in host:
            why = " (IPv6 addresses go in brackets)" if ":" in host else ""
            raise argparse.ArgumentTypeError(f"expected {example}; {text!r} has no port{why}")
        if not host or any(c.isspace() for c in host):
            why = "has no host" if not host else "has a space in its host"
            raise argparse.ArgumentTypeError(f"expected {example}; {text!r} {why}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected {example}; the port must be an integer in 1..65535, got {port!r}"
        )
    return text
