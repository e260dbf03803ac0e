"""How a starting engine tells what it is doing (the front end shows it as its status)."""

from __future__ import annotations

from collections.abc import Callable

#: Told by a starting core what it is doing: (phase, detail, estimated seconds left or None),
#: e.g. ("building native CPU kernels", "moe_cpu 2/4", 40.0). Any thread may call it.
StartupProgressFn = Callable[[str, str, "float | None"], None]
