"""EngineClient: the front end's handle on the engine core process (asyncio).

`start` spawns the core process (`core_proc.run_engine_core`, multiprocessing spawn) and waits
until it reports the model loaded, keeping what it reports meanwhile in `startup_status`;
`generate` streams one request's outputs; `abort`, `get_stats` and `model_info` serve the other
RPCs, and `control` the RL rollout ones (pause, resume, weight updates: `control.py`).
Requests are validated here first (the limits come with Ready), so most bad requests never
reach the step loop. The messages are the typed structs of `messages.py`. From the start a
heartbeat goes out every second on a socket of its own, so that a core whose front end is gone
or hangs exits by itself (`monitor.py`).

Each live request has an asyncio.Queue fed by one background task that reads the core's output
socket. When the consumer of `generate` stops early (cancelled, closed, deadline), the request is
aborted in the core, which frees its KV blocks before its next step.
"""

from __future__ import annotations

import asyncio
import atexit
import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from moe_engine.core.outputs import EngineCoreOutput, EngineStats, ExpertLoad, ModelInfo
from moe_engine.core.tokenizer import load_tokenizer
from moe_engine.core.validation import validate_request
from moe_engine.engine import core_proc
from moe_engine.engine.messages import (
    AbortRequests,
    AddError,
    CoreInput,
    CoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExpertLoadReply,
    Fatal,
    GetExpertLoad,
    GetModelInfo,
    GetStats,
    Heartbeat,
    ModelInfoReply,
    PrepareDecode,
    PrepareDecodeReply,
    Ready,
    Shutdown,
    StartupFailed,
    StartupProgress,
    StatsReply,
    decode_output,
    encode,
)
from moe_engine.engine.monitor import FRONTEND_TIMEOUT_S, HEARTBEAT_INTERVAL_S
from moe_engine.engine.status import StartupStatus
from moe_engine.errors import ErrorCode, RequestError, StartupError
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import EngineConfig
from moe_engine.weight_update.messages import ControlInput, ControlReply

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


