"""One rank of an expert-parallel engine: its EngineCore stepped in lockstep with the others.

Each rank is a process started by torch's elastic launcher (`moe_engine.engine.launcher`), with
RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment. It owns
its requests, scheduler, KV cache and a model replica that holds only its experts (DESIGN.md
sections 1 and 6). Rank 0 also owns the two ZeroMQ sockets of the front end (the typed messages
of `messages.py`, as `core_proc`, with each EngineCoreRequest naming its target rank). Every
rank on the front end's node watches its heartbeats (`monitor.FrontEndMonitor`) and exits when
the front end is gone or silent; rank 0's monitor also forwards StartupProgress.

One iteration of the loop, on every rank:

1. rank 0 drains the front end's messages (waiting up to `IDLE_POLL_S` when no rank has work)
   and broadcasts them with the decision whether to step (`broadcast_object_list`);
2. every rank applies them (`loop.apply`, the handler the single process uses too): requests
   addressed to it, every abort (unknown ids are ignored), the queries (stats, expert load,
   model info), control messages, shutdown;
3. if the decision was to step, every rank runs exactly one forward pass (a zero-token one when
   it has nothing scheduled), so each MoE layer's dispatch and combine has all participants;
   with --enable-eplb every rank's `EplbController` then takes the step's routing counts and,
   when it is time, decides a new placement, moves a chunk of expert weights or swaps them in
   (`moe_engine.eplb.controller`);
4. every rank reports its outputs, refusals, query answers and whether it has work left to
   rank 0 (`gather_object`), which forwards them to the front end (`loop.reply_for` merges the
   ranks' answers).

All collectives run under `ParallelConfig.collective_timeout_s`. A rank that dies or hangs makes
the others' collectives fail; rank 0 then names the ranks that no longer answer (a monitored
barrier on a group kept for that purpose), reports FATAL to the front end and exits non-zero,
and the launcher stops the remaining ranks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq
from tqdm import tqdm

from moe_engine.core.device import engine_device
from moe_engine.core.protocol import EngineCoreProtocol
from moe_engine.engine import core_proc, loop
from moe_engine.engine.messages import (
    CoreInput,
    CoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    Fatal,
    PrepareDecode,
    Ready,
    StartupFailed,
    decode_input,
    encode,
)
from moe_engine.engine.monitor import FRONTEND_TIMEOUT_S, FrontEndMonitor
from moe_engine.engine.netif import is_loopback, route_source_address
from moe_engine.engine.rank_groups import (
    MeshError,
    RankGroups,
    join_groups,
    unresponsive_ranks,
)
from moe_engine.engine.role import PlainRole, Role, role_for
from moe_engine.startup.config import EngineConfig
from moe_engine.startup.env import default_threads
from moe_engine.weight_update.messages import UpdateWeights

logger = logging.getLogger(__name__)

#: How long rank 0 waits for front-end messages when no rank has work (seconds).
IDLE_POLL_S = 0.05
#: How long loading the model may take on the slowest rank before startup fails (seconds).
STARTUP_TIMEOUT_S = 900.0


@dataclass
class RankReport(loop.Report):
    """What one rank tells rank 0 after an iteration (pickled by `gather_object`): the
    iteration's `loop.Report`, whether the rank has work left, and its step for the trace."""

    busy: bool = False
    step: Any = None  # this rank's StepRecord when an expert trace is written


