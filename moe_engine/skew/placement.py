"""Expert placement files: the `Placement` type, its JSON form, and the share matrix.

Placement files are what `comm.placement.ExpertPlacement` reads (and validates here):
`{"version": 1, "num_experts": E, "ep_size": N, "slots": [[expert ids of rank 0], ...]}`.
The engine uses one placement for every MoE layer (what `moe-serve --expert-placement`
serves). A planner run with `per_layer=True` (`moe_engine.skew.planner`) additionally stores
per-layer slots under `"layers": {"<decoder layer>": slots}`: a what-if for per-layer placement
(DeepSeek's EPLB plans per layer). `ExpertPlacement` ignores that key, so the engine still
serves `"slots"`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from comm.placement import PLACEMENT_VERSION, ExpertPlacement

Slots = list[list[int]]


class PlacementError(ValueError):
    """An impossible plan request or an invalid placement file."""


def contiguous_slots(num_experts: int, ep_size: int) -> Slots:
    """The default placement (DESIGN.md section 6): rank r holds experts [r * E/N, (r+1) * E/N).

    Raises:
        PlacementError: N does not divide E, or a size < 1.
    """
    try:
        default = ExpertPlacement.contiguous(num_experts, ep_size)
    except ValueError as exc:
        raise PlacementError(str(exc)) from exc
    return [list(row) for row in default.slots]


def share_matrix(slots: Slots, num_experts: int) -> np.ndarray:
    """[E, N] float64: the fraction of expert e's tokens that rank r processes.

    M[e, r] = (replicas of e on r) / (replicas of e); rank loads are `load @ M`.

    Raises:
        PlacementError: an expert id out of range, or an expert with no slot.
    """
    matrix = np.zeros((num_experts, len(slots)), dtype=np.float64)
    for r, rank_slots in enumerate(slots):
        for e in rank_slots:
            if not 0 <= e < num_experts:
                raise PlacementError(f"expert id {e} on rank {r} is outside [0, {num_experts})")
            matrix[e, r] += 1
    replicas = matrix.sum(axis=1, keepdims=True)
    if (replicas == 0).any():
        missing = np.flatnonzero(replicas[:, 0] == 0).tolist()
        raise PlacementError(f"experts {missing} have no slot on any rank")
    return matrix / replicas


@dataclass
class Placement:
    """A placement of E experts (with replicas) on N ranks.

    Attributes:
        num_experts: E.
        slots: N lists of global expert ids (rank r's local experts in order).
        layers: optional per-MoE-layer slots, keyed by decoder-layer index.
    """

    num_experts: int
    slots: Slots
    layers: dict[int, Slots] = field(default_factory=dict)

    @property
    def ep_size(self) -> int:
        return len(self.slots)

    @property
    def num_redundant(self) -> int:
        return sum(len(s) for s in self.slots) - self.num_experts

    def slots_for(self, layer: int) -> Slots:
        """The slots that decoder layer `layer` uses (its own, else the shared ones)."""
        return self.layers.get(layer, self.slots)

    def to_json(self) -> dict[str, Any]:
        """The placement-file object (module docstring)."""
        obj: dict[str, Any] = dict(
            version=PLACEMENT_VERSION,
            num_experts=self.num_experts,
            ep_size=self.ep_size,
            slots=[list(map(int, s)) for s in self.slots],
        )
        if self.layers:
            obj["layers"] = {str(k): [list(map(int, s)) for s in v] for k, v in self.layers.items()}
        return obj

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the placement file (JSON, one line per rank's slots for readability)."""
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, obj: Any, source: str = "placement") -> Placement:
        """Parse and check a placement-file object; the shared slots (and each layer's) are
        validated by the engine's loader, `comm.placement.ExpertPlacement.from_dict`.

        Raises:
            PlacementError: not an object, a missing key, another version, or invalid slots
                (uneven ranks, unknown or missing experts, an expert twice on one rank); the
                message starts with `source`.
        """
        if not isinstance(obj, dict):
            raise PlacementError(f"{source}: must be a JSON object, got {type(obj).__name__}")
        try:
            shared = ExpertPlacement.from_dict(obj, source=source)
        except (ValueError, TypeError) as exc:
            raise PlacementError(str(exc)) from exc
        num_experts, ep_size = shared.num_experts, shared.ep_size
        layers_obj = obj.get("layers") or {}
        if not isinstance(layers_obj, dict):
            raise PlacementError(f"{source}: layers must be an object {{decoder layer: slots}}")
        layers = {}
        for key, value in layers_obj.items():
            try:
                layer = int(key)
            except ValueError as exc:
                raise PlacementError(f"{source}: layers key {key!r} is not a layer index") from exc
            layers[layer] = _check_slots(value, num_experts, ep_size, f"{source}: layers[{key}]")
        return cls(num_experts, [list(row) for row in shared.slots], layers)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Placement:
        """Read a placement file.

        Raises:
            PlacementError: unreadable, not JSON, or invalid (see `from_json`).
        """
        try:
            obj = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise PlacementError(f"cannot read placement file {str(path)!r}: {exc}") from exc
        return cls.from_json(obj, source=str(path))


def _check_slots(value: Any, num_experts: int, ep_size: int, where: str) -> Slots:
    """Validate one slot table with the engine's own loader (`comm.placement.ExpertPlacement`)."""
    if not isinstance(value, list):
        raise PlacementError(f"{where} must be a list of per-rank lists of expert ids")
    try:
        checked = ExpertPlacement(num_experts, ep_size, value)
    except (ValueError, TypeError) as exc:
        raise PlacementError(f"{where}: {exc}") from exc
    return [list(row) for row in checked.slots]
