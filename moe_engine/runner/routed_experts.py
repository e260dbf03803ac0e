"""Routing replay in the runner: the device capture attached to the main model's MoE layers,
the per-KV-slot host store, and the per-step hand-over between them.

`RoutingReplay.attach` gives every MoE layer of the main model (`MoeCausalLM.moe_layers()`:
the decoder layers only, never the MTP/draft layers, which compute no token of the request)
one row of a `RoutedExpertsCapture`; after each step's forward `store_step` reads the step's
rows back once and writes them at the step's slots of the chosen KV-cache group
(`kv_cache.routed_experts`, whose docstring says what prefix caching, preemption, speculation
and parallel sampling do to them); `gather` returns one request's `[0, seqlen - 1)` rows
while it still holds its blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from moe_engine.kv_cache import KVCacheManager, KVCacheSpec
from moe_engine.kv_cache.routed_experts import RoutedExpertsStore, choose_group
from moe_engine.models import MoeCausalLM
from moe_engine.request import Request
from moe_engine.routing_capture import RoutedExpertsCapture
from moe_engine.scheduler import ScheduledRequest

logger = logging.getLogger(__name__)


class RoutingReplay:
    """What `--enable-return-routed-experts` adds to one rank's runner.

    Args:
        model: the loaded model (its `moe_layers()` are recorded, in that order: row r of the
            layer axis is the r-th MoE layer).
        specs: the KV-cache groups' specs (the store takes the first that keeps every block,
            `choose_group`).
        num_slots: the KV cache's slots ((physical blocks + 1) * block_size).
        block_size: tokens per block; capacity: token rows of the device buffer at first (the
            largest step).
        device: the model's device.

    Raises:
        ValueError: a model without MoE layers, or without a KV-cache group that keeps every
            block (`choose_group`).
    """

    def __init__(self, model: MoeCausalLM, specs: Sequence[KVCacheSpec], num_slots: int,
                 block_size: int, capacity: int, device) -> None:
        layers = [moe for _, moe in model.moe_layers()]
        if not layers:
            raise ValueError("--enable-return-routed-experts: the model has no MoE layers")
        top_k = max(moe.top_k for moe in layers)
        scored = max(moe.num_experts + moe.zero_experts for moe in layers)
        self.capture = RoutedExpertsCapture(len(layers), top_k, scored, capacity, device)
        dtype = np.dtype(np.int16 if self.capture.buffer.element_size() == 2 else np.int32)
        self.store = RoutedExpertsStore(num_slots, len(layers), top_k, dtype, block_size,
                                        choose_group(specs))
        self.layers = layers
        self.attach()

    @property
    def num_layers(self) -> int:
        """L, the recorded MoE layers."""
        return self.capture.num_layers

    @property
    def top_k(self) -> int:
        """k, experts per token in the returned arrays."""
        return self.capture.top_k

    def attach(self) -> None:
        """(Re)attach the capture to the MoE layers (after `detach`)."""
        for row, moe in enumerate(self.layers):
            moe.attach_routed_capture(self.capture, row)

    def detach(self) -> None:
        """Stop recording (forwards that serve no request: the profile run)."""
        for moe in self.layers:
            moe.attach_routed_capture(None)

    def describe(self) -> str:
        """One line for the startup log: the store's shape, dtype, bytes and group."""
        rows = self.store.rows
        return (f"routed experts: host store [{rows.shape[0]} slots, {rows.shape[1]} MoE "
                f"layers, top_k {rows.shape[2]}] {rows.dtype}, {self.store.nbytes / 2**20:.1f} "
                f"MiB, indexed by KV-cache group {self.store.group}'s slots; device buffer "
                f"[{self.capture.capacity}, {rows.shape[1]}, {rows.shape[2]}]")

    def store_step(self, ordered: Sequence[ScheduledRequest],
                   tables: Sequence[Sequence[Sequence[int]]]) -> None:
        """Keep the step's routing (call after the step's forward): one device-to-host copy
        of its T rows, written at the tokens' slots.

        Args:
            ordered: the step's requests in row order (their tokens are contiguous rows).
            tables: per KV-cache group, per request of `ordered`, its block table.
        """
        slots = self.store.slot_mapping(
            [s.start for s in ordered], [s.num_tokens for s in ordered],
            tables[self.store.group],
        )
        if slots.size:
            self.store.write(slots, self.capture.take(slots.size))

    def gather(self, kv: KVCacheManager, req: Request) -> np.ndarray:
        """The request's routing for positions [0, n), n = min(seqlen - 1, its computed
        tokens): [n, L, k] int32 (call while it still holds its blocks)."""
        n = min(req.num_tokens - 1, req.num_computed_tokens)
        if n <= 0 or req.request_id not in kv.block_tables:  # aborted before it ran
            return np.zeros((0, self.num_layers, self.top_k), dtype=np.int32)
        return self.store.gather(kv.block_table(req.request_id, self.store.group), n)
