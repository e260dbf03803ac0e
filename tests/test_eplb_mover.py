"""Runtime EPLB's weight movement (`moe_engine.eplb`): the move schedule, and experts moved
between 2 and 4 gloo ranks while their layers keep the same outputs.

Each rank builds a tiny stack of MoE layers (8 experts, H 32; I 16 for float experts, 32 for
4-bit ones, the smallest the int4 groups and MXFP4 blocks allow) sharded by a placement with
redundant slots, runs it through the real all-to-all (`TorchAllToAll`), moves to a placement
that moves, copies locally and replicates experts, with a per-step budget small enough to take
several steps, and checks every slot's stored tensors bit for bit against the expert's source
and the layers' outputs against those before the move.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from dist_utils import RankFailure, run_ranks

from comm import ExpertPlacement, NoopCommunicator
from kernels.moe.activation import SwiGLU
from kernels.moe.backends import Int4Experts
from kernels.plan import NATIVE_CPU, TORCH, KernelPlan
from moe_engine.eplb import ExpertMover, chunk_moves, plan_moves
from moe_engine.eplb.layer_experts import LayerExperts
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.quantized_experts import QuantizedExperts
from quant.int4 import quantize_int4

E, K, H, LAYERS = 8, 2, 32, 3
TOKENS = 11  # per rank

FP32, BF16 = torch.float32, torch.bfloat16
#: name -> (quantization, intermediate size, expert biases, activation, kernel backend, dtype)
CASES = {
    "float_torch": ("none", 16, False, SwiGLU(), TORCH, FP32),
    "float_native_bias": ("none", 16, True, SwiGLU(alpha=1.702, limit=7.0), NATIVE_CPU, FP32),
    "bf16_native_bias": ("none", 32, True, SwiGLU(), NATIVE_CPU, BF16),  # AMX where it runs
    "int4_native_bias": ("int4", 32, True, SwiGLU(), NATIVE_CPU, FP32),
    # a checkpoint's asymmetric int4: bfloat16 scales and zero points
    "int4_asym_native": ("int4-asym", 32, False, SwiGLU(), NATIVE_CPU, FP32),
    "mxfp4_torch_bias": ("mxfp4", 32, True, SwiGLU(alpha=1.702, limit=7.0), TORCH, FP32),
    "mxfp4_native": ("mxfp4", 32, False, SwiGLU(), NATIVE_CPU, FP32),
}

#: world size -> (serving placement, new placement): both with redundant slots; the new one
#: keeps some slots, copies some experts within a rank, fetches others and replicates.
PLACEMENTS = {
    2: ([[0, 1, 2, 3, 4], [5, 6, 7, 0, 1]],
        [[0, 5, 3, 2, 6], [7, 5, 1, 4, 0]]),
    4: ([[0, 1, 2], [3, 4, 5], [6, 7, 0], [1, 2, 3]],
        [[0, 4, 7], [1, 2, 5], [3, 6, 0], [2, 0, 1]]),
}


def _full_layer(case: str, seed: int) -> FusedMoE:
    """A whole (unsharded) layer with random weights, the same on every rank."""
    method, inter, bias, activation, _, dtype = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    moe = FusedMoE(E, K, H, inter, True, dtype, expert_bias=bias, activation=activation)
    for p in moe.parameters():
        p.data.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return moe


def _sharded_layer(case: str, seed: int, local: list[int], communicator, rank: int) -> FusedMoE:
    """The rank's shard of `_full_layer(case, seed)` holding `local`, quantized and bound."""
    method, _, _, _, backend, _ = CASES[case]
    full = _full_layer(case, seed)
    moe = _full_layer(case, seed)
    moe.shard_experts(local, communicator, rank)
    for name in ("w13", "w2", "b13", "b2"):
        if getattr(full, name) is not None:
            getattr(moe, name).data.copy_(getattr(full, name).data[local])
    _quantize(moe, method)  # row-wise: the same codes as quantizing the whole layer
    moe.bind_kernels(KernelPlan.uniform(backend, "cpu"))
    return moe


def _quantize(moe: FusedMoE, method: str) -> None:
    """4-bit experts as `method` says: "int4"/"mxfp4" as the engine quantizes, "int4-asym"
    as an asymmetric checkpoint holds them (bfloat16 scales, zero points)."""
    if method == "int4-asym":
        codes = [quantize_int4(w.data, 32, symmetric=False, scale_dtype=torch.bfloat16)
                 for w in (moe.w13, moe.w2)]
        moe.quantized = QuantizedExperts.from_layout(Int4Experts(*codes[0], *codes[1]),
                                                     **moe.expert_extras())
        del moe.w13, moe.w2
    elif method != "none":
        moe.quantize(method, 32)