class EngineClient:
    """Talks to one engine core process over ZeroMQ (DESIGN.md section 9).

    Attributes:
        model_info: the core's ModelInfo (set by `start` once the core is ready, else None).
        startup_status: what the starting core last said it does (`describe()` for text).
        tokenizer: the checkpoint's tokenizer in this process, or None.
        dead: set when the core process has exited or failed.
    """

    def __init__(self) -> None:
        self.model_info: ModelInfo | None = None
        self.startup_status = StartupStatus()
        self.tokenizer: Any | None = None
        self.dead = asyncio.Event()
        self.death_reason: str | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._aborting: set[str] = set()
        self._replies: dict[int, asyncio.Future] = {}
        self._rank_load: list[int] = [0]
        self._rank_of: dict[str, int] = {}
        #: Decode instance: request_id -> (the rank PrepareDecode parked it on, when the core
        #: drops it unless its K/V came: time.monotonic() seconds).
        self._parked: dict[str, tuple[int, float]] = {}
        self._parked_timeout_s = 30.0
        self._reply_ids = itertools.count()
        #: Whether the core was paused at its last control reply (`PauseGeneration`).
        self.paused = False
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
        check_ep_size(config)
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
        tokenizer = asyncio.create_task(asyncio.to_thread(load_tokenizer, config.model.model))
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

    @property
    def num_live_requests(self) -> int:
        """Requests whose streams are open in this front end."""
        return len(self._streams)

    # ----------------------------------------------------------------- requests

    def encode(self, text: str) -> list[int]:
        """Tokenise a text prompt.

        Raises:
            RequestError: INVALID_ARGUMENT ("text") when the checkpoint has no tokenizer.
        """
        if self.tokenizer is None:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "text",
                "text: this model has no tokenizer; send the prompt as prompt_ids",
            )
        return list(self.tokenizer.encode(text))

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        *,
        kv_placement: bytes | None = None,
        remote_first_token: int | None = None,
        remote_first_logprobs: tuple[float, dict[int, float]] | None = None,
    ) -> AsyncIterator[EngineCoreOutput]:
        """Submit one request and yield its outputs (deltas) until the finished one (with
        `params.n` > 1: until each of its n completions has sent its finished output; every
        output's `index` names its completion).

        Args:
            request_id: unique among live requests.
            prompt_token_ids: the prompt, token ids in [0, vocab_size).
            params: sampling parameters.
            arrival_time: when the request arrived (time.time() seconds; default now).
            kv_placement, remote_first_token, remote_first_logprobs: a prefill/decode
                split's fields (`EngineCoreRequest`; the router sets them).

        Raises:
            RequestError: the request is refused (bad field, out of range, duplicate live id,
                queue full) or the engine is down (UNAVAILABLE).

        If the caller stops iterating before the finished output (cancellation, `aclose`), the
        request is aborted in the core.
        """
        self._check_alive()
        info = self.model_info
        if info is None:
            raise RequestError(
                ErrorCode.UNAVAILABLE, "engine",
                f"engine unavailable: {self.startup_status.describe()}",
            )
        if request_id in self._streams:
            raise RequestError(
                ErrorCode.ALREADY_EXISTS,
                "request_id",
                f"request_id: {request_id!r} is already in use by a live request",
            )
        validate_request(
            prompt_token_ids,
            params,
            vocab_size=info.vocab_size,
            max_model_len=info.max_model_len,
        )
        if params.stop and self.tokenizer is None:
            raise RequestError(
                ErrorCode.INVALID_ARGUMENT,
                "stop",
                "stop: this model has no tokenizer, so stop strings cannot be matched; use "
                "stop_token_ids",
            )
        queue: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = queue
        arrival = time.time() if arrival_time is None else arrival_time
        rank = self._parked.pop(request_id, (None, 0.0))[0] if remote_first_token is not None \
            else None  # a parked request continues on the rank that holds its blocks
        if rank is not None:
            self._rank_load[rank] -= 1
        else:
            rank = self._least_loaded_rank()
        add = EngineCoreRequest(request_id, list(prompt_token_ids), params, arrival, rank,
                                kv_placement, remote_first_token, remote_first_logprobs)
        try:
            self._send(add)
        except RequestError:
            del self._streams[request_id]
            raise
        self._rank_load[rank] += params.n  # each completion is a request of that rank
        self._rank_of[request_id] = rank
        remaining = params.n
        try:
            while remaining:
                item = await queue.get()
                if isinstance(item, BaseException):
                    remaining = 0
                    raise item
                remaining -= item.finished
                yield item
        finally:
            if self._streams.get(request_id) is queue:
                del self._streams[request_id]
                self._rank_load[self._rank_of.pop(request_id)] -= params.n
            self._aborting.discard(request_id)
            if remaining:
                self._try_send(AbortRequests([request_id]))

    async def abort(self, request_id: str) -> bool:
        """Abort a live request; its stream ends with finish_reason ABORT.

        Returns:
            True when the request was live (and not already being aborted); False otherwise,
            so repeated aborts are harmless.
        """
        if request_id not in self._streams or request_id in self._aborting:
            return False
        self._aborting.add(request_id)
        self._try_send(AbortRequests([request_id]))
        return True

    def abort_parked(self, request_id: str) -> bool:
        """Decode instance: abort a request PrepareDecode parked (no stream yet), so its
        blocks are freed now rather than after the transfer timeout; False when none is."""
        entry = self._parked.pop(request_id, None)
        if entry is None:
            return False
        self._rank_load[entry[0]] -= 1
        self._try_send(AbortRequests([request_id]))
        return True

    async def get_stats(self, timeout_s: float = 30.0) -> EngineStats:
        """The engine's stats (summed over ranks, and per rank), read after the step in
        progress.

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(GetStats, timeout_s)
        assert isinstance(reply, StatsReply)
        return reply.stats

    async def get_expert_load(self, timeout_s: float = 30.0) -> ExpertLoad:
        """Token-expert counts per MoE layer and expert (summed over ranks), with summaries.

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(GetExpertLoad, timeout_s)
        assert isinstance(reply, ExpertLoadReply)
        return reply.load

    async def get_model_info(self, timeout_s: float = 30.0) -> ModelInfo:
        """The model info asked afresh (under expert parallelism: every rank's experts and pid).

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(GetModelInfo, timeout_s)
        assert isinstance(reply, ModelInfoReply)
        return reply.info

    async def control(
        self, make: Callable[[int], ControlInput], timeout_s: float
    ) -> ControlReply:
        """Send one RL control message and wait for its answer (`control.py`: pause, resume,
        join or leave a weight-update group, new weights).

        Args:
            make: builds the message from its reply id, e.g.
                `lambda rid: UpdateWeights(rid, "step-3", "disk", path=...)`.
            timeout_s: how long to wait for the answer (seconds); an update may take minutes.
                When it passes the core still finishes what it started (the answer is dropped).

        Returns:
            The core's reply; a refusal has `code` set (with `field` and `message`), and the
            caller reports it. `model_info.weight_version` follows every reply's version.

        Raises:
            RequestError: UNAVAILABLE when the core is down or does not answer in time.
        """
        reply = await self._request_reply(make, timeout_s)
        assert isinstance(reply, ControlReply)
        self.paused = reply.paused
        info = self.model_info
        if info is not None and reply.weight_version and (
            reply.weight_version != info.weight_version
        ):
            self.model_info = msgspec.structs.replace(info, weight_version=reply.weight_version)
        return reply

    async def prepare_decode(self, request_id: str, prompt_token_ids: list[int],
                             params: SamplingParams, timeout_s: float = 30.0) -> bytes:
        """Decode instance: park a request with its prompt's blocks allocated; returns where
        its K/V goes (`disagg.handoff.KVPlacement`, msgpack) for the prefill instance.

        Raises:
            RequestError: the request is refused (a bad field; RESOURCE_EXHAUSTED when there
                is no room now; INVALID_ARGUMENT on an instance not in decode mode) or the
                core is down (UNAVAILABLE).
        """
        info = self.model_info
        if info is not None:
            validate_request(prompt_token_ids, params, vocab_size=info.vocab_size,
                             max_model_len=info.max_model_len)
        self._expire_parked()
        rank = self._least_loaded_rank()
        add = EngineCoreRequest(request_id, list(prompt_token_ids), params, time.time(), rank)
        # counted at once: concurrent PrepareDecodes spread over the ranks; the blocks are held
        # there until the request continues, is aborted or expires
        self._rank_load[rank] += 1
        try:
            reply = await self._request_reply(lambda rid: PrepareDecode(rid, add), timeout_s)
            assert isinstance(reply, PrepareDecodeReply)
            if reply.code:
                raise RequestError(ErrorCode(reply.code), reply.field, reply.message)
        except BaseException:
            self._rank_load[rank] -= 1
            raise
        self._parked[request_id] = (rank, time.monotonic() + self._parked_timeout_s)
        return reply.placement

    def _least_loaded_rank(self) -> int:
        return min(range(len(self._rank_load)), key=self._rank_load.__getitem__)

    def _expire_parked(self) -> None:
        """Forget parked requests the core has dropped by now (their K/V never came)."""
        now = time.monotonic()
        for rid in [r for r, (_, t) in self._parked.items() if t < now]:
            self._rank_load[self._parked.pop(rid)[0]] -= 1

    async def _request_reply(self, make: Callable[[int], CoreInput], timeout_s: float) -> Any:
        """Send `make(reply_id)` and wait up to `timeout_s` for the reply with that id.

        Raises:
            RequestError: UNAVAILABLE when the core is down, unreachable or silent too long.
        """
        self._check_alive()
        reply_id = next(self._reply_ids)
        message = make(reply_id)
        future = asyncio.get_running_loop().create_future()
        self._replies[reply_id] = future
        try:
            self._send(message)
            return await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise RequestError(
                ErrorCode.UNAVAILABLE, "engine",
                f"engine core did not answer {type(message).__name__} within {timeout_s:.0f} s",
            ) from None
        finally:
            self._replies.pop(reply_id, None)

    # ----------------------------------------------------------------- plumbing

    def _check_alive(self) -> None:
        if self.dead.is_set():
            raise RequestError(
                ErrorCode.UNAVAILABLE, "engine", f"engine unavailable: {self.death_reason}"
            )

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

    def _try_send(self, message: CoreInput) -> None:
        """Best-effort send (aborts and shutdown), never raising."""
        try:
            self._send(message)
        except RequestError as exc:
            logger.debug("dropped %s: %s", type(message).__name__, exc.message)

    async def _read_outputs(self) -> None:
        assert self._out_sock is not None
        while True:
            frame = await self._out_sock.recv()
            try:
                self._dispatch(decode_output(frame))
            except Exception:
                logger.exception("bad message from the engine core (%d bytes)", len(frame))

    def _dispatch(self, message: CoreOutput) -> None:
        match message:
            case EngineCoreOutputs(outputs=outputs):
                for out in outputs:
                    queue = self._streams.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
            case AddError(request_id=rid, code=code, field=field, message=text):
                queue = self._streams.get(rid)
                if queue is not None:
                    queue.put_nowait(RequestError(code, field, text))
            case (StatsReply() | ExpertLoadReply() | ModelInfoReply() | ControlReply()
                  | PrepareDecodeReply()):
                future = self._replies.get(message.reply_id)
                if future is not None and not future.done():
                    future.set_result(message)
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
        error = RequestError(ErrorCode.UNAVAILABLE, "engine", f"engine unavailable: {reason}")
        for queue in self._streams.values():
            queue.put_nowait(error)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)


def check_ep_size(config: EngineConfig) -> None:
    """Fail fast, before any rank starts, on an ep_size the checkpoint's experts cannot split
    or a placement file that does not fit it.

    Raises:
        StartupError: ep_size larger than num_experts, or not dividing it (without a placement
            file), naming both numbers; a placement file that is missing, malformed or made
            for another model or ep size, or given with ep_size 1.
    """
    from moe_engine.models import model_shape

    ep_size = config.parallel.ep_size
    placement = config.parallel.expert_placement
    if ep_size == 1 and placement is None:
        return
    num_experts = model_shape(config.model.hf_config()).num_experts
    if placement is not None:
        if ep_size == 1:
            raise StartupError(
                f"--expert-placement {placement}: a placement spreads experts over ranks; it "
                f"needs --ep-size > 1"
            )
        from comm import ExpertPlacement

        try:
            ExpertPlacement.load(placement).check(num_experts, ep_size)
        except (OSError, ValueError) as exc:
            raise StartupError(f"--expert-placement {placement}: {exc}") from exc
        return
    if ep_size > num_experts:
        raise StartupError(
            f"--ep-size {ep_size} is more ranks than the model's {num_experts} experts "
            f"(num_experts {num_experts}); use at most {num_experts}"
        )
    if num_experts % ep_size and config.parallel.expert_placement is None:
        raise StartupError(
            f"--ep-size {ep_size} does not divide num_experts {num_experts}; choose an "
            f"ep_size that divides {num_experts}"
        )
