"""Helpers for tests that talk to a real gRPC server: a server on a background thread's loop,
free ports, and request builders.

    handle = ServerThread(engine_config, ServerOptions(port=0, ...))
    with grpc.insecure_channel(handle.address) as channel:
        stub = pb_grpc.MoeEngineStub(channel)
        responses = list(stub.Generate(request([5, 6, 7], max_tokens=8, temperature=0.0)))
    handle.close()
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moe_engine.engine.core_proc import DEFAULT_CORE_FACTORY
from moe_engine.server.app import MoeServer, ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import EngineConfig

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A started MoeServer (health SERVING) on its own event loop in a daemon thread.

    Nothing outlives it: the engine's own startup timeout is `startup_timeout_s` (the core
    process is stopped when it passes), and a start that fails or overruns for any other reason
    cancels the start, shuts the engine down, kills a core process that is still alive and
    ends the loop's thread before the error propagates. `close` does the same after a drain.

    Attributes:
        server: the MoeServer (its `port`, `engine`, `metrics`, `options`).
        address: "127.0.0.1:<port>".
    """

    #: Time on top of the startup timeout for the engine's own timeout path to clean up (s).
    _CLEANUP_MARGIN_S = 30.0

    def __init__(
        self,
        config: EngineConfig,
        options: ServerOptions,
        startup_timeout_s: float = 180,
        core_factory: str = DEFAULT_CORE_FACTORY,
    ) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        options = dataclasses.replace(options, startup_timeout_s=startup_timeout_s)
        self.server = MoeServer(config, options, core_factory=core_factory)
        start = asyncio.run_coroutine_threadsafe(self.server.start(), self.loop)
        try:
            start.result(startup_timeout_s + self._CLEANUP_MARGIN_S)
        except BaseException:
            start.cancel()
            self._teardown(grace_s=0.0)
            raise
        self.address = f"127.0.0.1:{self.server.port}"

    @property
    def core_pid(self) -> int | None:
        """The engine core process's pid (None before it was spawned)."""
        return self.server.engine.core_pid

    def run(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Drain for at most 1 s, stop the server and the core process, end the thread."""
        self._teardown(grace_s=1.0)

    def _teardown(self, grace_s: float) -> None:
        """Stop the server (best effort), make sure the core process is gone, end the loop."""
        try:
            self.run(self.server.stop(grace_s=grace_s), timeout=60)
        except BaseException as exc:  # noqa: BLE001 - the kill below must still run
            logger.warning("server stop failed (%s); killing the engine core", exc)
        kill_process(self.core_pid)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def kill_process(pid: int | None, timeout_s: float = 10.0) -> None:
    """SIGKILL `pid` if it is still alive and wait (up to `timeout_s`) until it is gone."""
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)


def process_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie whose parent has not reaped it counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def child_pids(parent: int) -> set[int]:
    """Live processes whose parent is `parent` (from /proc), multiprocessing's own helpers
    aside: the resource tracker and the fork server live until the interpreter exits."""
    children = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if int(fields[1]) != parent or fields[0] == "Z":
            continue
        cmdline = (stat.parent / "cmdline").read_bytes()
        if b"multiprocessing.resource_tracker" not in cmdline and (
            b"multiprocessing.forkserver" not in cmdline
        ):
            children.add(int(stat.parent.name))
    return children


def request(ids: list[int] | None = None, **fields) -> pb.GenerateRequest:
    """A GenerateRequest with prompt_ids `ids` (set even when empty) and the given fields."""
    req = pb.GenerateRequest(**fields)
    if ids is not None:
        req.prompt_ids.ids.extend(ids)
        req.prompt_ids.SetInParent()
    return req


def stats(stub: pb_grpc.MoeEngineStub) -> pb.ServerStats:
    return stub.GetServerStats(pb.GetServerStatsRequest())


def wait_idle(stub: pb_grpc.MoeEngineStub, free_blocks: int, timeout_s: float = 30) -> None:
    """Wait until nothing runs or waits and `free_blocks` KV blocks are free (else fail)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = stats(stub)
        idle = s.num_running == 0 and s.num_waiting == 0 and s.kv_blocks_free == free_blocks
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, free_blocks), s


def token_ids(responses: list[pb.GenerateResponse]) -> list[int]:
    """All generated ids of one streamed request, in order."""
    return [t for r in responses for t in r.token_ids]


__all__ = [
    "ServerThread",
    "child_pids",
    "free_port",
    "kill_process",
    "process_alive",
    "request",
    "stats",
    "token_ids",
    "wait_idle",
]


def greedy_streams(
    stub: pb_grpc.MoeEngineStub, prompts: list[list[int]], max_new: list[int],
    timeout_s: float = 180,
) -> list[list[int]]:
    """Stream every prompt at once (one thread each), greedy with ignore_eos, `max_new[i]`
    tokens for prompt i; returns the generated ids per prompt, in prompt order."""

    def one(i: int) -> list[int]:
        req = request(prompts[i], max_tokens=max_new[i], temperature=0.0, ignore_eos=True)
        return token_ids(list(stub.Generate(req, timeout=timeout_s)))

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))
