"""Wall time per phase of the forward pass, summed over steps (for stats and `bench/ep.py`).

Phases: "attention" (the attention block of every layer), "router" (router GEMM and top-k),
"dispatch", "experts", "combine" (the MoE block's three parts), "shared_experts" (the
shared experts of models that have them, after combine), "decode_layer" (a decoder layer's
decode step run as one native call, `DecoderLayer` with `kernels.decode_layer.native`: no split
of its own), "step" (one whole `EngineCore.step`). On a CPU the host clock is the device
clock; on a GPU these are launch times unless the caller synchronises, so they are meant for
CPU runs and for relative splits.
"""

from __future__ import annotations

import time


class _Phase:
    """One timed `with` block of a `PhaseTimer` (a plain context manager: about a third of a
    generator-based `contextmanager`'s overhead, and the MoE block enters five per layer)."""

    __slots__ = ("timer", "name", "start")

    def __init__(self, timer: PhaseTimer, name: str) -> None:
        self.timer, self.name, self.start = timer, name, 0.0

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        seconds, calls = self.timer.seconds, self.timer.calls
        seconds[self.name] = seconds.get(self.name, 0.0) + time.perf_counter() - self.start
        calls[self.name] = calls.get(self.name, 0) + 1


class PhaseTimer:
    """Accumulates seconds per named phase.

    Attributes:
        seconds: phase name -> total wall seconds since the last `reset`.
        calls: phase name -> how many times the phase ran.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def phase(self, name: str) -> _Phase:
        """Time the body of a `with` block under `name` (well under 1 us of overhead); an
        exception in the body is timed too and propagates."""
        return _Phase(self, name)

    def snapshot(self) -> dict[str, float]:
        """A copy of `seconds`."""
        return dict(self.seconds)

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()
