"""EngineClient: the front end's handle on the engine core process (asyncio).

`start` spawns the core process (`core_proc.run_engine_core`, multiprocessing spawn) and waits
until it reports the model loaded, keeping what it reports meanwhile in `startup_status`;
`shutdown` stops it. The request side (`generate` streams one request's outputs; `abort`,
`get_stats` and `model_info` serve the other RPCs, and `control` the RL rollout ones: pause,
resume, weight updates, `control.py`) is `RequestStreams` (`streams.py`), which this class
extends with the process, its sockets and the reader that feeds the streams. The messages are
the typed structs of `messages.py`. From the start a heartbeat goes out every second on a
socket of its own, so that a core whose front end is gone or hangs exits by itself
(`monitor.py`).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import weakref

import zmq
import zmq.asyncio

from moe_engine.core.tokenizer import load_tokenizer
from moe_engine.engine import core_proc
from moe_engine.engine.messages import (
    CoreInput,
    CoreOutput,
    Fatal,
    Heartbeat,
    Ready,
    Shutdown,
    StartupFailed,
    StartupProgress,
    decode_output,
    encode,
)
from moe_engine.engine.monitor import FRONTEND_TIMEOUT_S, HEARTBEAT_INTERVAL_S
from moe_engine.engine.status import StartupStatus
from moe_engine.engine.streams import RequestStreams
from moe_engine.errors import ErrorCode, RequestError, StartupError
from moe_engine.startup.checks import check_ep_size, needs_ep_check
from moe_engine.startup.config import EngineConfig

logger = logging.getLogger(__name__)

#: How long a core stopped while starting may take to unwind (a kernel build kills its
#: compilers) before it is killed (seconds).
_STARTING_STOP_S = 3.0
#: After the core process exits, how long to wait for its last messages (seconds).
_EXIT_GRACE_S = 0.5
#: Clients started and not shut down: their cores are killed when this interpreter exits.
_started: weakref.WeakSet[EngineClient] = weakref.WeakSet()


def _kill_leftover_cores() -> None:
    """At interpreter exit, kill the cores of clients that were never shut down (a test whose
    server start timed out, a loop that went away while its thread keeps heartbeating).
    multiprocessing's own exit handler would SIGTERM a core, which ignores it (the front end
    drains it), and then wait for it forever. Registered after multiprocessing's handler, so
    it runs first."""
    for client in list(_started):
        client.kill_core()


class EngineClient(RequestStreams):
    """Talks to one engine core process over ZeroMQ (DESIGN.md section 9).

    Attributes:
        model_info: the core's ModelInfo (set by `start` once the core is ready, else None).
        startup_status: what the starting core last said it does (`describe()` for text).
        tokenizer: the checkpoint's tokenizer in this process, or None.
        dead: set when the core process has exited or failed.
        paused: whether the core was paused at its last control reply (`PauseGeneration`).
    """

    def __init__(self) -> None:
        super().__init__()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._ready: asyncio.Future | None = None
        self._reader: asyncio.Task | None = None
        self._tmpdir: str | None = None
        self._ctx: zmq.Context | None = None
        self._actx: zmq.asyncio.Context | None = None
        self._in_sock: zmq.Socket | None = None
        self._out_sock: zmq.asyncio.Socket | None = None
        self._heartbeat_sock: zmq.Socket | None = None
        self._heartbeat: asyncio.Task | None = None

    # ----------------------------------------------------------------- lifetime

    async def start(
        self,
        config: EngineConfig,
        *,
        startup_timeout_s: float = 600.0,
        core_factory: str = core_proc.DEFAULT_CORE_FACTORY,
        log_level: int = logging.INFO,
        frontend_timeout_s: float = FRONTEND_TIMEOUT_S,
    ) -> None:
        """Spawn the core process and wait until its model is loaded.

        Args:
            config: the engine configuration, passed to the core's constructor.
            startup_timeout_s: how long loading may take (seconds).
            core_factory: "module:attribute" of the core class (tests pass a fake).
            frontend_timeout_s: how long the core (every rank) runs on without a heartbeat
                from this front end before it exits by itself (seconds).

        Raises:
            StartupError: the core failed to start (its error type and message are included),
                exited before it was ready, or was not ready within `startup_timeout_s`.
        """
        ep_size = config.parallel.ep_size
        if needs_ep_check(config):
            from moe_engine.models import model_shape

            check_ep_size(config, model_shape(config.model.hf_config()).num_experts)
        self._rank_load = [0] * ep_size
        self._parked_timeout_s = config.disagg.timeout_s
        loop = asyncio.get_running_loop()
        self._ready = loop.create_future()
        self.startup_status = StartupStatus()
        in_addr, out_addr, heartbeat_addr = self._bind()
        self._reader = asyncio.create_task(self._read_outputs(), name="engine-output-reader")
        self._heartbeat = asyncio.create_task(self._send_heartbeats(), name="engine-heartbeat")
        mp = multiprocessing.get_context("spawn")
        if ep_size > 1:  # the ranks, through torch's elastic launcher
            from moe_engine.engine.launcher import run_launcher

            target, name = run_launcher, "moe-engine-launcher"
        else:
            target, name = core_proc.run_engine_core, "moe-engine-core"
        self._proc = mp.Process(
            target=target,
            args=(config, in_addr, out_addr, os.getpid(), core_factory, log_level,
                  heartbeat_addr, frontend_timeout_s),
            name=name,
            daemon=ep_size == 1,  # the launcher has children of its own; it is reaped on exit
        )
        self._proc.start()
        if not _started:
            atexit.unregister(_kill_leftover_cores)
            atexit.register(_kill_leftover_cores)
        _started.add(self)
        loop.add_reader(self._proc.sentinel, self._on_process_exit)
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer,
                                                         config.model.tokenizer_path))
        try:
            info = await asyncio.wait_for(asyncio.shield(self._ready), startup_timeout_s)
        except TimeoutError:
            tokenizer.cancel()
            await self.shutdown(timeout_s=1.0)
            raise StartupError(
                f"engine core was not ready within {startup_timeout_s:.0f} s (startup timeout)"
            ) from None
        except BaseException:
            tokenizer.cancel()
            await self.shutdown(timeout_s=1.0)
            raise
        self.tokenizer = await tokenizer if info.has_tokenizer else None
        self.model_info = info
        logger.info("engine core ready (pid %d): %s", self._proc.pid, info.architecture)

    def _bind(self) -> tuple[str, str, str]:
        """Open the input PUSH, output PULL and heartbeat PUB sockets on ipc:// paths in a
        private directory.

        The input socket connects (the core binds it): a connecting PUSH queues messages at
        once, while a binding one has no peer, and refuses to send, until the core's connection
        completes, which may be after READY arrives.
        """
        self._tmpdir = tempfile.mkdtemp(prefix="moe-engine-")
        in_addr = f"ipc://{self._tmpdir}/in.sock"
        out_addr = f"ipc://{self._tmpdir}/out.sock"
        self._ctx = zmq.Context()
        self._in_sock = self._ctx.socket(zmq.PUSH)
        # Unlimited queue: sending never blocks the event loop.
        self._in_sock.setsockopt(zmq.SNDHWM, 0)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.connect(in_addr)
        self._actx = zmq.asyncio.Context()
        self._out_sock = self._actx.socket(zmq.PULL)
        self._out_sock.setsockopt(zmq.RCVHWM, 0)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        self._out_sock.bind(out_addr)
        heartbeat_addr = f"ipc://{self._tmpdir}/heartbeat.sock"
        self._heartbeat_sock = self._ctx.socket(zmq.PUB)
        self._heartbeat_sock.setsockopt(zmq.LINGER, 0)
        self._heartbeat_sock.bind(heartbeat_addr)
        return in_addr, out_addr, heartbeat_addr

    async def _send_heartbeats(self) -> None:
        """Tell the core every HEARTBEAT_INTERVAL_S that this front end is alive."""
        while self._heartbeat_sock is not None:
            try:
                self._heartbeat_sock.send(encode(Heartbeat(time.time())), zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.debug("heartbeat not sent: %s", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core process (SHUTDOWN, or SIGTERM while it is still starting, then kill
        after `timeout_s`) and release sockets.

        Live streams end with RequestError(UNAVAILABLE).
        """
        proc = self._proc
        if proc is not None and proc.is_alive():
            if self.model_info is None:  # still starting: SIGTERM unwinds its startup
                proc.terminate()
                timeout_s = max(timeout_s, _STARTING_STOP_S)
            else:
                self._try_send(Shutdown())
            await asyncio.to_thread(proc.join, timeout_s)
            if proc.is_alive():
                logger.warning("engine core did not stop within %.1f s; killing it", timeout_s)
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)
        self._kill_ranks()
        _started.discard(self)
        self._mark_dead("the engine is shut down")
        if proc is not None:
            asyncio.get_running_loop().remove_reader(proc.sentinel)
        for task in (self._reader, self._heartbeat):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        for sock in (self._in_sock, self._out_sock, self._heartbeat_sock):
            if sock is not None:
                sock.close(linger=0)
        for ctx in (self._ctx, self._actx):
            if ctx is not None:
                ctx.term()
        self._in_sock = self._out_sock = self._heartbeat_sock = None
        self._ctx = self._actx = None
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    @property
    def core_pid(self) -> int | None:
        """The core process's pid (None before start)."""
        return self._proc.pid if self._proc is not None else None

    # ----------------------------------------------------------------- plumbing

    def _send(self, message: CoreInput) -> None:
        """Send to the core without blocking.

        Raises:
            RequestError: UNAVAILABLE when the socket is gone.
        """
        if self._in_sock is None:
            raise RequestError(ErrorCode.UNAVAILABLE, "engine", "engine is not running")
        try:
            self._in_sock.send(encode(message), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise RequestError(
                ErrorCode.UNAVAILABLE, "engine", f"engine unreachable: {exc}"
            ) from exc

    async def _read_outputs(self) -> None:
        assert self._out_sock is not None
        while True:
            frame = await self._out_sock.recv()
            try:
                self._dispatch(decode_output(frame))
            except Exception:
                logger.exception("bad message from the engine core (%d bytes)", len(frame))

    def _dispatch(self, message: CoreOutput) -> None:
        if self._deliver(message):  # a request's output or refusal, or an RPC's reply
            return
        match message:
            case StartupProgress(phase=phase, detail=detail, eta_s=eta):
                if self._ready is not None and not self._ready.done():
                    self._on_progress(phase, detail, eta)
            case Ready(info=info):
                if self._ready is not None and not self._ready.done():
                    self._ready.set_result(info)
            case StartupFailed(message=text, traceback=tb):
                logger.debug("engine core startup traceback:\n%s", tb)
                self._fail_start(StartupError(f"engine core failed to start: {text}"))
            case Fatal(message=text, traceback=tb):
                if tb:
                    logger.error("engine core failed:\n%s", tb)
                logger.error("engine failed: %s", text)
                self._fail_start(StartupError(f"engine failed to start: {text}"))
                self._mark_dead(f"engine core failed: {text}")
            case _:
                logger.error("unexpected message from the engine core: %s", type(message).__name__)

    def _on_progress(self, phase: str, detail: str, eta_s: float | None) -> None:
        """Keep the starting core's latest status; log each new phase (the progress within
        a phase, e.g. the kernel build's, the core logs itself)."""
        now = time.monotonic()
        new_phase = phase != self.startup_status.phase
        self.startup_status = self.startup_status.advance(phase, detail, eta_s, now)
        if new_phase:
            logger.info("engine starting: %s", self.startup_status.describe(now))

    def _fail_start(self, error: StartupError) -> None:
        """Make a pending `start` raise `error` (no-op once the core was ready)."""
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(error)
            self._ready.exception()  # mark retrieved; start() re-raises it

    def _on_process_exit(self) -> None:
        """The core process ended: give its last messages a moment, then fail what is left."""
        loop = asyncio.get_running_loop()
        assert self._proc is not None
        loop.remove_reader(self._proc.sentinel)
        loop.call_later(_EXIT_GRACE_S, self._after_exit)

    def kill_core(self) -> None:
        """SIGKILL the core process (and its ranks) if it still runs: the last resort when no
        event loop is left to `shutdown` it (any thread may call it)."""
        proc = self._proc
        if proc is not None and proc.pid is not None and proc.exitcode is None:
            logger.warning("engine core (pid %d) still running at exit: killing it", proc.pid)
            try:
                os.kill(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._kill_ranks()

    def _kill_ranks(self) -> None:
        """SIGKILL whatever is left of the launcher's process group (its ranks: the launcher
        runs in a session of its own). A rank that hangs or was stopped (SIGSTOP) does not
        answer its watchdog or the agent's SIGTERM; this leaves no orphan behind."""
        if self._proc is None or len(self._rank_load) == 1 or self._proc.pid is None:
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # every rank already exited

    def _after_exit(self) -> None:
        self._kill_ranks()
        code = self._proc.exitcode if self._proc is not None else None
        reason = f"engine core process exited with status {code}"
        self._fail_start(StartupError(f"{reason} before it was ready"))
        if not self.dead.is_set():
            if code not in (0, None):
                logger.error("%s", reason)
            self._mark_dead(reason)

    def _mark_dead(self, reason: str) -> None:
        """Fail every open stream and pending reply with UNAVAILABLE."""
        if not self.dead.is_set():
            self.death_reason = reason
            self.dead.set()
        self._fail_requests(
            RequestError(ErrorCode.UNAVAILABLE, "engine", f"engine unavailable: {reason}")
        )

