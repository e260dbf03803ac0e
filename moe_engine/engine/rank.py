"""One rank of an expert-parallel engine: its EngineCore stepped in lockstep with the others.

Each rank is a process started by torch's elastic launcher (`moe_engine.engine.launcher`), with
RANK / WORLD_SIZE / LOCAL_WORLD_SIZE / MASTER_ADDR / MASTER_PORT in its environment. It owns
its requests, scheduler, KV cache and a model replica that holds only its experts (DESIGN.md
sections 1 and 6). Rank 0 also owns the two ZeroMQ sockets of the front end (the same message
protocol as `core_proc`, with the ADD message naming its target rank).

One iteration of the loop, on every rank:

1. rank 0 drains the front end's messages (waiting up to `IDLE_POLL_S` when no rank has work)
   and broadcasts them with the decision whether to step (`broadcast_object_list`);
2. every rank applies them: ADDs addressed to it, every ABORT (unknown ids are ignored), the
   queries (STATS, EXPERT_LOAD, INFO), SHUTDOWN;
3. if the decision was to step, every rank runs exactly one forward pass (a zero-token one when
   it has nothing scheduled), so each MoE layer's dispatch and combine has all participants;
4. every rank reports its outputs, refusals, query answers and whether it has work left to
   rank 0 (`gather_object`), which forwards them to the front end.

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
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import zmq
from tqdm import tqdm

from moe_engine.config import EngineConfig, default_threads
from moe_engine.engine import core_proc
from moe_engine.request import RequestOutput

logger = logging.getLogger(__name__)

#: How long rank 0 waits for front-end messages when no rank has work (seconds).
IDLE_POLL_S = 0.05
#: How long loading the model may take on the slowest rank before startup fails (seconds).
STARTUP_TIMEOUT_S = 900.0
#: How long rank 0 waits for each rank at the monitored barrier that names dead ranks (seconds).
HEALTH_CHECK_S = 3.0


@dataclass
class RankReport:
    """What one rank tells rank 0 after an iteration (pickled by `gather_object`)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    add_errors: list[list[Any]] = field(default_factory=list)
    replies: dict[int, Any] = field(default_factory=dict)
    busy: bool = False
    step: Any = None  # this rank's StepRecord when an expert trace is written


