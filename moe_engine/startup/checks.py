"""Configuration checks that need the checkpoint's shape, run before any process starts.

Each takes what it needs (the expert count from the caller's `ModelShape`) rather than reading
the model here: `startup/` never imports `models/` (DESIGN.md section 3).
"""

from __future__ import annotations

from moe_engine.errors import StartupError
from moe_engine.startup.config import EngineConfig


def needs_ep_check(config: EngineConfig) -> bool:
    """Whether `check_ep_size` has anything to check (callers then read config.json for
    `num_experts`): more than one rank, a placement file, or any EPLB setting."""
    eplb = config.eplb
    return (config.parallel.ep_size > 1 or config.parallel.expert_placement is not None
            or eplb.enabled or eplb.num_redundant_experts > 0)


def check_eplb(config: EngineConfig, num_experts: int, placement_slots: int | None) -> None:
    """Fail fast on EPLB settings the ranks cannot serve (`EplbConfig` checked the ranges).

    Args:
        config: the engine configuration (`eplb`, `parallel.ep_size`).
        num_experts: E, the checkpoint's routed experts per MoE layer.
        placement_slots: slots per rank of the --expert-placement file, None without one.

    Raises:
        StartupError: naming the flag and the limit: --enable-eplb at ep_size 1;
            --num-redundant-experts without --enable-eplb (vLLM refuses it too), not a
            multiple of ep_size, or more than the ranks can hold (num_experts *
            (ep_size - 1): an expert at most once per rank); a placement file whose slots
            per rank differ from (E + R) / N.
    """
    eplb, ep_size = config.eplb, config.parallel.ep_size
    redundant = eplb.num_redundant_experts
    if not eplb.enabled:
        if redundant:
            raise StartupError(
                f"--num-redundant-experts {redundant} needs --enable-eplb (redundant slots "
                "are filled and moved by EPLB; a static placement file lists its own replicas)")
        return
    if ep_size == 1:
        raise StartupError(
            "--enable-eplb needs --ep-size > 1 (got --ep-size 1): with one rank every expert "
            "is already on it, there is nothing to balance")
    if redundant % ep_size:
        raise StartupError(
            f"--num-redundant-experts {redundant} must be a multiple of --ep-size {ep_size} "
            "(every rank holds the same number of extra slots)")
    most = num_experts * (ep_size - 1)
    if redundant > most:
        raise StartupError(
            f"--num-redundant-experts {redundant} is more than {ep_size} ranks can hold: at "
            f"most num_experts * (ep_size - 1) = {num_experts} * {ep_size - 1} = {most} (an "
            "expert is held at most once per rank)")
    if placement_slots is not None and placement_slots * ep_size != num_experts + redundant:
        raise StartupError(
            f"--expert-placement {config.parallel.expert_placement} holds {placement_slots} "
            f"slots per rank, but --enable-eplb with --num-redundant-experts {redundant} "
            f"serves (num_experts + R) / ep_size = ({num_experts} + {redundant}) / {ep_size} "
            f"= {(num_experts + redundant) / ep_size:g}: the file is the starting placement "
            "and must hold that many")


def check_routing_replay(config: EngineConfig) -> None:
    """--enable-return-routed-experts where it cannot work, refused before anything loads.

    Raises:
        StartupError: on a decode instance of a prefill/decode split (its prompts ran on the
            prefill instance, so it has no record of their routing).
    """
    if config.enable_return_routed_experts and config.disagg.mode == "decode":
        raise StartupError(
            "--enable-return-routed-experts: a decode instance (--disaggregation-mode decode) "
            "receives its prompts' K/V from a prefill instance and has no record of their "
            "routing; serve routing replay without disaggregation"
        )


def check_ep_size(config: EngineConfig, num_experts: int) -> None:
    """Fail fast, before any rank starts, on an ep_size the checkpoint's experts cannot split
    or a placement file that does not fit it.

    With ep_size 1, no placement file and no EPLB setting there is nothing to check: callers
    may skip the call (and reading config.json for `num_experts`; `needs_ep_check`).

    Args:
        config: the engine configuration (`parallel.ep_size`, `parallel.expert_placement`).
        num_experts: the checkpoint's routed experts per MoE layer (`ModelShape.num_experts`).

    Raises:
        StartupError: ep_size larger than num_experts, or not dividing it (without a placement
            file), naming both numbers; a placement file that is missing, malformed or made
            for another model or ep size, or given with ep_size 1; the EPLB settings
            `check_eplb` refuses.
    """
    ep_size = config.parallel.ep_size
    placement = config.parallel.expert_placement
    if placement is None:
        check_eplb(config, num_experts, None)
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
            loaded = ExpertPlacement.load(placement)
            loaded.check(num_experts, ep_size)
        except (OSError, ValueError) as exc:
            why = str(exc).removeprefix(f"{placement}: ")  # `load` names the file itself
            raise StartupError(f"--expert-placement {placement}: {why}") from exc
        check_eplb(config, num_experts, loaded.num_local_experts)
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


def check_eplb_kernels(config: EngineConfig, device: str, expert_format: str) -> None:
    """Fail fast when --enable-eplb meets 4-bit experts on a kernel backend whose layout cannot
    be moved: torch's int4 CPU layout (`torch._weight_int4pack_mm_for_cpu`) rounds the codes
    and cannot give the stored ones back, and EPLB moves experts packed, as stored (the rank
    would refuse later, when its mover is built: `eplb.layer_experts.LayerExperts`).

    Args:
        config: the engine configuration (`eplb.enabled`, `kernel_backend`).
        device: the resolved device, "cpu" or "cuda".
        expert_format: the experts' resolved 4-bit format ("none", "int4", "mxfp4").

    Raises:
        StartupError: naming --kernel-backend and the op.
    """
    if not config.eplb.enabled or device != "cpu" or expert_format != "int4":
        return
    from kernels.plan import EXPERT_OPS
    from kernels.registry import parse_kernel_backend

    op = EXPERT_OPS["int4"]
    default, per_op = parse_kernel_backend(config.kernel_backend)
    if per_op.get(op, default) == "torch":
        raise StartupError(
            f"--enable-eplb with --kernel-backend {config.kernel_backend}: EPLB moves int4 "
            f"experts packed, as stored, and the torch backend of {op} on cpu keeps them in a "
            f"layout that cannot be given back; serve {op} on native-cpu "
            f"(--kernel-backend ...,{op}=native-cpu) or without --enable-eplb")
