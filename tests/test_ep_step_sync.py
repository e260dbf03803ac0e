"""Expert parallelism without host syncs in the step (gloo, 2 and 4 local ranks).

- the fixed-capacity all-to-all delivers the variable splits' rows (plus padding rows that no
  expert reads) and gives bit-identical outputs, equal to the single-process reference;
- in steady state (after `begin_step`) a dispatch and a combine read nothing back to the host
  and run no all-reduce: `HostReadCheck` fails on every op that needs the device's data on the
  host (`.item()`, `.tolist()`, nonzero, bincount, boolean-mask indexing, ...), which on CUDA
  are the host syncs; DeepEP's low-latency path is checked the same way on the fake buffer of
  test_comm (itself sync-free), and without `begin_step` the per-dispatch all-reduce is seen;
- DeepEP's low-latency rows reach the experts compacted: [P, 1] ids with P = ep_size x the
  step's largest token count x min(top_k, local experts), not [E_local x R, top_k];
- the engine calls `begin_step` exactly once per step (a counting communicator in a 2-rank
  engine of a tiny checkpoint), and its greedy tokens are the same with both layouts and equal
  one rank's.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from dist_utils import case_results, run_ranks
from test_comm import (
    BF16_TOL,
    FP32_TOL,
    TOP_K,
    FakeDeepEPBuffer,
    close,
    expected_dispatch,
    hot_router,
    make_batches,
    make_experts,
    reference_output,
    replica_placement,
)
from torch.utils._python_dispatch import TorchDispatchMode

from comm import DeepEPCommunicator, TorchAllToAll
from comm.deepep_ll import max_pairs
from comm.rows import row_layout
from kernels.moe.torch_cpu import fused_moe_cpu

WATCHDOG_S = 90.0

#: aten ops whose result size or value needs the device's data on the host.
HOST_READ_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::bincount",
    "aten::masked_select",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::is_nonzero",
    "aten::equal",
}


class HostReadCheck(TorchDispatchMode):
    """Raises on any op that reads device data back to the host (a host sync on CUDA); the
    Python-level `tolist` is patched as well (it bypasses the dispatcher)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        bool_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
            for i in (args[1] if len(args) > 1 else [])
        )
        # repeats given as a tensor: the output size is their sum, unless output_size says it
        repeats = args[1] if len(args) > 1 else (kwargs or {}).get("repeats", args[0])
        repeat_sync = name == "aten::repeat_interleave" and isinstance(repeats, torch.Tensor)
        repeat_sync = repeat_sync and (kwargs or {}).get("output_size") is None
        if name in HOST_READ_OPS or bool_index or repeat_sync:
            raise AssertionError(f"host read inside the step: {func}")
        return func(*args, **(kwargs or {}))


@contextmanager
def no_host_reads() -> Iterator[None]:
    """Fail on host reads of tensor data (see `HostReadCheck`)."""
    saved = torch.Tensor.tolist

    def forbidden(self: torch.Tensor) -> list:
        raise AssertionError("host read inside the step: Tensor.tolist")

    torch.Tensor.tolist = forbidden
    try:
        with HostReadCheck():
            yield
    finally:
        torch.Tensor.tolist = saved


@contextmanager
def counting_all_reduce() -> Iterator[list[int]]:
    """Count `dist.all_reduce` calls (one element list)."""
    count, saved = [0], dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return saved(*args, **kwargs)

    dist.all_reduce = counted
    try:
        yield count
    finally:
        dist.all_reduce = saved


def _run_layer(comm, rank: int, placement, batch, experts, check: bool) -> tuple:
    """dispatch -> local experts -> combine; dispatch and combine under `no_host_reads` when
    `check` (the experts' CPU kernels are not part of the claim)."""
    w13, w2 = experts
    local = placement.local_experts(rank)
    with no_host_reads() if check else _nothing():
        sent = comm.dispatch(batch.hidden, batch.topk_ids, batch.topk_weights)
    out = fused_moe_cpu(sent.hidden, w13[local], w2[local], sent.topk_weights, sent.topk_ids)
    with no_host_reads() if check else _nothing():
        combined = comm.combine(out, sent.handle)
    return sent, combined


@contextmanager
def _nothing() -> Iterator[None]:
    yield


# ---------------------------------------------------------------- the cases (every rank)


