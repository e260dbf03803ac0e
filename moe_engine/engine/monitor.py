"""The core side of the front end's liveness: a core whose front end is gone or silent exits.

The front end (`EngineClient`) publishes a `Heartbeat` every `HEARTBEAT_INTERVAL_S` on a PUB
socket of its own. In each engine-core process (and each expert-parallel rank on the front
end's node) a `FrontEndMonitor` thread subscribes to it with its own sockets, so it never
touches the step loop's sockets and keeps watching while the main thread is busy loading the
model or running a long step. It ends the process, with a logged reason, when

- its parent process is gone (the front end died), or
- no heartbeat came for `timeout_s` seconds (the front end's event loop stopped or hangs,
  e.g. a test whose loop went away without SHUTDOWN: the core ignores SIGTERM, so nothing
  else would end it).

A pause of this process itself (SIGSTOP, a suspended machine) does not count as silence.
The same thread forwards `StartupProgress` messages: any thread may call `report`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import zmq

from moe_engine.engine.messages import Codec, StartupProgress

logger = logging.getLogger(__name__)

#: How often the front end sends a heartbeat (seconds).
HEARTBEAT_INTERVAL_S = 1.0
#: How long a core waits without a heartbeat before it exits (seconds).
FRONTEND_TIMEOUT_S = 20.0
#: How often the monitor looks around (seconds).
_POLL_S = 0.25
#: A gap between two looks this much longer than _POLL_S means this process was stopped.
_STALL_FACTOR = 8
#: How long the progress socket may wait to flush when the monitor stops (ms).
_LINGER_MS = 1000


class FrontEndMonitor(threading.Thread):
    """Watches the front end from a daemon thread; see the module docstring.

    Args:
        ctx: this process's ZeroMQ context (the thread makes its own sockets in it).
        who: names this process in the log ("engine core", "rank 1").
        parent_pid: the process whose exit ends this one.
        heartbeat_addr: the front end's heartbeat PUB address, or None (no silence check).
        output_addr: the front end's output PULL address for StartupProgress, or None.
        timeout_s: the silence bound (seconds).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        who: str,
        parent_pid: int,
        heartbeat_addr: str | None,
        output_addr: str | None = None,
        timeout_s: float = FRONTEND_TIMEOUT_S,
    ) -> None:
        super().__init__(name="front-end-monitor", daemon=True)
        self.ctx, self.who, self.parent_pid = ctx, who, parent_pid
        self.heartbeat_addr, self.output_addr = heartbeat_addr, output_addr
        self.timeout_s = timeout_s
        self._progress: queue.SimpleQueue[StartupProgress] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._codec = Codec()
        #: time.monotonic() of the last heartbeat (or of startup / the end of a pause).
        self._last_seen = time.monotonic()

    def report(self, phase: str, detail: str = "", eta_s: float | None = None) -> None:
        """Send a StartupProgress to the front end (thread-safe; dropped without one)."""
        if self.output_addr is not None:
            self._progress.put(StartupProgress(phase, detail, eta_s))

    def silence_s(self) -> float | None:
        """Seconds since the last heartbeat when the front end has missed at least two
        (it has stopped or hangs), else None; always None without a heartbeat address."""
        if self.heartbeat_addr is None:
            return None
        silent = time.monotonic() - self._last_seen
        return silent if silent > 2 * HEARTBEAT_INTERVAL_S + _POLL_S else None

    def exit_if_silent(self, what_failed: str) -> None:
        """End the process naming the silent front end as the cause, when it is silent
        (`silence_s`): a rank whose collective failed because a peer rank already left for
        missing heartbeats reports that cause, not the peer's closed connection. Returns when
        the front end is not silent."""
        silent = self.silence_s()
        if silent is not None:
            self._exit(
                f"no heartbeat from the front end for {silent:.1f} s (the bound is "
                f"{self.timeout_s:.0f} s; {what_failed} as a peer left first): the front end "
                f"is gone or hangs"
            )

    def stop(self) -> None:
        """End the thread (its sockets closed, pending progress flushed) and wait for it."""
        self._stopping.set()
        if self.is_alive():
            self.join(5.0)

    def run(self) -> None:
        sub = push = None
        poller = zmq.Poller()
        if self.heartbeat_addr is not None:
            sub = self.ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(self.heartbeat_addr)
            poller.register(sub, zmq.POLLIN)
        if self.output_addr is not None:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, _LINGER_MS)
            push.connect(self.output_addr)
        try:
            self._watch(poller, sub, push)
        finally:
            for sock in (sub, push):
                if sock is not None:
                    sock.close()

    def _watch(self, poller: zmq.Poller, sub: zmq.Socket | None, push: zmq.Socket | None) -> None:
        last_seen = last_look = time.monotonic()
        while not self._stopping.is_set():
            if sub is not None:
                poller.poll(_POLL_S * 1000)
            else:
                self._stopping.wait(_POLL_S)
            now = time.monotonic()
            if now - last_look > _STALL_FACTOR * _POLL_S:
                last_seen = now  # this process was stopped: its own pause is no silence
            last_look = now
            while sub is not None and self._received(sub):
                last_seen = now
            self._last_seen = last_seen
            while push is not None and not self._progress.empty():
                push.send(self._codec.encode(self._progress.get()))
            if os.getppid() != self.parent_pid:
                self._exit(f"its parent (pid {self.parent_pid}, the front end) is gone")
            if sub is not None and now - last_seen > self.timeout_s:
                self._exit(
                    f"no heartbeat from the front end for {now - last_seen:.1f} s (the bound is "
                    f"{self.timeout_s:.0f} s): the front end is gone or hangs"
                )

    def _received(self, sub: zmq.Socket) -> bool:
        try:
            self._codec.decode_heartbeat(sub.recv(zmq.NOBLOCK))
        except zmq.Again:
            return False
        except Exception:  # noqa: BLE001 - a malformed frame is still a sign of life
            logger.debug("%s: malformed heartbeat frame", self.who)
        return True

    def _exit(self, reason: str) -> None:
        logger.error("%s (pid %d) exits: %s", self.who, os.getpid(), reason)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)
