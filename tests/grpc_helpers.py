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
import socket
import threading
import time

from moe_engine.config import EngineConfig
from moe_engine.engine.core_proc import DEFAULT_CORE_FACTORY
from moe_engine.server.app import MoeServer, ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A started MoeServer (health SERVING) on its own event loop in a daemon thread.

    Attributes:
        server: the MoeServer (its `port`, `engine`, `metrics`, `options`).
        address: "127.0.0.1:<port>".
    """

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
        start = self._start(config, options, core_factory)
        self.server: MoeServer = self.run(start, startup_timeout_s)
        self.address = f"127.0.0.1:{self.server.port}"

    @staticmethod
    async def _start(config: EngineConfig, options: ServerOptions, core_factory: str) -> MoeServer:
        server = MoeServer(config, options, core_factory=core_factory)
        await server.start()
        return server

    def run(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        """Drain for at most 1 s, stop the server and the core process, end the thread."""
        self.run(self.server.stop(grace_s=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


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
    "free_port",
    "request",
    "stats",
    "token_ids",
    "wait_idle",
]