def case_fixed_equals_variable(rank: int, world: int, seed: int) -> list[str]:
    """Both layouts on the same batches: the fixed rows are the variable rows plus padding,
    outputs bit-identical and equal to the reference, counters equal (bytes: padded)."""
    placement = replica_placement(world)
    problems = []
    steps = [
        ([5, 0, 3, 0], torch.float32),
        ([0, 0, 0, 0], torch.float32),
        ([9, 7, 8, 6], torch.bfloat16),
    ]
    for i, (counts, dtype) in enumerate(steps):
        counts = counts[:world]
        batches = make_batches(seed + i, counts, hot_router(0), dtype)
        experts = make_experts(seed, dtype)
        runs = {}
        for mode in ("variable", "fixed"):
            comm = TorchAllToAll(None, placement, mode=mode)
            comm.begin_step(counts[rank])
            sent, combined = _run_layer(comm, rank, placement, batches[rank], experts, False)
            runs[mode] = (comm, sent, combined)
        (var, _, var_out), (fix, fix_sent, fix_out) = runs["variable"], runs["fixed"]
        tag = f"step {i} {counts}"
        if (var.last_layout, fix.last_layout) != ("variable", "fixed"):
            problems.append(f"{tag}: layouts {var.last_layout}, {fix.last_layout}")
        capacity = max(counts)
        if fix_sent.hidden.shape[0] != world * capacity:
            problems.append(f"{tag}: {fix_sent.hidden.shape[0]} rows, expected {world * capacity}")
        real = (fix_sent.topk_ids >= 0).any(1)
        exp_hidden, exp_ids, exp_weights = expected_dispatch(batches, placement, rank)
        problems += close(f"{tag} fixed rows", fix_sent.hidden[real], exp_hidden)
        problems += close(f"{tag} fixed ids", fix_sent.topk_ids[real], exp_ids)
        problems += close(f"{tag} fixed weights", fix_sent.topk_weights[real], exp_weights)
        if fix_sent.topk_weights[~real].abs().sum() != 0:
            problems.append(f"{tag}: padding rows carry weights")
        if not torch.equal(var_out, fix_out):
            problems.append(f"{tag}: fixed output differs from the variable splits'")
        tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
        reference = reference_output(batches, rank, *experts)
        problems += close(f"{tag} output", fix_out, reference, **tol)
        problems += _compare_counts(tag, var.stats.last, fix.stats.last, world, capacity, dtype)
    return problems


def _compare_counts(tag: str, var, fix, world: int, capacity: int, dtype) -> list[str]:
    same = (
        "tokens_in",
        "tokens_sent_per_rank",
        "tokens_received",
        "remote_pairs",
        "min_dispatch_bytes",
        "dispatches",
        "combines",
    )
    problems = [
        f"{tag}: stats.{k} {getattr(fix, k)} != {getattr(var, k)}"
        for k in same
        if getattr(fix, k) != getattr(var, k)
    ]
    hidden_bytes = 17 * torch.empty(0, dtype=dtype).element_size()
    _, row_bytes = row_layout(TOP_K, hidden_bytes)
    padded = ((world - 1) * capacity * row_bytes, (world - 1) * capacity * hidden_bytes)
    if (fix.dispatch_bytes_sent, fix.combine_bytes_sent) != padded:
        problems.append(
            f"{tag}: fixed bytes {fix.dispatch_bytes_sent}, "
            f"{fix.combine_bytes_sent}, expected {padded}"
        )
    return problems


def case_fixed_steady_state(rank: int, world: int, seed: int) -> list[str]:
    """Two steps of three layers: begin_step once per step, then no host read and no
    all-reduce in any dispatch or combine; outputs equal the reference."""
    placement = replica_placement(world)
    comm = TorchAllToAll(None, placement, mode="fixed")
    experts = make_experts(seed, torch.float32)
    problems = []
    for step, counts in enumerate([[4, 7, 1, 3], [2, 0, 6, 5]]):
        counts = counts[:world]
        comm.begin_step(counts[rank])
        for layer in range(3):
            batches = make_batches(seed + 10 * step + layer, counts, hot_router(0))
            with counting_all_reduce() as reduces:
                _, out = _run_layer(comm, rank, placement, batches[rank], experts, True)
            if reduces[0]:
                problems.append(f"step {step} layer {layer}: {reduces[0]} all-reduces")
            reference = reference_output(batches, rank, *experts)
            problems += close(f"step {step} layer {layer}", out, reference, **FP32_TOL)
    return problems


