"""Wall time per phase of the forward pass, summed over steps (for stats and `bench/ep.py`).

Phases: "attention" (the attention block of every layer), "router" (router GEMM and top-k),
"dispatch", "experts", "combine" (the MoE block's three parts), "shared_experts" (the
shared experts of models that have them, after combine), "step" (one whole
`EngineCore.step`). On a CPU the host clock is the device clock; on a GPU these are launch
times unless the caller synchronises, so they are meant for CPU runs and for relative splits.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager


class PhaseTimer:
    """Accumulates seconds per named phase.

    Attributes:
        seconds: phase name -> total wall seconds since the last `reset`.
        calls: phase name -> how many times the phase ran.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body of a `with` block under `name` (about 1 us of overhead)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.calls[name] = self.calls.get(name, 0) + 1

    def snapshot(self) -> dict[str, float]:
        """A copy of `seconds`."""
        return dict(self.seconds)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
