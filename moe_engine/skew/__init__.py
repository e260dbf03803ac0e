"""Routing-skew tools: expert-load traces, a Zipf skew generator, placement planning, reports.

- `trace`: the versioned NPZ trace format (`TraceWriter`, `read_trace`), docs/trace_format.md.
- `zipf`: synthetic Zipf-skewed routing (`ZipfRouter`, `zipf_trace`).
- `planner`: EPLB-style replicate-and-pack placement (`plan_placement`).
- `placement`: the placement file (`Placement`); `imbalance`: predicted rank loads (`replay`).
- `report` / `plot`: what `moe-skew report` and `moe-skew plot` print and draw.
"""

from moe_engine.skew.imbalance import replay
from moe_engine.skew.placement import Placement, PlacementError
from moe_engine.skew.planner import plan_placement
from moe_engine.skew.trace import (
    FORMAT_VERSION,
    ExpertTrace,
    TraceFormatError,
    TraceWriter,
    read_trace,
    write_trace,
)

__all__ = [
    "FORMAT_VERSION",
    "ExpertTrace",
    "Placement",
    "PlacementError",
    "TraceFormatError",
    "TraceWriter",
    "plan_placement",
    "read_trace",
    "replay",
    "write_trace",
]