class LockstepLoop:
    """The per-rank loop described in the module docstring.

    Args:
        core: this rank's EngineCore (built with a `RankContext`).
        rank, world_size: this rank and the number of ranks.
        group: the control process group (gloo).
        inputs, outputs: rank 0's ZeroMQ sockets (None on the other ranks).
        trace: rank 0's expert-trace writer (`PeriodicTraceWriter`), None otherwise.
        tracing: whether an expert trace is written (every rank then reports its step).
        role: this rank's part in a prefill/decode split (`role.role_for`, over its own KV
            cache and transfer engine); None: a plain instance (`role.PlainRole`).
        eplb: this rank's `eplb.controller.EplbController` (--enable-eplb), None when off:
            after every step, on every rank, it takes the step's routing counts and decides,
            moves a chunk of expert weights or swaps them in (its collectives raise like a
            step's when a rank is gone).
    """

    def __init__(
        self,
        core: EngineCoreProtocol,
        rank: int,
        world_size: int,
        group: Any,
        inputs: zmq.Socket | None = None,
        outputs: zmq.Socket | None = None,
        trace: Any = None,
        tracing: bool = False,
        role: Role | None = None,
        eplb: Any = None,
    ) -> None:
        self.core = core
        self.eplb = eplb
        self.role: Role = PlainRole(core) if role is None else role
        self.trace, self.tracing = trace, tracing
        self.rank, self.world_size = rank, world_size
        self.group = group
        self.inputs, self.outputs = inputs, outputs
        self._poller: zmq.Poller | None = None
        if inputs is not None:
            self._poller = zmq.Poller()
            self._poller.register(inputs, zmq.POLLIN)
        self._busy = False

    def run(self) -> None:
        """Iterate until SHUTDOWN. Raises whatever a collective raises (the caller reports)."""
        while True:
            box: list[Any] = [self._collect() if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            messages, do_step = box[0]
            report = RankReport()
            if self.eplb is not None and any(isinstance(m, UpdateWeights) for m in messages):
                self.eplb.settle()  # staged expert copies would miss the new weights
            for message in messages:
                loop.apply(self.core, self.role, message, report, rank=self.rank,
                           agree=self._agree)
            if report.stop:
                return
            if do_step:
                loop.step(self.core, self.role, report)
                if self.eplb is not None:
                    last = self.core.last_step
                    self.eplb.after_step(last.counts, last.rank_tokens)
                if self.tracing:
                    report.step = self.core.last_step
            self.role.tick()
            report.busy = self.core.has_unfinished_requests()
            gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(report, gathered, dst=0, group=self.group)
            if gathered is not None:
                self._forward(messages, gathered)

    # ------------------------------------------------------------------ rank 0

    def _collect(self) -> tuple[list[CoreInput], bool]:
        """Rank 0: the front end's pending messages and whether this iteration steps."""
        assert self.inputs is not None and self._poller is not None
        messages: list[CoreInput] = []
        if not self._busy:
            self._poller.poll(IDLE_POLL_S * 1000)
        while True:
            try:
                frame = self.inputs.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                messages.append(decode_input(frame))
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                refusal = core_proc.refusal_of_frame(frame, exc)
                if refusal is None:
                    logger.error("rank 0: undecodable message ignored: %s", exc)
                else:
                    self._send(refusal)
        do_step = self._busy or any(isinstance(m, EngineCoreRequest) for m in messages)
        return messages, do_step

    def _forward(self, messages: list[CoreInput], reports: list[RankReport]) -> None:
        """Rank 0: send the iteration's outputs, refusals and query answers to the front end."""
        self._busy = any(r.busy for r in reports)
        steps = [r.step for r in reports if r.step is not None]
        if self.trace is not None and steps:
            self.trace.add_step(
                sum(s.counts for s in steps),
                max(s.step_time_s for s in steps),
                sum(s.num_tokens for s in steps),
                sum(s.rank_tokens for s in steps),
            )
            self.trace.maybe_flush()
        outputs = [o for r in reports for o in r.outputs]
        if outputs:
            self._send(EngineCoreOutputs(outputs))
        for r in reports:
            for error in r.add_errors:
                self._send(error)
        for message in messages:
            rid = getattr(message, "reply_id", None)
            if rid is None:
                continue
            # every rank answers a query; PrepareDecode only its target rank
            answers = [r.replies[rid] for r in reports if rid in r.replies]
            if answers or isinstance(message, PrepareDecode):
                self._send(loop.reply_for(message, answers))

    def _send(self, message: CoreOutput) -> None:
        assert self.outputs is not None
        self.outputs.send(encode(message))

    # ------------------------------------------------------------------ every rank

    def _agree(self, ok: bool) -> bool:
        """True when every rank is `ok` (an all-reduce MAX of a refusal flag on the control
        group): a weight update commits on all ranks or on none."""
        flag = torch.tensor([0 if ok else 1], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag.item()) == 0


def rank_threads(config: EngineConfig, local_world_size: int) -> int:
    """Intra-op threads of one rank: the configured number, else this node's cores shared
    among its ranks, at least 1."""
    if config.parallel.num_threads is not None:
        return config.parallel.num_threads
    return max(1, default_threads() // max(1, local_world_size))


def run_rank(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    core_factory: str = core_proc.DEFAULT_CORE_FACTORY,
    log_level: int = logging.INFO,
    heartbeat_addr: str | None = None,
    frontend_timeout_s: float = FRONTEND_TIMEOUT_S,
) -> None:
    """A rank process's entry point (called by the elastic agent in each worker).

    Joins the process groups, builds this rank's EngineCore (its experts only), reports Ready
    (rank 0, once every rank is built) or StartupFailed naming the rank that failed, then runs
    `LockstepLoop`. Exits 0 after Shutdown, 1 after any failure.

    Args:
        heartbeat_addr: the front end's heartbeat address (ranks on its node), or None (ranks
            of other nodes: rank 0's collectives tell them when the engine ends).
        frontend_timeout_s: how long this rank runs on without a heartbeat (seconds).
    """
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s"
    )
    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when ranks stop
    ctx = zmq.Context()
    monitor = FrontEndMonitor(
        ctx, f"rank {rank}", os.getppid(), heartbeat_addr,
        output_addr if rank == 0 else None, frontend_timeout_s,
    )
    monitor.start()
    threads = rank_threads(config, local_world)
    config = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, num_threads=threads)
    )
    device = engine_device(config).type  # moe-serve checked --device before starting ranks
    try:
        groups = join_groups(
            rank, world_size, device, config.parallel.collective_timeout_s, STARTUP_TIMEOUT_S,
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )
    except MeshError as exc:
        logger.error("%s", exc)
        if rank == 0:
            _send_once(ctx, output_addr, StartupFailed("MeshError", str(exc)))
        monitor.stop()
        os._exit(1)
    inputs = outputs = None
    if rank == 0:
        inputs = ctx.socket(zmq.PULL)
        inputs.bind(input_addr)
        outputs = ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.SNDHWM, 0)
        outputs.setsockopt(zmq.LINGER, 5000)
        outputs.connect(output_addr)
    status = 1
    try:
        status = _serve_rank(config, core_factory, rank, world_size, local_world, groups,
                             monitor, inputs, outputs)
    finally:
        monitor.stop()
        if inputs is not None and outputs is not None:
            inputs.close(linger=0)
            outputs.close()
        ctx.term()
        if status == 0:
            dist.destroy_process_group()
        sys.stdout.flush()
        if status != 0:
            os._exit(status)  # do not wait on collectives of dead peers


