"""Moving experts' weights between ranks while serving: the weight-movement half of runtime
EPLB (issue 45; the controller that decides when and where is `eplb/controller`'s part).

Protocol, on every rank of the expert-parallel group, in the same lockstep iteration each time
(between two forward steps, never inside one):

    mover.begin(old, new)      # the schedule; nothing moves
    while not mover.step():    # one chunk per iteration; forward steps run in between
        ...
    stats = mover.commit()     # every layer at once; serves `new` from the next step

- **Schedule** (`eplb.schedule`): the same on every rank from (old, new) alone; unchanged
  slots stay, an expert the rank already holds is copied locally, any other comes from one old
  holder (the least-loaded, then lowest rank).
- **Chunks**: each `step` moves the next chunk of (layer, expert) copies, at most about
  `max_bytes_per_step` bytes sent and at most that much received plus copied locally per rank,
  with ONE `all_to_all_single` of uint8 bytes over `group` (split sizes per rank, as
  `comm/torch_a2a.py` moves tokens; gloo on CPU, NCCL on GPU). Every rank makes that call in
  every step that has a transfer anywhere, with empty splits when it has nothing to send or
  receive; a chunk of local copies only makes no call on any rank. A rank that dies mid-move
  makes the others' collective raise within the group's timeout, as a dead rank does in a
  forward step.
- **Staging** (`eplb.layer_experts`): a moved expert lands in a staging tensor per layer and
  field of [changed slots of this rank, ...] beside the serving weights, which do not change
  until `commit`. Memory: changed slots x expert bytes per layer (allocated when the layer's
  first copy lands, freed at commit), plus one send and one receive buffer of at most
  ~max_bytes_per_step; 4-bit layers on native-cpu also unpack one layer's canonical copy
  while sending from it, and again at commit (one layer at a time).
- **Commit**: per layer, the staged rows are written into the serving tensors in place, the
  layer's slot map is updated (`FusedMoE.set_local_experts`) and its kernels rebound (the
  given native decode layers' one-call kernels too, `native_decode.attach_decode_kernel`);
  then the communicator routes by the new placement (`Communicator.set_placement`). A failure
  inside commit leaves the layers half-written: the caller ends the engine (as an in-place
  weight update does).

Bytes of one expert of one layer (`LayerExperts.expert_bytes`): float 3·I·H x dtype bytes
(w13 2I x H, w2 H x I; + (2I + H) x dtype with biases); int4 with group G: 3·I·H/2 bytes of
codes + 3·I·H/G scales x scale bytes (+ 3·I·H/G bytes of zero points where stored); MXFP4:
3·I·H/2 + 3·I·H/32 bytes; biases as float. A move sends each transferred expert once per
layer; local copies cross no wire. At the tests' tiny size (H 32, I 16, float32, biases) an
expert is 6,400 bytes per layer; Qwen3-30B-A3B's (H 2048, I 768, bf16) 9.0 MiB per layer.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from comm.base import Communicator
from comm.placement import ExpertPlacement
from kernels.plan import KernelPlan
from moe_engine.eplb.layer_experts import LayerExperts
from moe_engine.eplb.schedule import MoveSchedule, Unit, chunk_moves, plan_moves
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.native_decode import attach_decode_kernel

#: Default per-rank bytes per step (sent, and received plus copied): 64 MiB.
DEFAULT_MAX_BYTES_PER_STEP = 64 << 20


@dataclass
class MoveStats:
    """One move, as this rank saw it.

    Attributes:
        experts_moved: (layer, slot) entries whose expert changed, over all MoE layers.
        bytes_sent, bytes_received: bytes this rank sent / received over the device group
            (local copies not counted).
        transfer_s: wall seconds spent in this move's `step` calls.
        commit_s: wall seconds of `commit`.
        steps: `step` calls that moved something.
    """

    experts_moved: int
    bytes_sent: int
    bytes_received: int
    transfer_s: float
    commit_s: float
    steps: int


@dataclass
class _Move:
    """A move in progress: its placements, schedule, chunks and what has landed."""

    old: ExpertPlacement
    new: ExpertPlacement
    schedule: MoveSchedule
    chunks: list[list[Unit]]
    slots: list[int]  # this rank's changed slots (staging rows in this order)
    last_source_chunk: dict[int, int]  # layer -> the last chunk reading its serving weights
    next_chunk: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    transfer_s: float = 0.0

    @property
    def done(self) -> bool:
        return self.next_chunk == len(self.chunks)


class ExpertMover:
    """Moves the experts of `moes` from one placement to another (module doc).

    Args:
        moes: every MoE layer of the model on this rank that routes through `communicator`
            (MTP / draft layers included: a layer left out would keep its old slots while the
            communicator routes by the new placement), sharded by the serving placement and
            bound to `plan`.
        communicator: the layers' communicator (each layer's `communicator` must be it).
        rank: this rank in `group`.
        group: the device group the weights travel over (None: the default group).
        plan: the kernel plan the layers were bound with (they are bound again with it).
        max_bytes_per_step: per rank and step, the most bytes sent, and the most bytes
            received plus copied locally (an expert larger than that travels alone).
        decoder_layers: decoder layers whose native decode kernel (`layer.decode_kernel`)
            holds a moved layer's packed experts; their kernel is attached again at commit.
            (Expert-parallel layers never take it today: `native_decode.decode_misfit`.)

    Construction reads every 4-bit layer's stored layout once (on native-cpu an unpacked
    copy of one layer at a time, dropped at once): the check that it can be moved.

    Raises:
        ValueError: no layers, a layer on another communicator, layers of different slot
            counts, max_bytes_per_step below 1, or 4-bit experts whose kernel backend cannot
            give their stored layout back (`LayerExperts`: names the backend).
    """

    def __init__(
        self,
        moes: Sequence[FusedMoE],
        communicator: Communicator,
        rank: int,
        group: dist.ProcessGroup | None,
        plan: KernelPlan,
        *,
        max_bytes_per_step: int = DEFAULT_MAX_BYTES_PER_STEP,
        decoder_layers: Sequence[nn.Module] = (),
    ) -> None:
        if not moes:
            raise ValueError("ExpertMover needs at least one MoE layer")
        if max_bytes_per_step < 1:
            raise ValueError(f"max_bytes_per_step must be at least 1, got {max_bytes_per_step}")
        for moe in moes:
            if moe.communicator is not communicator:
                raise ValueError(
                    f"MoE layer {moe.layer_index} routes through another communicator than the "
                    "one the mover swaps placements on"
                )
        slot_counts = sorted({len(moe.local_experts) for moe in moes})
        if len(slot_counts) != 1:
            raise ValueError(f"MoE layers hold different slot counts {slot_counts} per rank")
        self.moes, self.communicator, self.rank, self.group = list(moes), communicator, rank, group
        self.plan, self.max_bytes_per_step = plan, max_bytes_per_step
        self.decoder_layers = list(decoder_layers)
        self.world_size = dist.get_world_size(group) if dist.is_initialized() else 1
        self.layers = [LayerExperts(moe) for moe in self.moes]
        self._move: _Move | None = None
        self._staging: dict[int, dict[str, torch.Tensor]] = {}
        self._sources: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def busy(self) -> bool:
        """A move begun and not yet committed."""
        return self._move is not None

    def begin(self, old: ExpertPlacement, new: ExpertPlacement) -> None:
        """Work out the move from `old` (serving) to `new`; nothing moves yet. Every rank, same
        arguments, same iteration.

        Raises:
            ValueError: a move already in progress; placements of another ep_size (than the
                group), num_experts (than the layers) or slots per rank (than the layers);
                `old` not the placement the layers serve on this rank.
        """
        if self._move is not None:
            raise ValueError("an expert move is already in progress: commit it first")
        moe = self.moes[0]
        old.check(moe.num_experts, self.world_size)
        old.check_swap(new)
        if old.num_local_experts != len(moe.local_experts):
            raise ValueError(
                f"the placements hold {old.num_local_experts} slots per rank, the serving "
                f"layers {len(moe.local_experts)}"
            )
        for m in self.moes:
            if m.local_experts != old.local_experts(self.rank):
                raise ValueError(
                    f"MoE layer {m.layer_index} serves experts {m.local_experts} on rank "
                    f"{self.rank}, the old placement says {old.local_experts(self.rank)}"
                )
        schedule = plan_moves(old, new)
        chunks = chunk_moves(schedule, [layer.expert_bytes for layer in self.layers],
                             self.max_bytes_per_step)
        last_source = {layer: i for i, chunk in enumerate(chunks)
                       for layer, copy in chunk if copy.src_rank == self.rank}
        self._move = _Move(old, new, schedule, chunks, schedule.changed_slots(self.rank),
                           last_source)

    def step(self) -> bool:
        """Send and receive the next chunk over `group` and stage it. Every rank, same
        iteration. Returns True once everything is staged (then `commit`, same iteration,
        every rank); further calls return True and do nothing.

        Raises:
            RuntimeError: no move begun; a collective error (a rank died or timed out).
        """
        move = self._move
        if move is None:
            raise RuntimeError("step() without begin(): no expert move in progress")
        if move.done:
            return True
        start = time.perf_counter()
        self._run_chunk(move, move.chunks[move.next_chunk])
        for layer, last in move.last_source_chunk.items():
            if last == move.next_chunk:
                self._sources.pop(layer, None)  # a native-cpu 4-bit layer's unpacked copy
        move.next_chunk += 1
        move.transfer_s += time.perf_counter() - start
        return move.done

    def commit(self) -> MoveStats:
        """Swap the staged experts in on every layer, update the slot maps, route by the new
        placement and rebind the kernels. Every rank, same iteration.

        Raises:
            RuntimeError: no move begun, or `step` has not returned True yet.
            ValueError: the communicator refuses the new placement (`set_placement`, e.g.
                the no-op communicator and a non-contiguous one); nothing changed, the move
                is still staged (`cancel` drops it).
        """
        move = self._move
        if move is None or not move.done:
            raise RuntimeError("commit() before step() returned True: the move is not staged")
        start = time.perf_counter()
        self.communicator.set_placement(move.new)  # first: a refusal leaves the layers as they are
        local = move.new.local_experts(self.rank)
        for index, layer in enumerate(self.layers):
            if move.slots:
                layer.commit(move.slots, self._staging.pop(index), self.plan)
            layer.moe.set_local_experts(local)
        moved = {id(moe) for moe in self.moes} if move.slots else set()
        for decoder in self.decoder_layers:
            if id(getattr(decoder, "mlp", None)) in moved:
                attach_decode_kernel(decoder, self.plan)
        self._move, self._staging, self._sources = None, {}, {}
        return MoveStats(
            experts_moved=len(move.slots) * len(self.layers),
            bytes_sent=move.bytes_sent,
            bytes_received=move.bytes_received,
            transfer_s=move.transfer_s,
            commit_s=time.perf_counter() - start,
            steps=len(move.chunks),
        )

    def cancel(self) -> None:
        """Drop a move begun and not committed (its staged experts); the layers keep serving
        the old placement. Every rank, same iteration (no collective). Use it when the serving
        weights change under a move (an RL weight update): what was staged is of the old
        weights. Nothing happens when no move is in progress."""
        self._move, self._staging, self._sources = None, {}, {}

    # ------------------------------------------------------------------ one chunk

    def _run_chunk(self, move: _Move, chunk: list[Unit]) -> None:
        """Local copies, then one all-to-all of every transfer of the chunk (none when the
        chunk has no transfer on any rank)."""
        world, rank = self.world_size, self.rank
        sends: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # (layer, slot) by dst
        expect: list[list[tuple[int, int]]] = [[] for _ in range(world)]  # (layer, row) by src
        for layer, copy in chunk:
            if copy.local:
                if copy.dst_rank == rank:
                    self.layers[layer].stage_local(
                        self._staging_of(move, layer), move.slots.index(copy.dst_slot),
                        self._sources_of(layer), copy.src_slot)
            elif copy.src_rank == rank:
                sends[copy.dst_rank].append((layer, copy.src_slot))
            elif copy.dst_rank == rank:
                expect[copy.src_rank].append((layer, move.slots.index(copy.dst_slot)))
        if all(copy.local for _, copy in chunk):
            return
        send_splits = [sum(self.layers[layer].expert_bytes for layer, _ in units)
                       for units in sends]
        recv_splits = [sum(self.layers[layer].expert_bytes for layer, _ in units)
                       for units in expect]
        device = self.layers[0].device
        payload = torch.empty(sum(send_splits), dtype=torch.uint8, device=device)
        start = 0
        for units in sends:  # by destination rank, each in chunk order
            for layer, slot in units:
                size = self.layers[layer].expert_bytes
                self.layers[layer].write_slot(self._sources_of(layer), slot,
                                              payload[start : start + size])
                start += size
        received = torch.empty(sum(recv_splits), dtype=torch.uint8, device=device)
        dist.all_to_all_single(received, payload, recv_splits, send_splits, group=self.group)
        start = 0
        for units in expect:  # by source rank, each in chunk order: the order it was sent in
            for layer, row in units:
                size = self.layers[layer].expert_bytes
                self.layers[layer].stage_bytes(self._staging_of(move, layer), row,
                                               received[start : start + size])
                start += size
        move.bytes_sent += sum(send_splits)
        move.bytes_received += sum(recv_splits)

    def _staging_of(self, move: _Move, layer: int) -> dict[str, torch.Tensor]:
        if layer not in self._staging:
            self._staging[layer] = self.layers[layer].new_staging(len(move.slots))
        return self._staging[layer]

    def _sources_of(self, layer: int) -> dict[str, torch.Tensor]:
        if layer not in self._sources:
            self._sources[layer] = self.layers[layer].sources()
        return self._sources[layer]
