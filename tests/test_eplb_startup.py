"""EPLB settings refused at startup (issue 45: "bad settings are refused at startup naming the
flag and the limit"), and the placement an EPLB engine serves first.

The checks run on their functions directly (no model load), plus `moe-serve`'s `main` in this
process for the refusals that come before the checkpoint is read and one through the real
checkpoint check, and one `moe-serve` subprocess: exit 1, one line, no traceback.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from comm import ExpertPlacement
from moe_engine.cli.serve import build_parser, eplb_config_from_args
from moe_engine.eplb.placement import redundant_slots, starting_placement
from moe_engine.errors import StartupError
from moe_engine.startup.checks import check_ep_size, check_eplb_kernels, needs_ep_check
from moe_engine.startup.config import EngineConfig, EplbConfig, ModelConfig, ParallelConfig

REPO = Path(__file__).resolve().parents[1]


def _config(ep_size: int, placement: str | None = None, **eplb) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model="unused"),
        parallel=ParallelConfig(ep_size=ep_size, expert_placement=placement),
        eplb=EplbConfig(**eplb),
    )


@pytest.mark.parametrize(
    ("ep_size", "eplb", "expected"),
    [
        (1, dict(enabled=True), ["--enable-eplb", "--ep-size"]),
        (2, dict(enabled=True, num_redundant_experts=3),
         ["--num-redundant-experts 3", "multiple of --ep-size 2"]),
        # 8 experts on 2 ranks: at most 8 * (2 - 1) = 8 redundant
        (2, dict(enabled=True, num_redundant_experts=10),
         ["--num-redundant-experts 10", "at most", "= 8"]),
        (4, dict(enabled=True, num_redundant_experts=28),
         ["--num-redundant-experts 28", "= 24"]),
        (2, dict(num_redundant_experts=2), ["--num-redundant-experts 2", "--enable-eplb"]),
    ],
)
def test_bad_eplb_settings_refused_naming_flag_and_limit(
    ep_size: int, eplb: dict, expected: list[str]
) -> None:
    config = _config(ep_size, **eplb)
    assert needs_ep_check(config)
    with pytest.raises(StartupError) as info:
        check_ep_size(config, num_experts=8)
    message = str(info.value)
    assert "\n" not in message
    for part in expected:
        assert part in message, message


@pytest.mark.parametrize(("ep_size", "redundant"), [(2, 0), (2, 2), (2, 8), (4, 24)])
def test_good_eplb_settings_pass(ep_size: int, redundant: int) -> None:
    check_ep_size(_config(ep_size, enabled=True, num_redundant_experts=redundant), 8)


def test_placement_file_must_hold_the_redundant_slots(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    ExpertPlacement(8, 2, [[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]]).save(path)
    check_ep_size(_config(2, str(path), enabled=True, num_redundant_experts=2), 8)
    with pytest.raises(StartupError) as info:
        check_ep_size(_config(2, str(path), enabled=True), 8)
    message = str(info.value)
    assert "holds 5 slots per rank" in message and "= 4" in message, message
    assert "--num-redundant-experts 0" in message, message


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--eplb-step-interval", "0"], "--eplb-step-interval must be >= 1, got 0"),
        (["--eplb-window-steps", "0"], "--eplb-window-steps must be >= 1, got 0"),
        (["--eplb-balancedness-threshold", "1.5"], "--eplb-balancedness-threshold"),
        (["--num-redundant-experts", "-2"], "--num-redundant-experts must be >= 0"),
        (["--eplb-move-mib-per-step", "0"], "--eplb-move-mib-per-step must be at least one byte"),
    ],
)
def test_out_of_range_flags_name_the_flag(argv: list[str], expected: str) -> None:
    args = build_parser().parse_args(["--enable-eplb", *argv])
    with pytest.raises(ValueError, match=expected):
        eplb_config_from_args(args)


@pytest.mark.parametrize(
    "argv",
    [["--num-redundant-experts", "2"], ["--eplb-step-interval", "5"],
     ["--eplb-window-steps", "5"], ["--eplb-balancedness-threshold", "0.5"],
     ["--eplb-move-mib-per-step", "4.0"]],
)
def test_eplb_flags_without_enable_eplb_are_refused(argv: list[str]) -> None:
    args = build_parser().parse_args(argv)
    with pytest.raises(ValueError, match=f"{argv[0]} {argv[1]} needs --enable-eplb"):
        eplb_config_from_args(args)


def test_flags_fill_the_config() -> None:
    args = build_parser().parse_args(
        ["--enable-eplb", "--eplb-window-steps", "7", "--eplb-step-interval", "3",
         "--num-redundant-experts", "4", "--eplb-balancedness-threshold", "1.0",
         "--eplb-move-mib-per-step", "0.5"])
    assert eplb_config_from_args(args) == EplbConfig(True, 7, 3, 4, 1.0, 0.5)
    assert eplb_config_from_args(build_parser().parse_args([])) == EplbConfig()
    defaults = eplb_config_from_args(build_parser().parse_args(["--enable-eplb"]))
    assert defaults == EplbConfig(enabled=True)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--ep-size", "2", "--eplb-step-interval", "0", "--enable-eplb"],
         "--eplb-step-interval must be >= 1, got 0"),
        (["--enable-eplb"], "--enable-eplb needs --ep-size > 1"),
        (["--ep-size", "2", "--enable-eplb", "--num-redundant-experts", "10"],
         "at most num_experts * (ep_size - 1) = 8 * 1 = 8"),
    ],
)
def test_moe_serve_exits_1_with_one_line(
    qwen3_ckpt: Path, capsys, argv: list[str], expected: str
) -> None:
    from moe_engine.cli.serve import main

    started = time.monotonic()
    status = main(["--model", str(qwen3_ckpt), "--port", "0", *argv])
    err = capsys.readouterr().err
    assert status == 1, err
    assert expected in err and "Traceback" not in err, err
    assert time.monotonic() - started < 30  # refused before any rank starts


def test_moe_serve_subprocess_refuses_eplb_at_ep_1(qwen3_ckpt: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "moe_engine.cli.serve", "--model", str(qwen3_ckpt),
         "--port", "0", "--enable-eplb"],
        capture_output=True, text=True, timeout=120, cwd=REPO,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 1, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert lines == [
        "moe-serve: error: --enable-eplb needs --ep-size > 1 (got --ep-size 1): with one "
        "rank every expert is already on it, there is nothing to balance"
    ], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("backend", "fmt", "refused"),
    [("torch", "int4", True), ("auto,fused_moe_int4=torch", "int4", True),
     ("auto", "int4", False), ("torch", "mxfp4", False), ("torch", "none", False),
     ("native-cpu,fused_moe_int4=native-cpu", "int4", False)],
)
def test_int4_on_torch_kernels_refused_naming_kernel_backend(
    backend: str, fmt: str, refused: bool
) -> None:
    config = EngineConfig(model=ModelConfig(model="unused"), kernel_backend=backend,
                          parallel=ParallelConfig(ep_size=2), eplb=EplbConfig(enabled=True))
    if not refused:
        check_eplb_kernels(config, "cpu", fmt)
        return
    with pytest.raises(StartupError, match=f"--kernel-backend {backend}") as info:
        check_eplb_kernels(config, "cpu", fmt)
    assert "fused_moe_int4" in str(info.value)
    check_eplb_kernels(config, "cuda", fmt)  # the triton layout gives the codes back


def test_moe_serve_refuses_int4_on_torch_with_eplb(qwen3_ckpt: Path, capsys) -> None:
    from moe_engine.cli.serve import main

    status = main(["--model", str(qwen3_ckpt), "--port", "0", "--ep-size", "2",
                   "--enable-eplb", "--quantization", "int4", "--quant-group-size", "32",
                   "--kernel-backend", "torch"])
    err = capsys.readouterr().err
    assert status == 1 and "--kernel-backend torch" in err and "Traceback" not in err, err


# ------------------------------------------------------------------ the starting placement


@pytest.mark.parametrize(("num_experts", "ep_size", "redundant"),
                         [(8, 2, 2), (8, 2, 8), (8, 4, 4), (8, 4, 24), (16, 4, 8)])
def test_redundant_slots_fill_every_slot_with_a_replica(
    num_experts: int, ep_size: int, redundant: int
) -> None:
    slots = redundant_slots(num_experts, ep_size, redundant)
    placement = ExpertPlacement(num_experts, ep_size, slots)  # validates: no twice per rank
    per_rank = num_experts // ep_size
    assert placement.num_local_experts == per_rank + redundant // ep_size
    for rank, row in enumerate(slots):
        assert row[:per_rank] == list(range(rank * per_rank, (rank + 1) * per_rank))
    # every expert that has a replica is held by more than one rank: every extra slot serves
    held = [sum(e in row for row in slots) for e in range(num_experts)]
    assert sum(held) == num_experts + redundant and max(held) <= ep_size


def test_redundant_slots_take_the_next_ranks_first_experts() -> None:
    assert redundant_slots(8, 2, 2) == [[0, 1, 2, 3, 4], [4, 5, 6, 7, 0]]
    assert redundant_slots(8, 4, 4) == [[0, 1, 2], [2, 3, 4], [4, 5, 6], [6, 7, 0]]


def test_starting_placement_file_wins_over_redundant(tmp_path: Path) -> None:
    path = tmp_path / "placement.json"
    given = ExpertPlacement(8, 2, [[0, 1, 2, 3, 7], [4, 5, 6, 7, 0]])
    given.save(path)
    assert starting_placement(8, 2, 2, str(path)) == given
    assert starting_placement(8, 2, 0) == ExpertPlacement.contiguous(8, 2)
    assert starting_placement(8, 2, 2).slots == ((0, 1, 2, 3, 4), (4, 5, 6, 7, 0))
