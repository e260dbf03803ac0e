"""Which expert each changed slot gets, from where, and in which step: the move schedule.

A rebalance replaces the serving `ExpertPlacement` by another of the same shape (num_experts,
ep_size, slots per rank; `ExpertPlacement.check_swap`). Every rank computes the same schedule
from (old, new) alone, so the transfers need no negotiation and every rank makes the same
collective calls in the same order:

- A slot whose expert does not change is left alone. A changed slot (rank r, slot s) gets
  expert e = new[r][s] as one `ExpertCopy`; sources are chosen in (rank, slot) order, and the
  copies are then interleaved over the destination ranks (every rank's first changed slot,
  then every rank's second, ...) so that a step under a tight budget has every rank at work.
- **Source choice** (deterministic): if rank r already holds e in another old slot, the copy
  is local (r to r, no transfer). Otherwise the source is the old holder of e with the fewest
  transfers assigned so far in this schedule, ties broken by the lowest rank; so the sending
  work spreads over the replicas of a hot expert (SGLang's and vLLM's EPLB also send each
  moved expert once from one old holder; vLLM `eplb/rebalance_execute.py` picks the first
  holder, here the least-loaded one).
- **Chunks** (`chunk_moves`): the copies of every MoE layer, layer-major, cut into steps so
  that no rank sends, receives or copies locally more than `max_bytes_per_step` bytes in one
  step (a single expert larger than that travels alone). A step is one all-to-all over the
  device group; a step with no transfer at all (local copies only) makes no collective call,
  which every rank knows from the schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from comm.placement import ExpertPlacement


@dataclass(frozen=True)
class ExpertCopy:
    """Slot `dst_slot` of rank `dst_rank` gets global expert `expert` from slot `src_slot` of
    rank `src_rank` (the old placement's), in every MoE layer."""

    expert: int
    src_rank: int
    src_slot: int
    dst_rank: int
    dst_slot: int

    @property
    def local(self) -> bool:
        """Both ends on one rank: a copy in memory, never sent."""
        return self.src_rank == self.dst_rank


@dataclass(frozen=True)
class MoveSchedule:
    """The copies that turn `old` into `new`, the same on every rank.

    Attributes:
        copies: one per changed (rank, slot): each rank's first changed slot (ranks in
            order), then each rank's second, and so on.
        ep_size: ranks of the group.
    """

    copies: tuple[ExpertCopy, ...]
    ep_size: int

    @property
    def transfers(self) -> tuple[ExpertCopy, ...]:
        """The copies that cross ranks."""
        return tuple(c for c in self.copies if not c.local)

    def changed_slots(self, rank: int) -> list[int]:
        """`rank`'s slots that get another expert, ascending (the rows of its staging)."""
        return sorted(c.dst_slot for c in self.copies if c.dst_rank == rank)


def plan_moves(old: ExpertPlacement, new: ExpertPlacement) -> MoveSchedule:
    """The schedule of copies from `old` to `new` (module doc: source choice).

    Raises:
        ValueError: the placements differ in num_experts, ep_size or slots per rank.
    """
    old.check_swap(new)
    sends = [0] * old.ep_size
    copies = []
    for dst_rank, row in enumerate(new.slots):
        held = old.slots[dst_rank]
        for dst_slot, expert in enumerate(row):
            if held[dst_slot] == expert:
                continue
            if expert in held:
                src_rank = dst_rank
            else:
                holders = [r for r, slots in enumerate(old.slots) if expert in slots]
                src_rank = min(holders, key=lambda r: (sends[r], r))
                sends[src_rank] += 1
            src_slot = old.slots[src_rank].index(expert)
            copies.append(ExpertCopy(expert, src_rank, src_slot, dst_rank, dst_slot))
    # interleave the ranks (each one's first copy, then each one's second, ...), so that a
    # step under a tight budget keeps every rank receiving instead of one after the other
    changed = [0] * old.ep_size
    keys = {}
    for c in copies:
        keys[c] = (changed[c.dst_rank], c.dst_rank)
        changed[c.dst_rank] += 1
    copies.sort(key=keys.__getitem__)
    return MoveSchedule(tuple(copies), old.ep_size)


#: One unit of work: (index of the MoE layer, the copy).
Unit = tuple[int, ExpertCopy]


def chunk_moves(
    schedule: MoveSchedule, expert_bytes: Sequence[int], max_bytes_per_step: int
) -> list[list[Unit]]:
    """Cut the copies of every layer into steps (module doc: chunks).

    Args:
        schedule: the copies (the same for every layer).
        expert_bytes: bytes of one expert of each MoE layer (all of its moved tensors), the
            same on every rank.
        max_bytes_per_step: per rank and step, the most bytes sent, and separately the most
            bytes received plus copied locally; at least 1.

    Returns:
        The steps in order, each a non-empty list of (layer, copy), layer-major; empty when
        nothing moves.

    Raises:
        ValueError: max_bytes_per_step below 1.
    """
    if max_bytes_per_step < 1:
        raise ValueError(f"max_bytes_per_step must be at least 1, got {max_bytes_per_step}")
    steps: list[list[Unit]] = []
    current: list[Unit] = []
    sent = [0] * schedule.ep_size
    staged = [0] * schedule.ep_size
    for layer, size in enumerate(expert_bytes):
        for copy in schedule.copies:
            src_sends = 0 if copy.local else size
            fits = (sent[copy.src_rank] + src_sends <= max_bytes_per_step
                    and staged[copy.dst_rank] + size <= max_bytes_per_step)
            if current and not fits:
                steps.append(current)
                current, sent, staged = [], [0] * schedule.ep_size, [0] * schedule.ep_size
            current.append((layer, copy))
            sent[copy.src_rank] += src_sends
            staged[copy.dst_rank] += size
    if current:
        steps.append(current)
    return steps