def _send_once(ctx: zmq.Context, address: str, message: CoreOutput) -> None:
    """Send one message to the front end's output socket (before the loop's socket exists)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(address)
    sock.send(encode(message))
    sock.close()


def _build_core(
    config: EngineConfig,
    core_factory: str,
    rank: int,
    world_size: int,
    progress: Any,
    device_group: Any,
) -> tuple[Any, Any]:
    """This rank's core (its experts only) and the expert placement."""
    from comm import make_communicator
    from moe_engine.eplb.placement import starting_placement
    from moe_engine.models import model_shape
    from moe_engine.startup.rank_context import RankContext

    num_experts = model_shape(config.model.hf_config()).num_experts
    placement = starting_placement(
        num_experts, world_size, config.eplb.num_redundant_experts,
        config.parallel.expert_placement,
    )
    device = engine_device(config).type
    communicator = make_communicator(
        device_group, placement, device=device, dtype=config.model.torch_dtype()
    )
    context = RankContext(rank, world_size, list(placement.slots[rank]), communicator)
    core = core_proc.resolve_core_factory(core_factory)(config, context, progress=progress)
    return core, placement


def _build_role(core: Any, config: EngineConfig, local: bool) -> Role:
    """This rank's role over its own KV cache (`PlainRole` without a split); a rank on another
    node than the front end registers its cache at the address that routes to the
    rendezvous host (unless the configured --kv-transfer-host is a loopback address)."""
    if config.disagg.mode == "none":
        return PlainRole(core)
    disagg = config.disagg
    if not local and not is_loopback(disagg.host):
        disagg = dataclasses.replace(
            disagg, host=route_source_address(os.environ.get("MASTER_ADDR", "127.0.0.1")))
    return role_for(core, disagg)


