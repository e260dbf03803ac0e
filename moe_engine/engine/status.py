"""What the engine is doing while it starts, as the front end tells clients and the log.

`EngineClient` keeps one `StartupStatus` and replaces it on every `StartupProgress` from the
core; `describe` is the text that the UNAVAILABLE status, the health check's trailing metadata
(`moe-engine-status`) and `GET /health` carry, e.g.

    building native CPU kernels: moe_cpu (2/4) (25 s elapsed, about 40 s left)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

#: The phase before the core process says anything (it is importing torch).
STARTING_PHASE = "starting the engine core process"


@dataclass(frozen=True)
class StartupStatus:
    """One startup phase as the front end last heard of it.

    Attributes:
        phase: what the core does ("building native CPU kernels", "loading weights", ...).
        detail: the core's latest line about it ("" when none).
        eta_s: seconds the core expected the phase to take still, when it said so (None:
            unknown).
        phase_started: time.monotonic() when the phase began (as heard by the front end).
        updated: time.monotonic() when this status arrived.
    """

    phase: str = STARTING_PHASE
    detail: str = ""
    eta_s: float | None = None
    phase_started: float = field(default_factory=time.monotonic)
    updated: float = field(default_factory=time.monotonic)

    def advance(self, phase: str, detail: str, eta_s: float | None, now: float) -> StartupStatus:
        """The status after a StartupProgress arrived at `now` (a new phase restarts the
        elapsed clock)."""
        started = self.phase_started if phase == self.phase else now
        return StartupStatus(phase, detail, eta_s, started, now)

    def describe(self, now: float | None = None) -> str:
        """One line: phase, detail, seconds elapsed in the phase and about how many are left."""
        now = time.monotonic() if now is None else now
        times = [f"{now - self.phase_started:.0f} s elapsed"]
        if self.eta_s is not None:
            left = self.eta_s - (now - self.updated)
            times.append(f"about {left:.0f} s left" if left >= 1 else "finishing")
        text = f"{self.phase}: {self.detail}" if self.detail else self.phase
        return f"{text} ({', '.join(times)})"
