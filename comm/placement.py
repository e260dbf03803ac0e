"""Which rank holds which expert: the map from global expert ids to (rank, local slot).

The default is the contiguous layout of DESIGN.md section 6 (expert `e` on rank
`e // (E / ep_size)`, local slot `e % (E / ep_size)`), the layout DeepEP and vLLM assume. An
explicit placement lists, per rank, the global expert held by each local slot; an expert listed
on several ranks is replicated there (the "redundant experts" of DeepSeek's EPLB,
github.com/deepseek-ai/EPLB), and its replicas share its tokens (see `ExpertPlacement.route`).
The profiler (`moe-skew`) writes such placements as `placement.json`:

    {"version": 1, "num_experts": E, "ep_size": N, "slots": [[e, ...], ...]}
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

#: The `version` field this module reads and writes in placement.json.
PLACEMENT_VERSION = 1


@dataclass(frozen=True)
class _RouteTables:
    """Device tensors of a placement: row e lists expert e's replicas (padded with replica 0)."""

    replica_rank: torch.Tensor  # [E, R_max] int64
    replica_slot: torch.Tensor  # [E, R_max] int32
    num_replicas: torch.Tensor  # [E] int64


class ExpertPlacement:
    """Global expert ids -> (rank, local slot) for `ep_size` ranks, with optional replicas.

    Args:
        num_experts: E, routed experts of the model.
        ep_size: N, ranks of the expert-parallel group.
        slots: optional explicit placement, `slots[rank][slot]` = the global expert held by that
            local slot. Every rank holds the same number of slots, every expert is held at least
            once and at most once per rank; an expert held by several ranks is replicated.
            None means the contiguous layout, which needs `ep_size` to divide `num_experts`.

    Raises:
        ValueError: non-positive sizes; for the contiguous layout, `ep_size` larger than or not
            dividing `num_experts` (the message names both numbers); for explicit slots, a wrong
            number of ranks, uneven or empty slot lists, unknown ids, missing experts, or an
            expert held twice by one rank.
    """

    def __init__(
        self, num_experts: int, ep_size: int, slots: Sequence[Sequence[int]] | None = None
    ) -> None:
        if num_experts < 1 or ep_size < 1:
            raise ValueError(
                f"num_experts ({num_experts}) and ep_size ({ep_size}) must both be at least 1"
            )
        self._num_experts, self._ep_size = num_experts, ep_size
        if slots is None:
            slots = _contiguous_slots(num_experts, ep_size)
        self._slots = _validated_slots(slots, num_experts, ep_size)
        self._tables: dict[torch.device, _RouteTables] = {}

    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> ExpertPlacement:
        """The default layout: expert e on rank e // (E / ep_size), slot e % (E / ep_size)."""
        return cls(num_experts, ep_size)

    @property
    def num_experts(self) -> int:
        """E, the model's routed experts."""
        return self._num_experts

    @property
    def ep_size(self) -> int:
        """N, the ranks of the expert-parallel group."""
        return self._ep_size

    @property
    def num_local_experts(self) -> int:
        """Slots per rank (E / N for the contiguous layout, more with replicas)."""
        return len(self._slots[0])

    @property
    def slots(self) -> tuple[tuple[int, ...], ...]:
        """`slots[rank][slot]`, the global expert each local slot holds."""
        return self._slots

    @property
    def has_replicas(self) -> bool:
        """Whether some expert is held by more than one rank."""
        return self.ep_size * self.num_local_experts > self.num_experts

    @property
    def is_contiguous(self) -> bool:
        """Whether this is the default layout (what DeepEP and the checkpoint order assume)."""
        return not self.has_replicas and self._slots == _contiguous_slots(
            self.num_experts, self.ep_size
        )

    def check(self, num_experts: int, ep_size: int) -> None:
        """Check that this placement fits a model with `num_experts` on `ep_size` ranks.

        Raises:
            ValueError: naming the placement's number and the expected one.
        """
        if self.num_experts != num_experts:
            raise ValueError(
                f"the placement has num_experts {self.num_experts}, the model {num_experts}"
            )
        if self.ep_size != ep_size:
            raise ValueError(
                f"the placement is for ep_size {self.ep_size}, but {ep_size} ranks are running"
            )

    def check_swap(self, new: ExpertPlacement) -> None:
        """Check that `new` can replace this placement while serving: the same num_experts,
        ep_size and slots per rank (what the experts' stacked tensors and a communicator's
        buffers are sized by); the experts in the slots may differ.

        Raises:
            ValueError: naming the field, the serving value and the new one.
        """
        for field in ("num_experts", "ep_size", "num_local_experts"):
            serving, other = getattr(self, field), getattr(new, field)
            if serving != other:
                raise ValueError(
                    f"the new placement has {field} {other}, the serving one {serving}: a "
                    f"placement swap keeps num_experts, ep_size and slots per rank"
                )

    def local_experts(self, rank: int) -> list[int]:
        """Global expert id of each local slot of `rank`: index the stacked w13/w2 with it."""
        return list(self._slots[rank])

    def replicas(self, expert: int) -> list[tuple[int, int]]:
        """(rank, local slot) of every copy of `expert`, in rank order."""
        return [
            (rank, slot)
            for rank, row in enumerate(self._slots)
            for slot, held in enumerate(row)
            if held == expert
        ]

    def route(self, topk_ids: torch.Tensor, src_rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Destination of every (token, expert) pair.

        An expert with R replicas spreads its pairs round-robin: on source rank s, the j-th pair
        (in token order) routed to expert e goes to replica (j + s) mod R, replicas ordered by
        rank. Each source splits its pairs of e evenly (counts differ by at most one) and the
        offset s spreads the remainders of different sources over different replicas.
        Deterministic; without replicas it is a table lookup.

        Args:
            topk_ids: [T, k] int32/int64 global expert ids, all in [0, num_experts), or -1 for
                a slot that holds no expert (a zero-computation expert's): it goes to
                `src_rank` itself, local slot -1, which the experts skip.
            src_rank: the rank routing these tokens.

        Returns:
            dest_rank [T, k] int64 and local_slot [T, k] int32, on topk_ids' device.
        """
        tables = self._route_tables(topk_ids.device)
        none = topk_ids < 0  # masked without reading it back: no host sync
        ids = topk_ids.long().clamp_min(0)
        if not self.has_replicas:
            dest_rank, local_slot = tables.replica_rank[ids, 0], tables.replica_slot[ids, 0]
            return dest_rank.masked_fill(none, src_rank), local_slot.masked_fill(none, -1)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # scatter_add, not bincount: CUDA's bincount reads the maximum back to the host
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        starts = torch.cumsum(counts, 0) - counts
        position = torch.empty_like(flat)
        position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
        choice = (position + src_rank) % tables.num_replicas[flat]
        dest_rank = tables.replica_rank[flat, choice].view_as(ids)
        local_slot = tables.replica_slot[flat, choice].view_as(ids)
        return dest_rank.masked_fill(none, src_rank), local_slot.masked_fill(none, -1)

    def _route_tables(self, device: torch.device) -> _RouteTables:
        if device not in self._tables:
            copies = [self.replicas(expert) for expert in range(self.num_experts)]
            width = max(len(c) for c in copies)
            padded = [c + [c[0]] * (width - len(c)) for c in copies]
            self._tables[device] = _RouteTables(
                replica_rank=torch.tensor([[r for r, _ in c] for c in padded], device=device),
                replica_slot=torch.tensor(
                    [[s for _, s in c] for c in padded], dtype=torch.int32, device=device
                ),
                num_replicas=torch.tensor([len(c) for c in copies], device=device),
            )
        return self._tables[device]

    def to_dict(self) -> dict:
        """The placement.json object: version, num_experts, ep_size, slots."""
        return {
            "version": PLACEMENT_VERSION,
            "num_experts": self.num_experts,
            "ep_size": self.ep_size,
            "slots": [list(row) for row in self._slots],
        }

    @classmethod
    def from_dict(cls, data: dict, source: str = "placement") -> ExpertPlacement:
        """Build from a placement.json object.

        Raises:
            ValueError: a missing key, an unsupported version, or an invalid placement; the
                message starts with `source` (e.g. the file path).
        """
        for key in ("version", "num_experts", "ep_size", "slots"):
            if key not in data:
                raise ValueError(f"{source}: missing key {key!r}")
        if data["version"] != PLACEMENT_VERSION:
            raise ValueError(
                f"{source}: unsupported version {data['version']!r} "
                f"(this engine reads version {PLACEMENT_VERSION})"
            )
        try:
            return cls(int(data["num_experts"]), int(data["ep_size"]), data["slots"])
        except (ValueError, TypeError) as error:
            raise ValueError(f"{source}: {error}") from error

    @classmethod
    def load(cls, path: str | Path) -> ExpertPlacement:
        """Read a placement.json file (see `from_dict` for the errors raised)."""
        with open(path) as f:
            return cls.from_dict(json.load(f), source=str(path))

    def save(self, path: str | Path) -> None:
        """Write this placement as placement.json (one line per rank's slot list)."""
        rows = ",\n    ".join(json.dumps(list(row)) for row in self._slots)
        Path(path).write_text(
            f'{{"version": {PLACEMENT_VERSION}, "num_experts": {self.num_experts}, '
            f'"ep_size": {self.ep_size}, "slots": [\n    {rows}\n]}}\n'
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ExpertPlacement) and (
            self.num_experts,
            self.ep_size,
            self._slots,
        ) == (other.num_experts, other.ep_size, other._slots)

    def __hash__(self) -> int:
        return hash((self.num_experts, self.ep_size, self._slots))

    def __repr__(self) -> str:
        return (
            f"ExpertPlacement(num_experts={self.num_experts}, ep_size={self.ep_size}, "
            f"slots={[list(row) for row in self._slots]})"
        )


def _contiguous_slots(num_experts: int, ep_size: int) -> tuple[tuple[int, ...], ...]:
    if ep_size > num_experts:
        raise ValueError(
            f"ep_size {ep_size} is larger than num_experts {num_experts}: "
            "every rank needs at least one expert"
        )
    if num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} does not divide num_experts {num_experts}")
    per_rank = num_experts // ep_size
    return tuple(tuple(range(r * per_rank, (r + 1) * per_rank)) for r in range(ep_size))


def _validated_slots(
    slots: Sequence[Sequence[int]], num_experts: int, ep_size: int
) -> tuple[tuple[int, ...], ...]:
    rows = tuple(tuple(row) for row in slots)
    if len(rows) != ep_size:
        raise ValueError(f"placement lists {len(rows)} ranks but ep_size is {ep_size}")
    lengths = [len(row) for row in rows]
    if min(lengths) == 0 or len(set(lengths)) > 1:
        raise ValueError(
            f"uneven slot counts {lengths} (per rank): every rank must hold the same, "
            "non-zero number of expert slots"
        )
    for rank, row in enumerate(rows):
        for expert in row:
            if not isinstance(expert, int) or isinstance(expert, bool):
                raise ValueError(f"rank {rank}: expert id {expert!r} is not an integer")
            if not 0 <= expert < num_experts:
                raise ValueError(
                    f"rank {rank}: unknown expert {expert} (num_experts {num_experts})"
                )
        if len(set(row)) != len(row):
            twice = sorted({e for e in row if row.count(e) > 1})
            raise ValueError(f"rank {rank} holds experts {twice} more than once")
    missing = sorted(set(range(num_experts)) - {e for row in rows for e in row})
    if missing:
        raise ValueError(f"experts {missing} are on no rank (num_experts {num_experts})")
    return rows