def merge_stats(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One stats dict for the whole engine: numbers summed over ranks, plus `per_rank`.

    Args:
        per_rank: each rank's `EngineCore.get_stats()`, in rank order.
    """
    merged: dict[str, Any] = {}
    for stats in per_rank:
        for key, value in stats.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                merged[key] = merged.get(key, 0) + value
    groups = [s.get("kv_groups") for s in per_rank]
    if groups[0] is not None and all(g is not None and len(g) == len(groups[0]) for g in groups):
        merged["kv_groups"] = [
            {**group, "blocks_used": sum(g[i]["blocks_used"] for g in groups)}
            for i, group in enumerate(groups[0])
        ]
    merged["ep_size"] = len(per_rank)
    merged["per_rank"] = per_rank
    return merged


def merge_expert_load(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Routing counts of all ranks: each rank counted the routing of its own tokens, so the
    engine's counts are the sum; the summaries are recomputed on the sum."""
    from moe_engine.instrumentation import balancedness, imbalance_ratio

    def total(key: str) -> torch.Tensor:
        return torch.tensor([r[key] for r in per_rank], dtype=torch.int64).sum(dim=0)

    counts = total("counts")
    merged = dict(per_rank[0])
    merged.update(
        counts=counts.tolist(),
        window_counts=total("window_counts").tolist(),
        imbalance_ratio=imbalance_ratio(counts).tolist(),
        balancedness=balancedness(counts).tolist(),
    )
    if all("rank_tokens" in r for r in per_rank):
        # each rank filled its own column (token-expert pairs its experts processed)
        rank_tokens = total("rank_tokens")
        merged.update(
            rank_tokens=rank_tokens.tolist(),
            rank_imbalance_ratio=imbalance_ratio(rank_tokens).tolist(),
            rank_balancedness=balancedness(rank_tokens).tolist(),
        )
    return merged


class LockstepLoop:
    """The per-rank loop described in the module docstring.

    Args:
        core: this rank's EngineCore (built with a `RankContext`).
        rank, world_size: this rank and the number of ranks.
        group: the control process group (gloo).
        health_group: a group used only to find unresponsive ranks after a failure.
        inputs, outputs: rank 0's ZeroMQ sockets (None on the other ranks).
        trace: rank 0's expert-trace writer (`PeriodicTraceWriter`), None otherwise.
        tracing: whether an expert trace is written (every rank then reports its step).
    """

    def __init__(
        self,
        core: Any,
        rank: int,
        world_size: int,
        group: Any,
        health_group: Any,
        inputs: zmq.Socket | None = None,
        outputs: zmq.Socket | None = None,
        trace: Any = None,
        tracing: bool = False,
    ) -> None:
        self.core = core
        self.trace, self.tracing = trace, tracing
        self.rank, self.world_size = rank, world_size
        self.group, self.health_group = group, health_group
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
            stop = False
            for message in messages:
                stop |= self._apply(message, report)
            if stop:
                return
            if do_step:
                report.outputs.extend(self.core.step())
                if self.tracing:
                    report.step = self.core.last_step
            report.busy = self.core.has_unfinished_requests()
            gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(report, gathered, dst=0, group=self.group)
            if gathered is not None:
                self._forward(messages, gathered)

    # ------------------------------------------------------------------ rank 0

    def _collect(self) -> tuple[list[list[Any]], bool]:
        """Rank 0: the front end's pending messages and whether this iteration steps."""
        assert self.inputs is not None and self._poller is not None
        messages: list[list[Any]] = []
        if not self._busy:
            self._poller.poll(IDLE_POLL_S * 1000)
        while True:
            try:
                messages.append(core_proc.unpack(self.inputs.recv(zmq.NOBLOCK)))
            except zmq.Again:
                break
        do_step = self._busy or any(m[0] == "ADD" for m in messages)
        return messages, do_step

    def _forward(self, messages: list[list[Any]], reports: list[RankReport]) -> None:
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
        outputs = [core_proc.encode_output(o) for r in reports for o in r.outputs]
        if outputs:
            self._send(["OUTPUTS", outputs])
        for r in reports:
            for error in r.add_errors:
                self._send(["ADD_ERROR", *error])
        for message in messages:
            kind = message[0]
            if kind not in ("STATS", "EXPERT_LOAD", "INFO"):
                continue
            answers = [r.replies[message[1]] for r in reports]
            if kind == "STATS":
                answer = merge_stats(answers)
            elif kind == "EXPERT_LOAD":
                answer = merge_expert_load(answers)
            else:
                answer = dict(answers[0])
                answer["experts_per_rank"] = [a["local_experts"] for a in answers]
                answer["rank_pids"] = [a["pid"] for a in answers]
            self._send(["REPLY", message[1], core_proc._plain(answer)])

    def _send(self, message: list[Any]) -> None:
        assert self.outputs is not None
        self.outputs.send(core_proc.pack(message))

    # ------------------------------------------------------------------ every rank

    def _apply(self, message: list[Any], report: RankReport) -> bool:
        """Act on one front-end message; True for SHUTDOWN."""
        kind = message[0]
        if kind == "ADD":
            request_id, prompt, params, arrival, target = message[1:6]
            if target == self.rank:
                self._add(request_id, prompt, params, arrival, report)
        elif kind == "ABORT":
            report.outputs.extend(self.core.abort_requests(list(message[1])))
        elif kind == "STATS":
            report.replies[message[1]] = self._stats()
        elif kind == "EXPERT_LOAD":
            report.replies[message[1]] = self.core.get_expert_load()
        elif kind == "INFO":
            info = core_proc.model_info_of(self.core)
            info["pid"] = os.getpid()
            report.replies[message[1]] = info
        elif kind == "SHUTDOWN":
            return True
        else:
            logger.error("rank %d: unknown message kind %r ignored", self.rank, kind)
        return False

    def _stats(self) -> dict[str, Any]:
        stats = dict(self.core.get_stats())
        stats["rank"] = self.rank
        return stats

    def _add(
        self,
        request_id: str,
        prompt: list[int],
        params: dict[str, Any],
        arrival: float,
        report: RankReport,
    ) -> None:
        refusal = core_proc.add_request(self.core, request_id, prompt, params, arrival)
        if refusal is not None:
            report.add_errors.append(refusal)

    def unresponsive_ranks(self, rank_pids: list[int]) -> str:
        """After a failed collective: which ranks no longer answer, as text for the error.

        Ranks on this node are checked by pid (gone, zombie or stopped); otherwise a monitored
        barrier on the health group names the ranks that do not reach it.
        """
        deadline = time.monotonic() + HEALTH_CHECK_S  # a killed peer may still be exiting
        while rank_pids:
            found = [
                f"rank {rank} (pid {pid}) {state}"
                for rank, pid in enumerate(rank_pids)
                if rank != self.rank and (state := process_state(pid)) is not None
            ]
            if found:
                return "; ".join(found)
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        try:
            dist.monitored_barrier(
                group=self.health_group,
                timeout=timedelta(seconds=HEALTH_CHECK_S),
                wait_all_ranks=True,
            )
        except Exception as exc:  # noqa: BLE001 - the barrier's message names the ranks
            return str(exc).strip().splitlines()[0]
        return "all ranks still answer"


def process_state(pid: int) -> str | None:
    """"is gone", "is a zombie" or "is stopped" for a local process in that state, else None
    (running, or not on this node)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one short read
    except FileNotFoundError:
        return "is gone"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"Z": "is a zombie (it died)", "X": "is gone", "T": "is stopped"}.get(state)


def rank_threads(config: EngineConfig, local_world_size: int) -> int:
    """Intra-op threads of one rank: the configured number, else this node's cores (less one
    for the front end) shared among its ranks, at least 1."""
    if config.parallel.num_threads is not None:
        return config.parallel.num_threads
    return max(1, default_threads(reserve_front_end=True) // max(1, local_world_size))


def run_rank(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    core_factory: str = core_proc.DEFAULT_CORE_FACTORY,
    log_level: int = logging.INFO,
) -> None:
    """A rank process's entry point (called by the elastic agent in each worker).

    Joins the process groups, builds this rank's EngineCore (its experts only), reports READY
    (rank 0, once every rank is built) or STARTUP_FAILED naming the rank that failed, then runs
    `LockstepLoop`. Exits 0 after SHUTDOWN, 1 after any failure.
    """
    from comm import ExpertPlacement, make_communicator

    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    logging.basicConfig(
        level=log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(message)s"
    )
    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when ranks stop
    threading.Thread(target=core_proc.watch_parent, args=(os.getppid(),), daemon=True).start()
    threads = rank_threads(config, local_world)
    config = dataclasses.replace(
        config, parallel=dataclasses.replace(config.parallel, num_threads=threads)
    )
    timeout = timedelta(seconds=config.parallel.collective_timeout_s)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=timeout)
    health = dist.new_group(backend="gloo", timeout=timeout)
    startup = dist.new_group(backend="gloo", timeout=timedelta(seconds=STARTUP_TIMEOUT_S))

    inputs = outputs = ctx = None
    if rank == 0:
        ctx = zmq.Context()
        inputs = ctx.socket(zmq.PULL)
        inputs.bind(input_addr)
        outputs = ctx.socket(zmq.PUSH)
        outputs.setsockopt(zmq.SNDHWM, 0)
        outputs.setsockopt(zmq.LINGER, 5000)
        outputs.connect(output_addr)

    def send(message: list[Any]) -> None:
        if outputs is not None:
            outputs.send(core_proc.pack(message))

    status = 1
    trace = None
    try:
        core, error = None, None
        try:
            from moe_engine.engine.core import RankContext
            from moe_engine.plan import ModelShape

            num_experts = ModelShape.from_hf_config(config.model.hf_config()).num_experts
            if config.parallel.expert_placement:
                placement = ExpertPlacement.load(config.parallel.expert_placement)
                placement.check(num_experts, world_size)
            else:
                placement = ExpertPlacement.contiguous(num_experts, world_size)
            communicator = make_communicator(dist.group.WORLD, placement)
            context = RankContext(rank, world_size, list(placement.slots[rank]), communicator)
            core = core_proc.resolve_core_factory(core_factory)(config, context)
        except BaseException as exc:  # noqa: BLE001 - every startup failure goes to rank 0
            logger.exception("rank %d failed to start", rank)
            error = f"rank {rank}: {type(exc).__name__}: {exc}"
        mine = (error, None if core is None else core.rank_context.local_experts, os.getpid())
        everyone: list[Any] = [None] * world_size
        dist.all_gather_object(everyone, mine, group=startup)
        failed = [e for e, _, _ in everyone if e is not None]
        if failed:
            send(["STARTUP_FAILED", "StartupError", "; ".join(failed), ""])
            return
        info = core_proc.model_info_of(core)
        info["experts_per_rank"] = [experts for _, experts, _ in everyone]
        pids = [pid for _, _, pid in everyone]
        local = local_world == world_size  # every rank on this node: pids are meaningful
        info["rank_pids"] = pids
        send(["READY", core_proc._plain(info)])
        if rank == 0 and config.expert_trace:
            from moe_engine.skew.trace import PeriodicTraceWriter

            spec = core.spec
            trace = PeriodicTraceWriter(
                config.expert_trace,
                sorted(spec.moe_layers),
                spec.num_experts,
                ep_size=world_size,
                meta=dict(
                    model=config.model.model, top_k=spec.top_k, placement=placement.to_dict()
                ),
            )
        loop = LockstepLoop(
            core,
            rank,
            world_size,
            control,
            health,
            inputs,
            outputs,
            trace=trace,
            tracing=bool(config.expert_trace),
        )
        try:
            loop.run()
            status = 0
        except Exception as exc:  # noqa: BLE001 - a collective failed: report and exit
            logger.exception("rank %d: step loop failed: %s", rank, exc)
            if rank == 0:
                who = loop.unresponsive_ranks(pids if local else [])
                send(["FATAL", f"expert-parallel step failed ({who}): {exc}", ""])
    finally:
        if trace is not None:
            trace.close()
        if rank == 0 and ctx is not None:
            inputs.close(linger=0)
            outputs.close()
            ctx.term()
        if status == 0:
            dist.destroy_process_group()
        sys.stdout.flush()
        if status != 0:
            os._exit(status)  # do not wait on collectives of dead peers
