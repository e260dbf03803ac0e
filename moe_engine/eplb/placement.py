"""The placement an EPLB engine serves first: contiguous experts plus the redundant slots.

With `--num-redundant-experts R` and no `--expert-placement` file, rank r holds its contiguous
range of E / N experts and then R / N extra slots, filled with the experts that follow its
range, starting at rank r + 1's first expert and wrapping around (rank N - 1's extras hold rank
0's first experts). Every slot holds a replica of an expert another rank also holds, so every
slot serves tokens from the first step (`ExpertPlacement.route` shares an expert's pairs
evenly among its replicas) until the first rebalance puts the replicas where the load is.
"""

from __future__ import annotations

from comm import ExpertPlacement


def redundant_slots(num_experts: int, ep_size: int, num_redundant: int) -> list[list[int]]:
    """Rank r's slots: experts [r * E/N, (r+1) * E/N), then R/N of the following experts.

    Args:
        num_experts: E; ep_size: N (dividing E); num_redundant: R, a multiple of N, at most
            E * (N - 1) (then every rank can take R / N experts it does not hold yet).

    Returns:
        N lists of E/N + R/N distinct global expert ids (slot order: the rank's own range,
        then its extras).

    Raises:
        ValueError: N not dividing E or R, or R over E * (N - 1), naming the numbers.
    """
    if ep_size < 1 or num_experts % ep_size:
        raise ValueError(f"ep_size {ep_size} does not divide num_experts {num_experts}")
    if num_redundant < 0 or num_redundant % ep_size:
        raise ValueError(
            f"num_redundant_experts {num_redundant} is not a multiple of ep_size {ep_size}")
    if num_redundant > num_experts * (ep_size - 1):
        raise ValueError(
            f"num_redundant_experts {num_redundant} is over num_experts * (ep_size - 1) = "
            f"{num_experts * (ep_size - 1)}")
    per_rank, extra = num_experts // ep_size, num_redundant // ep_size
    slots = []
    for rank in range(ep_size):
        start = rank * per_rank
        own = list(range(start, start + per_rank))
        # the experts after this rank's range, wrapping around: never one it holds already
        following = [(start + per_rank + i) % num_experts
                     for i in range(num_experts - per_rank)]
        slots.append(own + following[:extra])
    return slots


def starting_placement(
    num_experts: int, ep_size: int, num_redundant: int = 0, path: str | None = None
) -> ExpertPlacement:
    """The placement served at startup: the --expert-placement file when given (checked to fit
    the model and the ranks), else contiguous with `num_redundant` extra slots
    (`redundant_slots`).

    Raises:
        ValueError, OSError: a file that cannot be read or does not fit; impossible numbers.
    """
    if path:
        placement = ExpertPlacement.load(path)
        placement.check(num_experts, ep_size)
        return placement
    if num_redundant == 0:
        return ExpertPlacement.contiguous(num_experts, ep_size)
    return ExpertPlacement(num_experts, ep_size, redundant_slots(num_experts, ep_size,
                                                                 num_redundant))
