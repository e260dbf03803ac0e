"""The engine core's child process: EngineCore's step loop behind two ZeroMQ sockets.

The front end (`EngineClient`) connects a PUSH socket to this process's bound PULL socket for
inputs, and binds a PULL socket that this process's PUSH socket connects to for outputs
(DESIGN.md section 9); connecting sides queue messages before the peer is up. Every message
is a msgpack array whose first element names its kind:

inputs (front end -> core)
    ["ADD", request_id, prompt_token_ids, sampling_params (dict), arrival_time (s), rank]
                                 rank: the target rank under expert parallelism (0 here)
    ["ABORT", [request_id, ...]]
    ["STATS", reply_id]          -> ["REPLY", reply_id, stats dict]
    ["EXPERT_LOAD", reply_id]    -> ["REPLY", reply_id, expert load dict]
    ["INFO", reply_id]           -> ["REPLY", reply_id, model info dict]
    ["SHUTDOWN"]
outputs (core -> front end)
    ["READY", model info dict]                        once the model is loaded
    ["STARTUP_FAILED", error type, message, traceback] then the process exits with status 1
    ["OUTPUTS", [encoded RequestOutput, ...]]         one per step (and per abort) with outputs
    ["ADD_ERROR", request_id, code, field, message]   a refused ADD
    ["FATAL", message, traceback]                     the step loop failed; the process exits

The loop drains its inputs before every step, so an abort takes effect within one step; it
blocks on the input socket only when it has no unfinished requests. A watchdog thread ends the
process when its parent dies.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgpack
import zmq
from tqdm import tqdm

from moe_engine.config import EngineConfig, default_threads
from moe_engine.errors import RequestError
from moe_engine.request import FinishReason, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

#: The engine core class, as "module:attribute" (tests substitute a fake core through it).
DEFAULT_CORE_FACTORY = "moe_engine.engine.core:EngineCore"
#: How often the watchdog checks that the parent is alive (seconds).
_PARENT_CHECK_S = 0.5
#: How long an idle loop blocks on its input socket before it looks around again (ms).
_IDLE_POLL_MS = 500
#: How long closing a socket may wait to flush the last messages (ms).
_LINGER_MS = 5000


def pack(message: list[Any]) -> bytes:
    """Encode one IPC message (a list whose first element is its kind)."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list[Any]:
    """Decode one IPC message."""
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


def encode_output(out: RequestOutput) -> list[Any]:
    """A `RequestOutput` as a msgpack-friendly list (logprob dicts become [id, logprob] pairs)."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = [[lp, [[tok, v] for tok, v in top.items()]] for lp, top in out.logprobs]
    reason = str(out.finish_reason) if out.finish_reason is not None else None
    return [
        out.request_id,
        list(out.new_token_ids),
        out.new_text,
        out.finished,
        reason,
        out.num_prompt_tokens,
        out.num_output_tokens,
        logprobs,
        out.error,
    ]


def decode_output(fields: list[Any]) -> RequestOutput:
    """The inverse of `encode_output`."""
    rid, ids, text, finished, reason, n_prompt, n_out, logprobs, error = fields
    if logprobs is not None:
        logprobs = [(lp, {int(tok): v for tok, v in top}) for lp, top in logprobs]
    return RequestOutput(
        request_id=rid,
        new_token_ids=ids,
        new_text=text,
        finished=finished,
        finish_reason=FinishReason(reason) if reason is not None else None,
        num_prompt_tokens=n_prompt,
        num_output_tokens=n_out,
        logprobs=logprobs,
        error=error,
    )


def resolve_core_factory(spec: str) -> Any:
    """Import "module:attribute" and return the attribute (a class or a callable)."""
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"core factory must look like 'module:attribute', got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


def model_info_of(core: Any) -> dict[str, Any]:
    """The core's model info plus `has_tokenizer` (whether text prompts can be served)."""
    info = dict(core.model_info())
    info["has_tokenizer"] = getattr(core, "tokenizer", None) is not None
    return info


def add_request(
    core: Any, request_id: str, prompt: list[int], params: dict[str, Any], arrival: float
) -> list[Any] | None:
    """Hand one ADD message's request to `core`.

    Returns:
        None when it was queued, else the refusal as [request_id, code, field, message] (the
        ADD_ERROR message's fields).
    """
    try:
        core.add_request(request_id, prompt, SamplingParams(**params), arrival)
    except RequestError as exc:
        return [request_id, str(exc.code), exc.field, exc.message]
    except (ValueError, TypeError) as exc:
        return [request_id, "INVALID_ARGUMENT", "request", str(exc)]
    return None


