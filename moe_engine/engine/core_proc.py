"""The engine core's child process: EngineCore's step loop behind ZeroMQ sockets.

The front end (`EngineClient`) connects a PUSH socket to this process's bound PULL socket for
inputs, and binds a PULL socket that this process's PUSH socket connects to for outputs
(DESIGN.md section 9); connecting sides queue messages before the peer is up. The messages are
the typed structs of `messages.py` (a tagged msgpack union). A third socket carries the front
end's heartbeats to a `monitor.FrontEndMonitor` thread, which also forwards StartupProgress
while the core is built and ends the process when the front end is gone or silent.

The loop drains its inputs before every step, so an abort takes effect within one step; it
blocks on the input socket only when it has no unfinished requests.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading
import traceback
from typing import Any

import msgspec
import zmq
from tqdm import tqdm

from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.core.protocol import EngineCoreProtocol
from moe_engine.engine import loop
from moe_engine.engine.messages import (
    AddError,
    CoreInput,
    EngineCoreOutputs,
    Fatal,
    Ready,
    StartupFailed,
    decode_input,
    encode,
)
from moe_engine.engine.monitor import FRONTEND_TIMEOUT_S, FrontEndMonitor
from moe_engine.engine.role import PlainRole, Role, import_attribute, role_for
from moe_engine.errors import ErrorCode, ParamError
from moe_engine.startup.config import EngineConfig
from moe_engine.startup.env import default_threads

logger = logging.getLogger(__name__)

#: What builds the engine core, as "module:attribute" called as factory(config, [rank_context,]
#: progress=...) (tests substitute a fake core through it).
DEFAULT_CORE_FACTORY = "moe_engine.core.build:build_engine_core"
#: How long an idle loop blocks on its input socket before it looks around again (ms).
_IDLE_POLL_MS = 500
#: How long closing a socket may wait to flush the last messages (ms).
_LINGER_MS = 5000


def resolve_core_factory(spec: str) -> Any:
    """Import "module:attribute" and return the attribute (a class or a callable)."""
    return import_attribute(spec, "core factory")


def refusal_of_frame(frame: bytes, exc: Exception) -> AddError | None:
    """The AddError for an "add" frame that does not decode (e.g. SamplingParams refusing a
    value: its ParamError names the field), or None when the frame is not an "add" at all."""
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        return None
    if not (isinstance(raw, list) and len(raw) > 1 and raw[0] == "add"):
        return None
    cause = exc.__cause__
    field = cause.field if isinstance(cause, ParamError) else "request"
    text = cause.message if isinstance(cause, ParamError) else f"request: {exc}"
    return AddError(str(raw[1]), ErrorCode.INVALID_ARGUMENT, field, text)


class CoreLoop:
    """Runs one engine core: drains inputs, steps while there is work, pushes outputs. Each
    message is applied by `loop.apply`; this class is only the ZeroMQ transport around it.

    Args:
        core: an EngineCore (or a test double with the same interface).
        inputs: the bound PULL socket.
        outputs: the connected PUSH socket.
        role: this instance's part in a prefill/decode split (`role.role_for`); None: a
            plain instance (`role.PlainRole`).
    """

    def __init__(self, core: EngineCoreProtocol, inputs: zmq.Socket, outputs: zmq.Socket,
                 role: Role | None = None) -> None:
        self.core = core
        self.role: Role = PlainRole(core) if role is None else role
        self.inputs = inputs
        self.outputs = outputs
        self.running = True
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)

    def run(self) -> None:
        """Loop until Shutdown."""
        while self.running:
            busy = self.core.has_unfinished_requests()
            if self._poller.poll(0 if busy else _IDLE_POLL_MS):
                self._drain_inputs()
            if self.running and self.core.has_unfinished_requests():
                report = loop.step(self.core, self.role)
                for refusal in report.add_errors:
                    self._send(refusal)
                self._send_outputs(report.outputs)
            self.role.tick()

    def _drain_inputs(self) -> None:
        while self.running:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                message = decode_input(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                refusal = refusal_of_frame(frame, exc)
                if refusal is None:
                    logger.error("engine core: undecodable message ignored: %s", exc)
                else:
                    self._send(refusal)
                continue
            self.handle(message)

    def handle(self, message: CoreInput) -> None:
        """Act on one input message (`loop.apply`) and send what it produced: its outputs,
        then its refusal, then its reply."""
        report = loop.apply(self.core, self.role, message)
        self._send_outputs(report.outputs)
        for refusal in report.add_errors:
            self._send(refusal)
        for answer in report.replies.values():
            self._send(loop.reply_for(message, [answer]))
        if report.stop:
            self.running = False

    def _send_outputs(self, outputs: list[EngineCoreOutput]) -> None:
        if outputs:
            self._send(EngineCoreOutputs(outputs))

    def _send(self, message: Any) -> None:
        self.outputs.send(encode(message))


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    core_factory: str = DEFAULT_CORE_FACTORY,
    log_level: int = logging.INFO,
    heartbeat_addr: str | None = None,
    frontend_timeout_s: float = FRONTEND_TIMEOUT_S,
) -> None:
    """The child process's entry point: build the core, report Ready, run the loop.

    Args:
        heartbeat_addr: the front end's heartbeat PUB address (None: only the parent is
            watched); frontend_timeout_s: how long the core runs on without a heartbeat (s).

    A failure while building the core is reported as StartupFailed and ends the process with
    status 1; a failure in the loop is reported as Fatal.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [core] %(message)s")
    if config.parallel.num_threads is None:  # every core, beside the front end
        threads = default_threads()
        config = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, num_threads=threads)
        )
    # tqdm's default lock is a multiprocessing RLock: a named semaphore that the resource
    # tracker reports as leaked when this process exits through os._exit. One process, one
    # progress bar at a time: a thread lock is enough.
    tqdm.set_lock(threading.RLock())
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # While the core starts, SIGTERM (the front end giving up on the start, or Ctrl-C there)
    # stops it at once, through the startup's own cleanup: a kernel build kills its compilers.
    # Once it serves, SIGTERM to the whole group (timeout, systemd, kill -- -PGID) must drain,
    # not kill the core under running requests (see `_build_and_run`).
    signal.signal(signal.SIGTERM, _stop_starting_core)
    ctx = zmq.Context()
    monitor = FrontEndMonitor(
        ctx, "engine core", parent_pid, heartbeat_addr, output_addr, frontend_timeout_s
    )
    monitor.start()
    inputs = ctx.socket(zmq.PULL)
    inputs.bind(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.setsockopt(zmq.LINGER, _LINGER_MS)
    outputs.connect(output_addr)
    status = 0
    try:
        status = _build_and_run(config, core_factory, monitor, inputs, outputs)
    finally:
        monitor.stop()
        inputs.close(linger=0)
        outputs.close()
        ctx.term()
    sys.exit(status)


def _build_and_run(
    config: EngineConfig,
    core_factory: str,
    monitor: FrontEndMonitor,
    inputs: zmq.Socket,
    outputs: zmq.Socket,
) -> int:
    try:
        core = resolve_core_factory(core_factory)(config, progress=monitor.report)
        role = role_for(core, config.disagg)
        info = loop.model_info_of(core)
    except BaseException as exc:  # noqa: BLE001 - every startup failure goes to the parent
        # the front end gets the reason and ends this process: no second, misleading line
        # (the handler goes first: the SIGTERM may come before send() returns)
        signal.signal(signal.SIGTERM, _exit_reported)
        outputs.send(encode(StartupFailed(type(exc).__name__, str(exc), _tb())))
        return 1
    # Serving: the front end drains, then tells the core to stop; a front end that is gone or
    # silent is noticed by the monitor.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    outputs.send(encode(Ready(info)))
    try:
        CoreLoop(core, inputs, outputs, role).run()
    except BaseException as exc:  # noqa: BLE001 - report, then exit non-zero
        logger.exception("engine core loop failed")
        outputs.send(encode(Fatal(f"{type(exc).__name__}: {exc}", _tb())))
        return 1
    finally:
        core.close()
    return 0


def _stop_starting_core(signum: int, frame: object) -> None:
    """SIGTERM before READY: unwind the startup (its `finally` blocks clean up) and exit."""
    raise SystemExit(f"engine core: stopped by signal {signum} while starting")


def _exit_reported(signum: int, frame: object) -> None:
    """SIGTERM after the startup failure went to the front end: exit 1 without a message."""
    raise SystemExit(1)


def _tb() -> str:
    return traceback.format_exc()
