"""The protocol channel of a peer runner script (bench/peer_runner.py's JSON lines), shared by
bench/vllm_runner.py and bench/llamacpp_runner.py.

Standard library only: the runners run under their peer's own python (a venv under
`bench/.venvs/`) and import this file as a sibling of their script (bench/ is `sys.path[0]`).
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO


def send(proto: TextIO, obj: dict[str, Any]) -> None:
    """Write one protocol line and flush it."""
    proto.write(json.dumps(obj) + "\n")
    proto.flush()


def run_commands(lines: Iterable[str], commands: tuple[str, ...] = ("run",)
                 ) -> Iterator[dict[str, Any]]:
    """The `{"cmd": "run", ...}` commands (or any of `commands`) of the driver's lines (stdin),
    in order, until `{"cmd": "quit"}` or the end; blank lines are skipped.

    Raises:
        ValueError: any other command.
    """
    for line in lines:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("cmd") == "quit":
            return
        if cmd.get("cmd") not in commands:
            raise ValueError(f"unknown command {cmd!r}")
        yield cmd


def run_runner(serve: Callable[[argparse.Namespace, TextIO], None],
               args: argparse.Namespace) -> int:
    """Run `serve(args, proto)` with the protocol channel kept private: the original stdout
    becomes `proto`, and fd 1 (inherited by anything the peer starts, and every print) goes to
    stderr. An exception is reported as `{"event": "error"}` for the driver (which keeps the
    other rows' figures) and raised again; returns 0 otherwise."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    try:
        serve(args, proto)
    except Exception as exc:
        send(proto, {"event": "error", "error": f"{type(exc).__name__}: {exc}"})
        raise
    return 0
