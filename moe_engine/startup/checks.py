"""Configuration checks that need the checkpoint's shape, run before any process starts.

Each takes what it needs (the expert count from the caller's `ModelShape`) rather than reading
the model here: `startup/` never imports `models/` (DESIGN.md section 3).
"""

from __future__ import annotations

from moe_engine.errors import StartupError
from moe_engine.startup.config import EngineConfig


def check_ep_size(config: EngineConfig, num_experts: int) -> None:
    """Fail fast, before any rank starts, on an ep_size the checkpoint's experts cannot split
    or a placement file that does not fit it.

    With ep_size 1 and no placement file there is nothing to check: callers may skip the call
    (and reading config.json for `num_experts`).

    Args:
        config: the engine configuration (`parallel.ep_size`, `parallel.expert_placement`).
        num_experts: the checkpoint's routed experts per MoE layer (`ModelShape.num_experts`).

    Raises:
        StartupError: ep_size larger than num_experts, or not dividing it (without a placement
            file), naming both numbers; a placement file that is missing, malformed or made
            for another model or ep size, or given with ep_size 1.
    """
    ep_size = config.parallel.ep_size
    placement = config.parallel.expert_placement
    if ep_size == 1 and placement is None:
        return
    if placement is not None:
        if ep_size == 1:
            raise StartupError(
                f"--expert-placement {placement}: a placement spreads experts over ranks; it "
                f"needs --ep-size > 1"
            )
        from comm import ExpertPlacement

        try:
            ExpertPlacement.load(placement).check(num_experts, ep_size)
        except (OSError, ValueError) as exc:
            raise StartupError(f"--expert-placement {placement}: {exc}") from exc
        return
    if ep_size > num_experts:
        raise StartupError(
            f"--ep-size {ep_size} is more ranks than the model's {num_experts} experts "
            f"(num_experts {num_experts}); use at most {num_experts}"
        )
    if num_experts % ep_size and config.parallel.expert_placement is None:
        raise StartupError(
            f"--ep-size {ep_size} does not divide num_experts {num_experts}; choose an "
            f"ep_size that divides {num_experts}"
        )
