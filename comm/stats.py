"""Token and byte counters of a communicator (DESIGN.md section 6: "byte counts per step").

Every number comes from host values the all-to-all needs anyway (its split sizes), so keeping
them costs no collective and no extra device sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass
class CommCounts:
    """Counts over some dispatch/combine calls of one rank (one call, or all so far).

    Attributes:
        dispatches: dispatch calls.
        combines: combine calls.
        tokens_in: tokens handed to dispatch (T summed over calls).
        tokens_sent_per_rank: tokens sent to each destination rank, this rank included (a
            token goes at most once to each rank, whatever the number of its experts there).
        tokens_received: tokens received by dispatch from all ranks, this rank included (the
            rows this rank's experts processed).
        remote_pairs: (token, expert) pairs whose expert copy sits on another rank; a
            communicator sending once per expert would send this many rows.
        dispatch_bytes_sent: bytes dispatch sent to other ranks: hidden rows plus their packed
            local ids and weights (the split-size exchange, 8 bytes per peer, is not counted).
        min_dispatch_bytes: the floor for the same routing, hidden bytes only: sum over tokens
            of H x element bytes x distinct remote destination ranks.
        combine_bytes_sent: bytes combine sent back to other ranks (partial sums, hidden dtype).
    """

    dispatches: int = 0
    combines: int = 0
    tokens_in: int = 0
    tokens_sent_per_rank: list[int] = field(default_factory=list)
    tokens_received: int = 0
    remote_pairs: int = 0
    dispatch_bytes_sent: int = 0
    min_dispatch_bytes: int = 0
    combine_bytes_sent: int = 0

    def add(self, other: CommCounts) -> None:
        """Accumulate `other` into these counts (per-rank lists added element-wise)."""
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):
                width = max(len(mine), len(theirs))
                mine = mine + [0] * (width - len(mine))
                theirs = theirs + [0] * (width - len(theirs))
                setattr(self, f.name, [a + b for a, b in zip(mine, theirs, strict=True)])
            else:
                setattr(self, f.name, mine + theirs)

    def since(self, earlier: CommCounts) -> CommCounts:
        """The counts added after `earlier` (a copy of these counts taken before), e.g. per step."""
        delta = CommCounts()
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(earlier, f.name)
            if isinstance(mine, list):
                theirs = theirs + [0] * (len(mine) - len(theirs))
                setattr(delta, f.name, [a - b for a, b in zip(mine, theirs, strict=True)])
            else:
                setattr(delta, f.name, mine - theirs)
        return delta

    def copy(self) -> CommCounts:
        """An independent copy."""
        out = CommCounts()
        out.add(self)
        return out

    def as_dict(self) -> dict[str, int | list[int]]:
        """Plain values for metrics and JSON."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class CommStats:
    """`last`: the latest dispatch plus the combines called after it (its own, in the usual
    dispatch -> combine order); `total`: everything since creation."""

    last: CommCounts = field(default_factory=CommCounts)
    total: CommCounts = field(default_factory=CommCounts)

    def record_dispatch(self, counts: CommCounts) -> None:
        """Start a new `last` with one dispatch's counts and add them to `total`."""
        self.last = counts
        self.total.add(counts)

    def record_combine(self, bytes_sent: int) -> None:
        """Add one combine's bytes to `last` and `total`."""
        for counts in (self.last, self.total):
            counts.combines += 1
            counts.combine_bytes_sent += bytes_sent
