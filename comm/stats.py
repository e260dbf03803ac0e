"""Token and byte counters of a communicator (DESIGN.md section 6: "byte counts per step").

Keeping them costs no collective and no device sync: a path that reads its split sizes on the
host anyway (`TorchAllToAll`'s variable splits) records host integers; a path that keeps its
counts on the device (fixed-capacity all-to-all, DeepEP) records a device vector
(`device_counts`) that is added up on the device and read back only when `CommStats.last` or
`CommStats.total` is read (one device-to-host copy per read, none in the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

#: The scalar `CommCounts` fields a device vector carries, after the per-rank token counts.
DEVICE_FIELDS = (
    "tokens_received",
    "remote_pairs",
    "dispatch_bytes_sent",
    "min_dispatch_bytes",
    "combine_bytes_sent",
)


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


def device_counts(
    tokens_sent_per_rank: torch.Tensor, **scalars: torch.Tensor | int
) -> torch.Tensor:
    """One dispatch's device-side counts as the vector `CommStats.record_dispatch` takes.

    Args:
        tokens_sent_per_rank: [N] integer tensor, rows sent to each rank.
        scalars: any of `DEVICE_FIELDS`, each a 0-d/1-element tensor on the same device or an
            int; the others count 0.

    Returns:
        [N + len(DEVICE_FIELDS)] int64 on tokens_sent_per_rank's device (no host sync).

    Raises:
        ValueError: a name that is not in `DEVICE_FIELDS`.
    """
    unknown = set(scalars) - set(DEVICE_FIELDS)
    if unknown:
        raise ValueError(f"unknown device count fields {sorted(unknown)}; known {DEVICE_FIELDS}")
    device = tokens_sent_per_rank.device
    parts = [tokens_sent_per_rank.reshape(-1).long()]
    for name in DEVICE_FIELDS:
        value = scalars.get(name, 0)
        if isinstance(value, torch.Tensor):
            parts.append(value.reshape(1).long())
        else:
            parts.append(torch.full((1,), int(value), dtype=torch.int64, device=device))
    return torch.cat(parts)


class CommStats:
    """`last`: the latest dispatch plus the combines called after it (its own, in the usual
    dispatch -> combine order); `total`: everything since creation.

    Host integers and device vectors (`device_counts`) may be mixed: the device parts are
    accumulated in place on their device (graph-safe: fixed addresses, no host sync) and read
    back when `last` or `total` is read. Assigning `last` / `total` replaces both parts.
    """

    def __init__(self) -> None:
        self._last = CommCounts()
        self._total = CommCounts()
        self._dev_last: torch.Tensor | None = None  # the latest dispatch's device vector
        self._dev_total: torch.Tensor | None = None  # every device vector added up

    def record_dispatch(self, counts: CommCounts, device: torch.Tensor | None = None) -> None:
        """Start a new `last` with one dispatch's counts and add them to `total`.

        Args:
            counts: the host-known counts (the device-carried fields left at 0).
            device: None, or [N + len(DEVICE_FIELDS)] int64 from `device_counts`.
        """
        self._last = counts
        self._total.add(counts)
        if device is None:
            self._dev_last = None
            return
        if self._dev_total is None or self._dev_total.shape != device.shape:
            self._fold_device()
            self._dev_total = torch.zeros_like(device)
        self._dev_total.add_(device)
        self._dev_last = device.clone()

    def record_combine(self, bytes_sent: int | torch.Tensor) -> None:
        """Add one combine's bytes (an int, or a 1-element device tensor) to `last` and
        `total`."""
        for counts in (self._last, self._total):
            counts.combines += 1
        if not isinstance(bytes_sent, torch.Tensor):
            for counts in (self._last, self._total):
                counts.combine_bytes_sent += bytes_sent
            return
        index = -len(DEVICE_FIELDS) + DEVICE_FIELDS.index("combine_bytes_sent")
        if self._dev_total is None:  # no device dispatch before: the bytes go on the host
            for counts in (self._last, self._total):
                counts.combine_bytes_sent += int(bytes_sent)
            return
        self._dev_total[index] += bytes_sent.reshape(()).long()
        if self._dev_last is not None:
            self._dev_last[index] += bytes_sent.reshape(()).long()

    @property
    def last(self) -> CommCounts:
        """The latest dispatch and its combines (reads the device part back, if any)."""
        out = self._last.copy()
        if self._dev_last is not None:
            out.add(_from_device(self._dev_last))
        return out

    @last.setter
    def last(self, counts: CommCounts) -> None:
        self._last, self._dev_last = counts.copy(), None

    @property
    def total(self) -> CommCounts:
        """Everything since creation (reads the device part back, if any)."""
        out = self._total.copy()
        if self._dev_total is not None:
            out.add(_from_device(self._dev_total))
        return out

    @total.setter
    def total(self, counts: CommCounts) -> None:
        self._total, self._dev_total = counts.copy(), None

    def _fold_device(self) -> None:
        """Move the device total into the host total (before the vector's width changes)."""
        if self._dev_total is not None:
            self._total.add(_from_device(self._dev_total))
            self._dev_total = None


def _from_device(vector: torch.Tensor) -> CommCounts:
    """A `device_counts` vector as `CommCounts` (one device-to-host copy)."""
    values = vector.tolist()
    width = len(values) - len(DEVICE_FIELDS)
    counts = CommCounts(tokens_sent_per_rank=values[:width])
    for name, value in zip(DEVICE_FIELDS, values[width:], strict=True):
        setattr(counts, name, value)
    return counts