def case_deepep_low_latency_steady_state(rank: int, world: int, seed: int) -> list[str]:
    """DeepEP "auto" on the fake buffer: after begin_step the low-latency dispatch and combine
    read nothing back and all-reduce nothing; the experts get [P, 1] ids with P the real pair
    bound. Without begin_step each dispatch all-reduces (what the engine did before)."""
    placement = replica_placement(world)
    buffer = FakeDeepEPBuffer()
    comm = DeepEPCommunicator(None, placement, buffer=buffer, low_latency_max_tokens=8)
    experts = make_experts(seed, torch.bfloat16)
    slots = placement.num_local_experts
    problems = []
    for step, (counts, announce) in enumerate([([5, 8, 0, 3], True), ([2, 1, 0, 6], False)]):
        counts = counts[:world]
        comm.begin_step(counts[rank] if announce else None)
        for layer in range(2):
            batches = make_batches(seed + 10 * step + layer, counts, hot_router(0), torch.bfloat16)
            with counting_all_reduce() as reduces:
                sent, out = _run_layer(comm, rank, placement, batches[rank], experts, announce)
            tag = f"step {step} layer {layer}"
            if reduces[0] != (0 if announce else 1):
                problems.append(f"{tag}: {reduces[0]} all-reduces (begin_step: {announce})")
            if comm.last_mode != "low_latency":
                problems.append(f"{tag}: {comm.last_mode} kernels")
            rows = max_pairs(world, max(counts), TOP_K, slots)
            packed_rows = slots * 8 * world
            if tuple(sent.topk_ids.shape) != (min(rows, packed_rows), 1):
                problems.append(f"{tag}: ids {tuple(sent.topk_ids.shape)}, expected ({rows}, 1)")
            received = sum(
                int((placement.route(b.topk_ids, src)[0] == rank).sum())
                for src, b in enumerate(batches)
            )
            if int((sent.topk_ids >= 0).sum()) != received:
                problems.append(
                    f"{tag}: {int((sent.topk_ids >= 0).sum())} valid rows, "
                    f"{received} pairs sent here"
                )
            reference = reference_output(batches, rank, *experts)
            problems += close(tag, out, reference, **BF16_TOL)
    return problems


def case_check_sees_host_reads(rank: int, world: int, seed: int) -> list[str]:
    """`no_host_reads` fails on what the old dispatch did (tolist of the split sizes, nonzero,
    .item(), boolean masks, bincount), so the cases above can fail."""
    counts = torch.tensor([3, 1])
    reads = {
        "tolist": lambda: counts.tolist(),
        "nonzero": lambda: counts.nonzero(),
        "item": lambda: counts[0].item(),
        "mask": lambda: counts[counts > 1],
        "bincount": lambda: torch.bincount(counts),
    }
    problems = []
    for name, read in reads.items():
        try:
            with no_host_reads():
                read()
            problems.append(f"{name} passed no_host_reads")
        except AssertionError as error:
            if "host read inside the step" not in str(error):
                problems.append(f"{name}: {error}")
    return problems


CASES: dict[str, Callable[[int, int, int], list[str]]] = {
    "check_sees_host_reads": case_check_sees_host_reads,
    "fixed_equals_variable": case_fixed_equals_variable,
    "fixed_steady_state": case_fixed_steady_state,
    "deepep_low_latency_steady_state": case_deepep_low_latency_steady_state,
}


def run_all_cases(rank: int, world: int, seed: int) -> dict[str, list[str]]:
    """Every case in order on this rank: {case: problems found}."""
    return {name: case(rank, world, seed + i) for i, (name, case) in enumerate(CASES.items())}


@pytest.fixture(scope="module")
def results() -> Callable[[int], dict[str, list[str]]]:
    """Results of all cases per world size, one process start per size."""
    return case_results(run_all_cases, list(CASES), random.randrange(2**31), WATCHDOG_S)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
@pytest.mark.parametrize("case", list(CASES))
def test_step_without_host_reads(results, case: str, world: int) -> None:
    problems = results(world)[case]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------- the engine (2 ranks)

ENGINE_PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [11, 3], [8, 8, 21, 60, 4], [30, 2, 19]]
ENGINE_NEW_TOKENS = 5