def _reference_experts(case: str, seed: int) -> dict[str, torch.Tensor]:
    """Every expert's stored tensors ([E, ...] per field), from a whole layer."""
    full = _full_layer(case, seed)
    _quantize(full, CASES[case][0])
    return LayerExperts(full).sources()


def _slot_mismatches(moe: FusedMoE, reference: dict[str, torch.Tensor]) -> list[str]:
    stored = LayerExperts(moe).sources()
    bad = []
    for slot, expert in enumerate(moe.local_experts):
        for name, tensor in stored.items():
            if not torch.equal(tensor[slot], reference[name][expert]):
                bad.append(f"slot {slot} (expert {expert}) {name}")
    return bad


def _forward(moes: list[FusedMoE], hidden: torch.Tensor) -> list[torch.Tensor]:
    with torch.inference_mode():
        return [moe(hidden) for moe in moes]


def _run_case(rank: int, world: int, case: str) -> dict:
    from comm import TorchAllToAll

    old_slots, new_slots = PLACEMENTS[world]
    old, new = ExpertPlacement(E, world, old_slots), ExpertPlacement(E, world, new_slots)
    communicator = TorchAllToAll(None, old)
    moes = [_sharded_layer(case, 10 + layer, old.local_experts(rank), communicator, rank)
            for layer in range(LAYERS)]
    references = [_reference_experts(case, 10 + layer) for layer in range(LAYERS)]
    problems = [f"before: layer {i} {m}" for i, moe in enumerate(moes)
                for m in _slot_mismatches(moe, references[i])]
    hidden = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(100 + rank))
    hidden = hidden.to(CASES[case][5])
    before = _forward(moes, hidden)

    plan = KernelPlan.uniform(CASES[case][4], "cpu")
    expert_bytes = LayerExperts(moes[0]).expert_bytes
    mover = ExpertMover(moes, communicator, rank, None, plan,
                        max_bytes_per_step=2 * expert_bytes)
    mover.begin(old, new)
    try:
        mover.begin(old, new)
        problems.append("a second begin while busy did not raise")
    except ValueError:
        pass
    calls = 1
    while not mover.step():
        calls += 1
    stats = mover.commit()
    problems += [f"after: layer {i} {m}" for i, moe in enumerate(moes)
                 for m in _slot_mismatches(moe, references[i])]
    problems += [f"layer {i} serves {moe.local_experts}" for i, moe in enumerate(moes)
                 if moe.local_experts != new.local_experts(rank)]
    if communicator.placement is not new:
        problems.append("the communicator still routes by the old placement")
    after = _forward(moes, hidden)
    diffs = [float((a - b).abs().max()) / float(b.abs().max())
             for a, b in zip(after, before, strict=True)]
    # and back again: the first move's layers are a valid source
    mover.begin(new, old)
    while not mover.step():
        pass
    mover.commit()
    problems += [f"back: layer {i} {m}" for i, moe in enumerate(moes)
                 for m in _slot_mismatches(moe, references[i])]
    back = _forward(moes, hidden)
    diffs += [float((a - b).abs().max()) / float(b.abs().max())
              for a, b in zip(back, before, strict=True)]
    return {"problems": problems, "diffs": diffs, "calls": calls, "stats": stats,
            "expert_bytes": expert_bytes, "busy_after": mover.busy}


