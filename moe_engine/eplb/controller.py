"""`EplbController`: when the experts move, driven from the lockstep loop of every rank.

After every forward step (`engine.rank.LockstepLoop`: every rank steps in the same iteration),
every rank calls `after_step` with its step's routing counts. The controller

1. keeps a window of the last `window_steps` steps' counts on the device: the token-expert
   pairs this rank routed per (MoE layer, expert), and the pairs its own experts processed
   per (MoE layer, rank) (`StepRecord.counts`, `.rank_tokens`: what the
   `ExpertLoadRecorder` takes once per step; the controller reads those and takes nothing
   itself, so the trace and `GetExpertLoad` see what they saw before);
2. every `step_interval` steps, all-reduces (SUM) the window over the control group (gloo), so
   every rank holds the same integer global load, and decides from it (`policy.decide`, a
   deterministic function of that load and the placement served now); rank 0's decision is
   then sent to all (one more all-reduce), so the ranks move to one placement even if floating
   point differed between nodes (a rank whose own plan differed logs it);
3. on a decision to move: `mover.begin(old, new)` in that iteration, one `mover.step()` in each
   following iteration until it returns True, then `mover.commit()` in that same iteration
   (the new placement serves from the next step on); meanwhile no new decision is taken;
4. `window_steps` steps after a commit, all-reduces the window again to measure the
   balancedness the new placement achieved (the ranks' processed pairs).

Every collective raises when a rank is gone; the loop's handling then ends the server naming
the rank (`engine.rank`), as for any step. Errors: see `after_step`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from comm import ExpertPlacement
from moe_engine.core.eplb_stats import MAX_RECORDS, EplbStats, RebalanceRecord
from moe_engine.eplb.policy import Decision, decide, rank_balancedness
from moe_engine.startup.config import EplbConfig

logger = logging.getLogger(__name__)

#: `all_reduce(tensor, op)`: in place over every rank, op "sum" or "max" (torch.distributed's
#: on the control group in the engine; tests pass their own).
AllReduce = Callable[[torch.Tensor, str], None]


class Mover(Protocol):
    """What the controller needs of `moe_engine.eplb.mover.ExpertMover`."""

    @property
    def busy(self) -> bool: ...

    def begin(self, old: ExpertPlacement, new: ExpertPlacement) -> None: ...

    def step(self) -> bool: ...

    def commit(self) -> Any: ...


def dist_all_reduce(group: Any) -> AllReduce:
    """An `AllReduce` over `group` (torch.distributed; CPU tensors for gloo)."""
    import torch.distributed as dist

    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def all_reduce(tensor: torch.Tensor, op: str) -> None:
        dist.all_reduce(tensor, op=ops[op], group=group)

    return all_reduce


class EplbController:
    """Drives one rank's part of runtime EPLB (module docstring).

    Args:
        config: the EPLB settings (window_steps, step_interval, balancedness_threshold).
        placement: the placement served at startup (the same on every rank).
        mover: this rank's expert mover (`ExpertMover`), built on the same placement.
        num_moe_layers: L, rows of the counts; device: where the step counts live.
        all_reduce: the collective over every rank's controller (`dist_all_reduce`).
        rank: this rank (rank 0's decision is the one every rank follows).
        on_commit: called with the new placement after each commit, on every rank (the
            engine updates its rank context, so that GetModelInfo shows it).
        clock: seconds, for the decision's timing (`time.perf_counter`).
    """

    def __init__(
        self,
        config: EplbConfig,
        placement: ExpertPlacement,
        mover: Mover,
        num_moe_layers: int,
        all_reduce: AllReduce,
        rank: int = 0,
        device: torch.device | str = "cpu",
        on_commit: Callable[[ExpertPlacement], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.config, self.placement, self.mover, self.rank = config, placement, mover, rank
        self._all_reduce, self._on_commit, self._clock = all_reduce, on_commit, clock
        n, e = placement.ep_size, placement.num_experts
        #: [W, L, E + N] int64 ring: per step, the routed pairs per expert, then per rank.
        self._window = torch.zeros(config.window_steps, num_moe_layers, e + n,
                                   dtype=torch.int64, device=device)
        self.steps = 0
        self._pending: RebalanceRecord | None = None  # the move under way
        self._target: ExpertPlacement | None = None
        self._measure_at: int | None = None  # the step to measure the last rebalance at
        self.stats = EplbStats()

    @property
    def moving(self) -> bool:
        """Whether a transfer is under way (begun, not yet committed)."""
        return self._pending is not None

    def after_step(self, counts: torch.Tensor, rank_pairs: torch.Tensor | None) -> None:
        """Account one forward step; decide, move a chunk or commit when it is time.

        Call on every rank in the same iteration, after every step, with:

        Args:
            counts: [L, E] int64 token-expert pairs this rank routed in the step.
            rank_pairs: [L, N] int64 pairs this rank's experts processed in the step (its own
                column; the others 0), or None (then the window counts none).

        Raises:
            Whatever the collectives or the mover raise (a rank gone: the loop ends the
                server).
        """
        self.steps += 1
        row = self._window[self.steps % self.config.window_steps]
        e = self.placement.num_experts
        row[:, :e].copy_(counts)
        if rank_pairs is None:
            row[:, e:].zero_()
        else:
            row[:, e:].copy_(rank_pairs)
        measure = self._measure_at == self.steps
        decide_now = self._pending is None and self.steps % self.config.step_interval == 0
        if measure or decide_now:
            load, measured = self._global_window()
            if measure:
                self._record_measured(measured)
            if decide_now:
                self._decide(load, measured)
                return  # a move begun now takes its first chunk in the next step
        if self._pending is not None and self.mover.step():
            self._commit()

    def settle(self) -> None:
        """Finish a transfer under way at once (every rank, same iteration): before a weight
        update, whose new weights the staged copies would miss."""
        while self._pending is not None:
            if self.mover.step():
                self._commit()

    # ------------------------------------------------------------------ internals

    def _global_window(self) -> tuple[np.ndarray, float]:
        """([L, E] routed pairs of the window summed over ranks, the measured balancedness of
        the ranks' processed pairs over it)."""
        window = self._window.sum(dim=0).cpu()
        self._all_reduce(window, "sum")
        e = self.placement.num_experts
        return window[:, :e].numpy(), rank_balancedness(window[:, e:].numpy())

    def _record_measured(self, measured: float) -> None:
        if self.stats.rebalances:
            self.stats.rebalances[-1].balancedness_after_measured = measured
            logger.info("EPLB: balancedness %.3f measured over the %d steps after the "
                        "rebalance of step %d", measured, self.config.window_steps,
                        self.stats.rebalances[-1].step)
        self._measure_at = None

    def _decide(self, load: np.ndarray, measured: float) -> None:
        decision = self._rank0_decision(
            decide(load, self.placement, self.config.balancedness_threshold))
        self.stats.num_decisions += 1
        self.stats.balancedness = measured
        self.stats.balancedness_predicted = decision.balancedness_before
        if decision.placement is None:
            # INFO, once per interval: a controller that stopped deciding shows (vLLM #57883)
            logger.info("EPLB step %d: no move, %s (rank balancedness %.3f predicted, %.3f "
                        "measured, threshold %.3f)", self.steps, decision.reason,
                        decision.balancedness_before, measured,
                        self.config.balancedness_threshold)
            return
        self._pending = RebalanceRecord(
            step=self.steps,
            balancedness_before=decision.balancedness_before,
            balancedness_after_predicted=decision.balancedness_after,
        )
        self._target = decision.placement
        self.stats.moving = True
        logger.info("EPLB step %d: balancedness %.3f below %.3f: moving %d experts "
                    "to new ranks (each in every MoE layer), predicted %.3f after", self.steps,
                    decision.balancedness_before, self.config.balancedness_threshold,
                    decision.experts_to_move, decision.balancedness_after)
        self.mover.begin(self.placement, decision.placement)

    def _rank0_decision(self, mine: Decision) -> Decision:
        """Rank 0's decision, on every rank: a broadcast made of one all-reduce SUM of a float64
        vector that only rank 0 fills (exact: the others add zeros). Every rank decided from
        the same integers, so the decisions agree; should floating point differ between nodes
        (another numpy build), the ranks still move to one placement, and a rank whose own plan
        differed logs it."""
        n, slots = self.placement.ep_size, self.placement.num_local_experts
        payload = torch.zeros(4 + n * slots, dtype=torch.float64)
        if self.rank == 0:
            payload[:3] = torch.tensor([mine.balancedness_before, mine.balancedness_after,
                                        float(mine.experts_to_move)], dtype=torch.float64)
            if mine.placement is not None:
                payload[3] = 1.0
                payload[4:] = torch.tensor(mine.placement.slots, dtype=torch.float64).flatten()
        self._all_reduce(payload, "sum")
        placement = None
        if payload[3] == 1.0:
            rows = payload[4:].to(torch.int64).view(n, slots).tolist()
            placement = ExpertPlacement(self.placement.num_experts, n, rows)
        if placement != mine.placement:
            logger.warning("EPLB step %d: rank %d planned %s, rank 0 %s; following rank 0",
                           self.steps, self.rank, mine.placement, placement)
        reason = mine.reason if placement == mine.placement else (
            "rebalance" if placement is not None else "no better placement")
        return Decision(float(payload[0]), float(payload[1]), placement, int(payload[2]),
                        reason)

    def _commit(self) -> None:
        record, target = self._pending, self._target
        assert record is not None and target is not None
        moved = self.mover.commit()
        record.committed_step = self.steps
        for name in ("experts_moved", "bytes_sent", "bytes_received", "transfer_s",
                     "commit_s"):
            setattr(record, name, getattr(moved, name))
        record.move_steps = int(getattr(moved, "steps", self.steps - record.step))
        self.placement = target
        self._pending = self._target = None
        s = self.stats
        s.num_rebalances += 1
        s.moving = False
        s.experts_moved += record.experts_moved
        s.bytes_sent += record.bytes_sent
        s.bytes_received += record.bytes_received
        s.transfer_s += record.transfer_s
        s.commit_s += record.commit_s
        s.last_rebalance_step = record.step
        s.rebalances = [*s.rebalances, record][-MAX_RECORDS:]
        self._measure_at = self.steps + self.config.window_steps
        if self._on_commit is not None:
            self._on_commit(target)
        logger.info(
            "EPLB rebalance %d (decided at step %d, swapped in at step %d): %d (layer, slot) "
            "entries changed on this rank, "
            "%d bytes sent, %d received, transfer %.3f s over %d steps, commit %.3f s; rank "
            "balancedness %.3f -> %.3f predicted", s.num_rebalances, record.step,
            record.committed_step, record.experts_moved, record.bytes_sent,
            record.bytes_received, record.transfer_s, record.move_steps, record.commit_s,
            record.balancedness_before, record.balancedness_after_predicted)

    def snapshot(self) -> EplbStats:
        """A copy of the stats (for GetServerStats)."""
        import msgspec

        return msgspec.convert(msgspec.to_builtins(self.stats), EplbStats)


def build_controller(
    core: Any, placement: ExpertPlacement, rank: int, control_group: Any, device_group: Any
) -> EplbController:
    """This rank's controller over its core's MoE layers (the mover moves their weights over
    `device_group`, the decisions all-reduce over `control_group`); set as `core.eplb`, so
    that the core's stats and model info report it. After each commit the rank context's
    `local_experts` follow the new placement (GetModelInfo's experts_per_rank).

    Args:
        core: this rank's EngineCore (`config.eplb`, `model`, `kernels`, `rank_context`,
            `device`).
        placement: the placement the core was built with.

    Raises:
        StartupError: the mover cannot move these experts (4-bit experts on a kernel backend
            whose layout cannot be given back), naming --kernel-backend.
    """
    from moe_engine.eplb.mover import ExpertMover
    from moe_engine.errors import StartupError

    moes = [moe for _, moe in core.model.moe_layers()]
    try:
        mover = ExpertMover(moes, core.rank_context.communicator, rank, device_group,
                            core.kernels,
                            max_bytes_per_step=int(core.config.eplb.move_mib_per_step * (1 << 20)))
    except ValueError as exc:
        raise StartupError(f"--enable-eplb (--kernel-backend {core.config.kernel_backend}): "
                           f"{exc}") from None

    def on_commit(new: ExpertPlacement) -> None:
        core.rank_context.local_experts = new.local_experts(rank)

    controller = EplbController(
        core.config.eplb, placement, mover, len(moes), dist_all_reduce(control_group),
        rank=rank, device=core.device, on_commit=on_commit,
    )
    core.eplb = controller
    return controller