class CountingAllToAll(TorchAllToAll):
    """TorchAllToAll that counts begin_step and dispatch calls, and runs dispatch and combine
    under `no_host_reads` once a step has been announced in the fixed layout."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.begin_steps = self.dispatches = 0

    def begin_step(self, num_tokens: int | None) -> None:
        self.begin_steps += 1
        super().begin_step(num_tokens)

    def dispatch(self, *args: Any) -> Any:
        self.dispatches += 1
        with no_host_reads() if self.mode == "fixed" else _nothing():
            return super().dispatch(*args)

    def combine(self, *args: Any) -> Any:
        with no_host_reads() if self.mode == "fixed" else _nothing():
            return super().combine(*args)


def run_engine(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    """Both layouts on one 2-rank engine (the same model, fresh requests each): greedy tokens
    of this rank's prompts, and the steps, begin_step and dispatch calls of each run."""
    from comm import ExpertPlacement
    from moe_engine import SamplingParams
    from moe_engine.core.build import build_engine_core
    from moe_engine.models import model_shape
    from moe_engine.startup.rank_context import RankContext

    config = _engine_config(ckpt, world)
    num_experts = model_shape(config.model.hf_config()).num_experts
    placement = ExpertPlacement.contiguous(num_experts, world)
    comm = CountingAllToAll(None, placement, mode="variable")
    core = build_engine_core(config, RankContext(rank, world, placement.local_experts(rank), comm))
    layers = len(core.runner.model.moe_layers())
    params = SamplingParams(max_tokens=ENGINE_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"moe_layers": layers}
    for layout in ("variable", "fixed"):
        comm.mode, comm.begin_steps, comm.dispatches = layout, 0, 0
        steps_before = core.counters["num_steps"]
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(ENGINE_PROMPTS[rank::world]):
            core.add_request(f"{layout}-{i}", prompt, params)
            tokens[f"{layout}-{i}"] = []
        while _any_rank(core.has_unfinished_requests()):
            for o in core.step():
                tokens[o.request_id] += o.new_token_ids
        out[layout] = {
            "tokens": [tokens[k] for k in sorted(tokens)],
            "steps": core.counters["num_steps"] - steps_before,
            "begin_steps": comm.begin_steps,
            "dispatches": comm.dispatches,
        }
    return out


def _engine_config(ckpt: str, ep_size: int):
    from moe_engine.startup.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        ParallelConfig,
        SchedulerConfig,
    )

    return EngineConfig(
        model=ModelConfig(model=ckpt, max_model_len=64),
        cache=CacheConfig(num_blocks_override=24),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
        parallel=ParallelConfig(ep_size=ep_size, num_threads=1),
    )


def _any_rank(flag: bool) -> bool:
    value = torch.tensor([int(flag)])
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value[0])


@pytest.mark.slow
def test_engine_calls_begin_step_once_per_step_and_layouts_agree(qwen3_ckpt: Path) -> None:
    """A 2-rank engine (tiny Qwen3-MoE, the runner's real step): begin_step once per step on
    every rank (idle steps included), no host read in the fixed layout's dispatches and
    combines, and the same greedy tokens with both layouts as with one rank."""
    from moe_engine import LLM, SamplingParams

    per_rank = run_ranks(run_engine, 2, args=(str(qwen3_ckpt),), timeout_s=WATCHDOG_S)
    llm = LLM(model=str(qwen3_ckpt), max_model_len=64)
    params = SamplingParams(max_tokens=ENGINE_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    ep1 = [o.outputs[0].token_ids for o in llm.generate(ENGINE_PROMPTS, params)]
    for rank, result in enumerate(per_rank):
        for layout in ("variable", "fixed"):
            run = result[layout]
            assert run["begin_steps"] == run["steps"] > 0, (rank, layout, run)
            assert run["dispatches"] == run["steps"] * result["moe_layers"], (rank, layout, run)
            assert run["tokens"] == ep1[rank::2], (rank, layout)


@pytest.mark.parametrize("fill", ["empty", "some", "full"])
def test_compact_pairs_is_a_permutation_onto_the_packed_rows(fill: str) -> None:
    """The compacted rows name every valid packed row once, in expert then row order, and the
    padding rows name distinct empty packed rows, so the combine's scatter is a permutation."""
    from comm.deepep_ll import compact_pairs

    experts, rows = 5, 6
    gen = torch.Generator().manual_seed(3)
    count = {
        "empty": torch.zeros(experts, dtype=torch.int32),
        "some": torch.randint(0, rows + 1, (experts,), generator=gen, dtype=torch.int32),
        "full": torch.full((experts,), rows, dtype=torch.int32),
    }[fill]
    total = int(count.sum())
    for num_pairs in {total, min(total + 7, experts * rows), experts * rows}:
        packed_row = compact_pairs(count, rows, num_pairs)
        valid = [e * rows + j for e in range(experts) for j in range(int(count[e]))]
        assert packed_row[:total].tolist() == valid
        assert len(set(packed_row.tolist())) == num_pairs  # one-to-one
        spare = packed_row[total:]
        assert bool((spare % rows >= count.long()[spare // rows]).all())  # empty packed rows