def _serve_rank(
    config: EngineConfig,
    core_factory: str,
    rank: int,
    world_size: int,
    local_world: int,
    groups: RankGroups,
    monitor: FrontEndMonitor,
    inputs: zmq.Socket | None,
    outputs: zmq.Socket | None,
) -> int:
    """Build, report, run `LockstepLoop`; the exit status (0 after Shutdown)."""

    def send(message: CoreOutput) -> None:
        if outputs is not None:
            outputs.send(encode(message))

    core, placement, error, role, eplb = None, None, None, None, None
    try:
        core, placement = _build_core(
            config, core_factory, rank, world_size, monitor.report, groups.device
        )
        role = _build_role(core, config, local=config.parallel.node_rank == 0)
        if config.eplb.enabled:
            from moe_engine.eplb.controller import build_controller

            eplb = build_controller(core, placement, rank, groups.control, groups.device)
    except BaseException as exc:  # noqa: BLE001 - every startup failure goes to rank 0
        logger.exception("rank %d failed to start", rank)
        error = f"rank {rank}: {type(exc).__name__}: {exc}"
    mine = (error, None if core is None else loop.model_info_of(core))
    everyone: list[Any] = [None] * world_size
    dist.all_gather_object(everyone, mine, group=groups.startup)
    failed = [e for e, _ in everyone if e is not None]
    if failed:
        send(StartupFailed("StartupError", "; ".join(failed)))
        return 1
    infos = [info for _, info in everyone]
    pids = [info.pid for info in infos]
    send(Ready(loop.merge_model_info(infos)))
    trace = None
    if rank == 0 and config.expert_trace:
        from moe_engine.skew.trace import PeriodicTraceWriter

        spec = core.spec
        trace = PeriodicTraceWriter(
            config.expert_trace,
            sorted(spec.moe_layers),
            spec.num_experts,
            ep_size=world_size,
            meta=dict(
                model=config.model.model, top_k=spec.top_k, placement=placement.to_dict(),
                **core.expert_load.layout_meta(),
            ),
        )
    lockstep = LockstepLoop(
        core, rank, world_size, groups.control, inputs, outputs,
        trace=trace, tracing=bool(config.expert_trace), role=role, eplb=eplb,
    )
    try:
        lockstep.run()
        return 0
    except Exception as exc:  # noqa: BLE001 - a collective failed: report and exit
        monitor.exit_if_silent("the step loop's collective failed")
        logger.exception("rank %d: step loop failed: %s", rank, exc)
        if rank == 0:
            local = local_world == world_size  # every rank on this node: pids are meaningful
            who = unresponsive_ranks(rank, pids if local else [], groups.health)
            send(Fatal(f"expert-parallel step failed ({who}): {exc}"))
        return 1
    finally:
        if trace is not None:
            trace.close()
        core.close()