def _run_all(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    return {case: _run_case(rank, world, case) for case in CASES}


@pytest.fixture(scope="module", params=[2, 4], ids=["ep2", "ep4"])
def moved(request) -> tuple[int, list[dict]]:
    world = request.param
    return world, run_ranks(_run_all, world, timeout_s=180)


@pytest.mark.parametrize("case", list(CASES))
def test_moved_experts_are_bit_identical_and_outputs_unchanged(moved, case):
    world, results = moved
    schedule = plan_moves(*(ExpertPlacement(E, world, s) for s in PLACEMENTS[world]))
    for rank, by_case in enumerate(results):
        r = by_case[case]
        assert r["problems"] == [], f"rank {rank}: {r['problems']}"
        # relative to the output's largest value: only the order of the partial sums changes
        tol = 1e-5 if CASES[case][5] == FP32 else 1e-2
        assert max(r["diffs"]) < tol, f"rank {rank}: {r['diffs']}"
        assert not r["busy_after"]
        stats = r["stats"]
        changed = schedule.changed_slots(rank)
        assert stats.experts_moved == len(changed) * LAYERS
        sent = sum(c.src_rank == rank and not c.local for c in schedule.copies)
        received = sum(c.dst_rank == rank and not c.local for c in schedule.copies)
        assert stats.bytes_sent == sent * LAYERS * r["expert_bytes"]
        assert stats.bytes_received == received * LAYERS * r["expert_bytes"]
        assert r["calls"] == stats.steps > 2  # a small budget: several steps
        assert stats.transfer_s > 0 and stats.commit_s > 0


def _die_mid_move(rank: int, world: int) -> None:
    from comm import TorchAllToAll

    old, new = (ExpertPlacement(E, world, s) for s in PLACEMENTS[world])
    communicator = TorchAllToAll(None, old)
    moe = _sharded_layer("float_torch", 10, old.local_experts(rank), communicator, rank)
    mover = ExpertMover([moe], communicator, rank, None, KernelPlan.uniform(TORCH, "cpu"),
                        max_bytes_per_step=LayerExperts(moe).expert_bytes)
    mover.begin(old, new)
    mover.step()
    if rank == 1:
        raise SystemExit("rank 1 dies mid-move on purpose")
    while not mover.step():
        pass


def test_a_rank_dying_mid_move_fails_the_others_instead_of_hanging():
    with pytest.raises(RankFailure) as failure:
        run_ranks(_die_mid_move, 2, timeout_s=60, collective_timeout_s=10)
    message = str(failure.value)
    assert "rank 1 dies mid-move" in message and "rank 0 failed" in message


# --- single process ---------------------------------------------------------------------------


def test_schedule_copies_locally_what_a_rank_holds_and_is_deterministic():
    old = ExpertPlacement(E, 2, PLACEMENTS[2][0])
    new = ExpertPlacement(E, 2, PLACEMENTS[2][1])
    schedule = plan_moves(old, new)
    assert schedule == plan_moves(ExpertPlacement(E, 2, PLACEMENTS[2][0]),
                                  ExpertPlacement(E, 2, PLACEMENTS[2][1]))
    by_slot = {(c.dst_rank, c.dst_slot): c for c in schedule.copies}
    assert (0, 0) not in by_slot  # expert 0 stays in rank 0's slot 0
    assert by_slot[(0, 2)].local and by_slot[(0, 2)].src_slot == 3  # expert 3, rank 0's slot 3
    assert by_slot[(1, 1)].local and by_slot[(1, 1)].src_slot == 0  # expert 5 on rank 1
    assert [(c.expert, c.src_rank, c.dst_rank) for c in schedule.transfers] == [
        (5, 1, 0), (6, 1, 0), (4, 0, 1)]
    assert schedule.changed_slots(0) == [1, 2, 3, 4]
    for c in schedule.copies:  # the source holds the expert in the old placement
        assert old.slots[c.src_rank][c.src_slot] == c.expert == new.slots[c.dst_rank][c.dst_slot]


def test_schedule_takes_the_least_loaded_then_lowest_holder():
    # expert 0 is on ranks 0 and 1; ranks 2 and 3 both need it: one copy from each holder
    old = ExpertPlacement(E, 4, [[0, 1, 2], [0, 3, 4], [5, 6, 2], [7, 1, 3]])
    new = ExpertPlacement(E, 4, [[0, 1, 2], [0, 3, 4], [0, 6, 5], [7, 0, 1]])
    sources = [(c.src_rank, c.dst_rank) for c in plan_moves(old, new).transfers if c.expert == 0]
    assert sources == [(0, 2), (1, 3)]
    assert plan_moves(old, old).copies == ()


def test_chunks_keep_each_rank_under_the_budget():
    old = ExpertPlacement(E, 4, PLACEMENTS[4][0])
    new = ExpertPlacement(E, 4, PLACEMENTS[4][1])
    schedule = plan_moves(old, new)
    sizes = [100, 100, 300]
    chunks = chunk_moves(schedule, sizes, 250)
    units = [u for chunk in chunks for u in chunk]
    assert units == [(layer, c) for layer in range(3) for c in schedule.copies]  # layer-major
    for chunk in chunks:
        for rank in range(4):
            sent = sum(sizes[lay] for lay, c in chunk if c.src_rank == rank and not c.local)
            staged = sum(sizes[lay] for lay, c in chunk if c.dst_rank == rank)
            assert (sent <= 250 and staged <= 250) or len(chunk) == 1
    assert len(chunk_moves(schedule, sizes, 1 << 30)) == 1
    assert chunk_moves(plan_moves(old, old), sizes, 250) == []
    with pytest.raises(ValueError, match="max_bytes_per_step"):
        chunk_moves(schedule, sizes, 0)


def test_a_tight_budget_keeps_every_rank_receiving_in_every_step():
    old = ExpertPlacement.contiguous(E, 2)
    new = ExpertPlacement(E, 2, [old.slots[1], old.slots[0]])  # every expert changes rank
    chunks = chunk_moves(plan_moves(old, new), [100], 100)
    assert [sorted(c.dst_rank for _, c in chunk) for chunk in chunks] == [[0, 1]] * 4


def test_placements_of_another_shape_are_refused():
    old = ExpertPlacement(E, 2, PLACEMENTS[2][0])
    with pytest.raises(ValueError, match="num_local_experts 4, the serving one 5"):
        plan_moves(old, ExpertPlacement.contiguous(E, 2))
    with pytest.raises(ValueError, match="ep_size 4, the serving one 2"):
        plan_moves(old, ExpertPlacement(E, 4, [[0, 1, 2, 3, 4]] * 2 + [[5, 6, 7, 0, 1]] * 2))


def test_noop_communicator_refuses_a_non_contiguous_placement():
    NoopCommunicator().set_placement(ExpertPlacement.contiguous(E, 1))
    with pytest.raises(ValueError, match="non-contiguous"):
        NoopCommunicator().set_placement(ExpertPlacement(E, 1, [[1, 0, 2, 3, 4, 5, 6, 7]]))


def test_torch_int4_cpu_layout_is_refused_at_construction_naming_the_backend():
    moe = _full_layer("int4_native_bias", 1)
    moe.quantize("int4", 32)
    plan = KernelPlan.uniform(TORCH, "cpu")
    moe.bind_kernels(plan)
    with pytest.raises(ValueError, match="'torch' kernel backend of fused_moe_int4"):
        ExpertMover([moe], moe.communicator, 0, None, plan)


def test_begin_checks_the_serving_placement_and_commit_needs_a_staged_move():
    moe = _full_layer("float_torch", 1)
    plan = KernelPlan.uniform(TORCH, "cpu")
    moe.bind_kernels(plan)
    mover = ExpertMover([moe], moe.communicator, 0, None, plan,
                        max_bytes_per_step=LayerExperts(moe).expert_bytes)
    contiguous = ExpertPlacement.contiguous(E, 1)
    with pytest.raises(RuntimeError, match="not staged"):
        mover.commit()
    with pytest.raises(ValueError, match="ep_size 2"):
        mover.begin(ExpertPlacement.contiguous(E, 2), ExpertPlacement.contiguous(E, 2))
    mover.begin(contiguous, contiguous)  # nothing to move: no step moves anything
    assert mover.busy and mover.step()
    stats = mover.commit()
    assert (stats.experts_moved, stats.steps, stats.bytes_sent) == (0, 0, 0)
    assert not mover.busy
    swapped = ExpertPlacement(E, 1, [[1, 0, *range(2, E)]])
    mover.begin(contiguous, swapped)
    assert not mover.step()  # two local copies under the budget of one expert
    mover.cancel()
    assert not mover.busy and moe.local_experts == list(range(E))
    with pytest.raises(RuntimeError, match="without begin"):
        mover.step()
    mover.begin(contiguous, swapped)
    while not mover.step():
        pass
    before = moe.w13.detach().clone()
    with pytest.raises(ValueError, match="non-contiguous"):  # the no-op communicator refuses
        mover.commit()
    assert torch.equal(moe.w13, before) and moe.local_experts == list(range(E)) and mover.busy


def test_layer_bytes_are_the_stored_ones():
    float_moe = _full_layer("float_native_bias", 1)
    inter = CASES["float_native_bias"][1]
    assert LayerExperts(float_moe).expert_bytes == (3 * inter * H + 2 * inter + H) * 4
    mx = _full_layer("mxfp4_native", 1)
    mx.quantize("mxfp4", 32)
    inter = CASES["mxfp4_native"][1]
    assert LayerExperts(mx).expert_bytes == 3 * inter * H // 2 + 3 * inter * H // 32
    assert [f.name for f in LayerExperts(mx).fields] == [
        f.name for f in dataclasses.fields(mx.quantized.canonical())]