class CoreLoop:
    """Runs one EngineCore: drains inputs, steps while there is work, pushes outputs.

    Args:
        core: an EngineCore (or a test double with the same methods).
        config: the engine config.
        inputs: the bound PULL socket.
        outputs: the connected PUSH socket.
    """

    def __init__(
        self, core: Any, config: EngineConfig, inputs: zmq.Socket, outputs: zmq.Socket
    ) -> None:
        self.core = core
        self.config = config
        self.inputs = inputs
        self.outputs = outputs
        self.running = True
        self._poller = zmq.Poller()
        self._poller.register(inputs, zmq.POLLIN)

    def run(self) -> None:
        """Loop until SHUTDOWN."""
        while self.running:
            busy = self.core.has_unfinished_requests()
            if self._poller.poll(0 if busy else _IDLE_POLL_MS):
                self._drain_inputs()
            if self.running and self.core.has_unfinished_requests():
                self._send_outputs(self.core.step())

    def _drain_inputs(self) -> None:
        while self.running:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.handle(unpack(frame))

    def handle(self, message: list[Any]) -> None:
        """Act on one input message."""
        kind = message[0]
        if kind == "ADD":
            self._add(*message[1:])
        elif kind == "ABORT":
            self._send_outputs(self.core.abort_requests(list(message[1])))
        elif kind == "STATS":
            self._send(["REPLY", message[1], self.core.get_stats()])
        elif kind == "EXPERT_LOAD":
            self._send(["REPLY", message[1], self.core.get_expert_load()])
        elif kind == "INFO":
            self._send(["REPLY", message[1], model_info_of(self.core)])
        elif kind == "SHUTDOWN":
            self.running = False
        else:
            logger.error("engine core: unknown message kind %r ignored", kind)

    def _add(
        self,
        request_id: str,
        prompt: list[int],
        params: dict[str, Any],
        arrival: float,
        rank: int = 0,
    ) -> None:
        refusal = add_request(self.core, request_id, prompt, params, arrival)
        if refusal is not None:
            self._send(["ADD_ERROR", *refusal])

    def _send_outputs(self, outputs: list[RequestOutput]) -> None:
        if outputs:
            self._send(["OUTPUTS", [encode_output(o) for o in outputs]])

    def _send(self, message: list[Any]) -> None:
        self.outputs.send(pack(message))


def watch_parent(parent_pid: int) -> None:
    """End this process (status 1) as soon as its parent is gone."""
    while True:
        time.sleep(_PARENT_CHECK_S)
        if os.getppid() != parent_pid:
            os._exit(1)


def run_engine_core(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    core_factory: str = DEFAULT_CORE_FACTORY,
    log_level: int = logging.INFO,
) -> None:
    """The child process's entry point: build the core, report READY, run the loop.

    A failure while building the core is reported as STARTUP_FAILED (type, message, traceback)
    and ends the process with status 1; a failure in the loop is reported as FATAL.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [core] %(message)s")
    if config.parallel.num_threads is None:  # leave a core to the gRPC front end
        threads = default_threads(reserve_front_end=True)
        config = dataclasses.replace(
            config, parallel=dataclasses.replace(config.parallel, num_threads=threads)
        )
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    # tqdm's default lock is a multiprocessing RLock: a named semaphore that the resource
    # tracker reports as leaked when this process exits through os._exit. One process, one
    # progress bar at a time: a thread lock is enough.
    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # SIGTERM to the whole group (timeout, systemd, kill -- -PGID) must drain, not kill the
    # core under running requests: the front end drains, then tells the core to stop.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PULL)
    inputs.bind(input_addr)
    outputs = ctx.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.setsockopt(zmq.LINGER, _LINGER_MS)
    outputs.connect(output_addr)
    status = 0
    try:
        status = _build_and_run(config, core_factory, inputs, outputs)
    finally:
        inputs.close(linger=0)
        outputs.close()
        ctx.term()
    sys.exit(status)


def _build_and_run(
    config: EngineConfig, core_factory: str, inputs: zmq.Socket, outputs: zmq.Socket
) -> int:
    try:
        core = resolve_core_factory(core_factory)(config)
        info = model_info_of(core)
    except BaseException as exc:  # noqa: BLE001 - every startup failure goes to the parent
        outputs.send(pack(["STARTUP_FAILED", type(exc).__name__, str(exc), _tb()]))
        return 1
    outputs.send(pack(["READY", _plain(info)]))
    try:
        CoreLoop(core, config, inputs, outputs).run()
    except BaseException as exc:  # noqa: BLE001 - report, then exit non-zero
        logger.exception("engine core loop failed")
        outputs.send(pack(["FATAL", f"{type(exc).__name__}: {exc}", _tb()]))
        return 1
    finally:
        close = getattr(core, "close", None)
        if close is not None:
            close()
    return 0


def _plain(info: dict[str, Any]) -> dict[str, Any]:
    """Model info with values msgpack can carry (dtypes and the like become strings)."""
    plain = {}
    for key, value in info.items():
        ok = isinstance(value, (int, float, str, bool, type(None), list, tuple))
        plain[key] = value if ok else str(value)
    return plain


def _tb() -> str:
    return traceback.format_exc()


def params_to_dict(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as the dict the ADD message carries."""
    return dataclasses.asdict(params)
