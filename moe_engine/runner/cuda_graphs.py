"""CUDA graphs for decode-only steps, captured at startup at a few padded batch sizes.

A decode step launches a few hundred small kernels whose host launch cost exceeds their device
time at small batches. A CUDA graph records the launches of one forward once and replays them
with a single launch (PyTorch's `torch.cuda.graphs`, "whole-network capture"); the price is
that every replay reads the same device addresses with the same shapes. So, as in vLLM's
`CUDAGraphRunner` (v0 `worker/model_runner.py`) and v1's `cudagraph_capture_sizes`:

- Static input buffers at the largest captured size P: `input_ids`, `positions`, `seq_lens`,
  `row_mask`, `logits_indices` [P] and, per KV-cache group, `slot_mapping` [P] and
  `block_tables` [P, W] (W = ceil(max_model_len / block_size)), all int64, plus a constant
  `query_start_loc` = arange(P + 1). One `AttentionMetadata` per captured size n is made of
  slices of them: one decode batch (`max_q` 1) of n rows, which is what the Triton decode
  kernels read (block_tables, seq_lens, query_start_loc); the torch path's fields (tok_b,
  tok_q, block_ids, q_pos, num_keys) are correct views too, but the torch kernels do not run
  in a graph (padding rows would give NaN there, and the torch experts sync on the host).
- Capture, largest size first, into one shared memory pool (`torch.cuda.graph(..., pool=)`),
  each after one eager warm-up run (Triton compiles there; cuBLAS makes its workspace) on a
  side stream, as the PyTorch docs' example does. A graph's output [n, H] is the tensor its
  capture produced, living in the pool; it is valid until the next replay.
- A decode-only step (every scheduled request feeds one token) of B <= P requests pads to the
  next captured size n: padding rows get input id 0, position 0, seq_len 0 (the kernels read
  no key and write zeros), a block-table row of the null block 0, and a slot in a scratch block
  that the KV cache has beyond the pool (`ModelRunner(scratch_block=True)`): their K/V writes
  land there, never in a request's block nor in the all-zero null block. The static buffers
  are filled with one host-to-device copy each through pinned staging (`StepInputBuffers`, no
  host sync), the graph replays, and the runner takes hidden[:B]; the LM head and the sampler
  stay eager. Mixed and prefill steps, and larger batches, run eagerly as before.
- The expert-load recorder counts only real rows: its row mask (`ExpertLoadRecorder.
  set_row_mask`, the static `row_mask` of 1s and 0s) weighs the captured `index_add_`.

When graphs apply is decided once at startup (`graphs_off_reason`) and logged in one line:
a CUDA device, no `--enforce-eager`, graph-safe decode kernels (the triton backend for
"attention_decode" / "mla_decode" and the model's expert op: the torch ones read sizes on the
host), and one rank (`NoopCommunicator`: `TorchAllToAll` reads split sizes on the host at
every dispatch, so expert parallelism runs eagerly).

The capture step is injectable (`CudaGraphCapture`, the real one; `EagerReplayCapture`, a
stand-in whose "replay" re-runs the forward on the static buffers), so the whole mechanism
(padding, static buffers, scratch block, masked counts) is tested on a CPU under the Triton
interpreter; graph memory is not part of the profiled activation peak (the log line gives it).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from kernels.plan import EXPERT_OPS, KernelPlan
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.kv_cache.spec import LINEAR_ATTENTION, MLA_ATTENTION
from moe_engine.models.layers.attention import AttentionBatch, AttentionMetadata
from moe_engine.runner.step_inputs import StepInputBuffers


@dataclass(frozen=True)
class GraphTarget:
    """What the decode graphs run: the parts of a `ModelRunner` they read, never the runner.

    Attributes:
        model: the model (called as `model(input_ids, positions, meta, kv_caches)`).
        kv_caches: per layer its KV cache tensors.
        num_groups: KV-cache groups (each its own slot mapping and block tables).
        device: the engine's device.
        block_size: tokens per KV block.
        scratch_block: the padding rows' KV block id, or None (no graphs then).
    """

    model: Any
    kv_caches: list
    num_groups: int
    device: torch.device
    block_size: int
    scratch_block: int | None


logger = logging.getLogger(__name__)

#: Decode batch sizes captured (capped by `capture_sizes`): powers of two, so a batch pads by
#: less than 2x and a 256-sequence engine captures 9 graphs. vLLM's default list
#: ([1, 2, 4] + multiples of 8 up to 256, then of 16 up to 512) pads less but captures ~35.
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

#: A forward of the static buffers, returning hidden [n, H].
Forward = Callable[[], torch.Tensor]


class GraphCapture(Protocol):
    """Turns a forward over the static buffers into its replay (warm-up included).

    Attributes:
        device_types: the engine devices it can capture on.
        name: what the startup log calls it.
    """

    device_types: tuple[str, ...]
    name: str

    def __call__(self, forward: Forward) -> Forward: ...


class CudaGraphCapture:
    """The real capture: a warm-up run on a side stream, then `torch.cuda.CUDAGraph` capture
    into one memory pool shared by every size (PyTorch docs, torch.cuda.graphs "whole-network
    capture" and "graph memory management"); the replay returns the captured output."""

    device_types = ("cuda",)
    name = "torch.cuda.CUDAGraph"

    def __init__(self) -> None:
        self.pool: tuple[int, int] | None = None  # torch.cuda.graph_pool_handle(), made lazily

    def __call__(self, forward: Forward) -> Forward:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()  # warm-up: Triton compiles, cuBLAS allocates its workspace
        torch.cuda.current_stream().wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


class EagerReplayCapture:
    """A stand-in for tests on any device: the warm-up run, and a "replay" that re-runs the
    forward eagerly on the static buffers (so it sees exactly what a replayed graph would)."""

    device_types = ("cpu", "cuda")
    name = "eager replay"

    def __call__(self, forward: Forward) -> Forward:
        forward()  # the warm-up run a real capture does first
        return forward


def capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """The decode batch sizes to capture: `CAPTURE_SIZES` below the cap, then the cap itself,
    the cap being min(max_num_seqs, max_num_batched_tokens, 256) (a decode batch never has more
    requests than either limit)."""
    cap = max(1, min(max_num_seqs, max_num_batched_tokens, CAPTURE_SIZES[-1]))
    return [s for s in CAPTURE_SIZES if s < cap] + [cap]


def graphs_off_reason(
    device: torch.device | str,
    *,
    enforce_eager: bool,
    kernels: KernelPlan,
    kv_kinds: Sequence[str],
    quant_method: str,
    ep_size: int,
    capture_devices: Sequence[str] = CudaGraphCapture.device_types,
) -> str | None:
    """Why decode steps run without graphs, or None when graphs apply (the startup decision).

    Args:
        device: the engine's device. enforce_eager: `--enforce-eager`.
        kernels: the bound kernel plan. kv_kinds: the KV-cache groups' `KVCacheSpec.kind`s.
        quant_method: the experts' `QuantConfig.method` ("none", "int4", "mxfp4").
        ep_size: ranks of expert parallelism. capture_devices: where the capture step works.

    Returns:
        e.g. "--enforce-eager", "cpu", "ep_size 2: TorchAllToAll reads split sizes on the
        host", "linear-attention layers (...)", "attention_decode=torch" (each op whose
        backend is not graph-safe), or None.
    """
    device_type = torch.device(device).type
    if enforce_eager:
        return "--enforce-eager"
    if device_type not in capture_devices:
        return device_type
    if ep_size > 1:
        return f"ep_size {ep_size}: TorchAllToAll reads split sizes on the host"
    if LINEAR_ATTENTION in kv_kinds:
        return "linear-attention layers (their state slots are gathered per step on the host)"
    ops = ["mla_decode" if kind == MLA_ATTENTION else "attention_decode" for kind in kv_kinds]
    ops.append(EXPERT_OPS.get(quant_method, "fused_moe"))
    return ", ".join(kernels.graph_unsafe(ops)) or None


class DecodeGraphs:
    """The captured decode graphs of one `ModelRunner` and their static input buffers.

    Args:
        target: the model, its KV cache (with a scratch block), block size, groups and device.
        sizes: decode batch sizes to capture (`capture_sizes`).
        max_model_len: the longest request (tokens): the block tables' width.

    Attributes:
        sizes: the captured sizes, ascending. num_replays: replays per size so far.
        static: the static input buffers by name (see the module docstring; each at least
            [P], block_tables.<g> at least [P * W]), what every graph reads.
        capture_seconds: wall time of the capture; memory_bytes: device memory it took (CUDA:
            the drop in free memory; 0 elsewhere).

    Raises:
        ValueError: the runner's KV cache has no scratch block, or no size is given.
    """

    def __init__(self, target: GraphTarget, sizes: Sequence[int], max_model_len: int) -> None:
        if target.scratch_block is None:
            raise ValueError(
                "decode graphs need a scratch KV block: ModelRunner(scratch_block=True)"
            )
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be a non-empty list of ints >= 1, got {sizes}")
        self.target = target
        self.sizes = sorted(set(sizes))
        self.block_size = target.block_size
        self.width = -(-max_model_len // self.block_size)
        self.scratch_slot = target.scratch_block * self.block_size
        self.num_groups = target.num_groups
        self.buffers = StepInputBuffers(target.device)
        device, top = target.device, self.sizes[-1]
        self.static = {name: self.buffers.reserve(name, top) for name in self._names()}
        for g in range(self.num_groups):
            self.static[f"block_tables.{g}"] = self.buffers.reserve(
                f"block_tables.{g}", top * self.width
            )
        self.query_start_loc = torch.arange(top + 1, dtype=torch.int64, device=device)
        self._rows = torch.arange(top, dtype=torch.int64, device=device)
        self._zeros = torch.zeros(top, dtype=torch.int64, device=device)
        self._replays: dict[int, Forward] = {}
        self._recorders: list[ExpertLoadRecorder] = []
        self.num_replays: Counter[int] = Counter()
        self.capture_seconds, self.memory_bytes, self.capture_name = 0.0, 0, ""

    def _names(self) -> list[str]:
        per_group = [f"slot_mapping.{g}" for g in range(self.num_groups)]
        return ["input_ids", "positions", "seq_lens", "row_mask", "logits_indices", *per_group]

    @property
    def max_size(self) -> int:
        """P, the largest captured batch (requests)."""
        return self.sizes[-1]

    def covers(self, num_tokens: Sequence[int]) -> bool:
        """Whether a step feeding these tokens per request replays a graph: decode-only (one
        token each) and at most `max_size` requests."""
        return 0 < len(num_tokens) <= self.max_size and all(n == 1 for n in num_tokens)

    @torch.inference_mode()
    def capture(self, capture: GraphCapture) -> None:
        """Capture every size, largest first, with all rows padding (the warm-up and capture
        runs write K/V only into the scratch block and count no expert load).

        Raises:
            RuntimeError: a capture failed (the message names the batch size).
        """
        model = self.target.model
        self._recorders = list({
            id(moe.load_recorder): moe.load_recorder
            for _, moe in model.moe_layers() if moe.load_recorder is not None
        }.values())  # fmt: skip
        cuda = self.target.device.type == "cuda"
        free_before = torch.cuda.mem_get_info(self.target.device)[0] if cuda else 0
        start = time.perf_counter()
        none = torch.zeros(0, dtype=torch.int64)
        self._fill(self.max_size, [], none, [[] for _ in range(self.num_groups)], none)
        with self._masked():
            for n in reversed(self.sizes):
                try:
                    self._replays[n] = capture(self._forward(n))
                except RuntimeError as exc:  # e.g. a host sync inside the forward
                    raise RuntimeError(f"decode batch size {n}: {exc}") from exc
        if cuda:
            torch.cuda.synchronize(self.target.device)
            self.memory_bytes = max(0, free_before - torch.cuda.mem_get_info(self.target.device)[0])
        self.capture_seconds = time.perf_counter() - start
        self.capture_name = capture.name

    def describe(self) -> str:
        """The startup log line, e.g. "CUDA graphs: captured decode batch sizes [1, 2, 4, 8]
        in 3.1 s, 42 MiB"."""
        line = (
            f"CUDA graphs: captured decode batch sizes {self.sizes} in "
            f"{self.capture_seconds:.1f} s"
        )
        if self.capture_name != CudaGraphCapture.name:
            return f"{line} ({self.capture_name}: no graph, the forward re-runs)"
        return f"{line}, {self.memory_bytes / 2**20:.0f} MiB"

    def run(
        self,
        ids: list[int],
        starts: torch.Tensor,
        tables: list[list[list[int]]],
        logits_indices: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of B requests through the graph of the next captured size.

        Args:
            ids: [B] the token fed per request; starts: [B] int64 tokens already cached (the
                new token's position); tables: per KV-cache group, each request's block ids.
            logits_indices: [S] int64 rows that sample.

        Returns:
            (hidden [B, H] on the device, valid until the next replay; logits_indices there).
        """
        n = self.sizes[bisect.bisect_left(self.sizes, len(ids))]
        logits_indices = self._fill(n, ids, starts, tables, logits_indices)
        with self._masked():
            hidden = self._replays[n]()
        self.num_replays[n] += 1
        return hidden[: len(ids)], logits_indices

    def _fill(
        self,
        n: int,
        ids: list[int],
        starts: torch.Tensor,
        tables: list[list[list[int]]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Write the step's inputs, padded to n rows, into the static buffers (one copy each,
        no host sync); returns logits_indices on the device."""
        b, pad = len(ids), n - len(ids)
        zeros = torch.zeros(pad, dtype=torch.int64)
        host = {
            "input_ids": torch.tensor(ids + [0] * pad, dtype=torch.int64),
            "positions": torch.cat([starts, zeros]),
            "seq_lens": torch.cat([starts + 1, zeros]),
            "row_mask": torch.cat([torch.ones(b, dtype=torch.int64), zeros]),
        }
        for g, group_tables in enumerate(tables):
            table = self._host_table(group_tables, n)
            pos = starts
            slots = table[torch.arange(b), pos // self.block_size] * self.block_size
            scratch = torch.full((pad,), self.scratch_slot, dtype=torch.int64)
            host[f"slot_mapping.{g}"] = torch.cat([slots + pos % self.block_size, scratch])
            host[f"block_tables.{g}"] = table
        self.buffers.begin_step()
        for name, tensor in host.items():
            self.buffers.put(name, tensor)
        out = self.buffers.put("logits_indices", logits_indices)
        self.buffers.end_step()
        return out

    def _host_table(self, tables: list[list[int]], n: int) -> torch.Tensor:
        """[n, W] int64 block tables: the requests' rows, then null-block (0) padding rows."""
        out = torch.zeros(n, self.width, dtype=torch.int64)
        lens = torch.tensor([len(t) for t in tables], dtype=torch.int64)
        if lens.sum() > 0:
            row = torch.repeat_interleave(torch.arange(len(tables)), lens)
            col = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[row]
            out[row, col] = torch.tensor([i for t in tables for i in t], dtype=torch.int64)
        return out

    def _forward(self, n: int) -> Forward:
        """The model's forward over the first n rows of the static buffers."""
        s, width = self.static, self.width
        metas = []
        for g in range(self.num_groups):
            block_tables = s[f"block_tables.{g}"][: n * width].view(n, width)
            batch = AttentionBatch(
                token_start=0, token_end=n, tok_b=self._rows[:n], tok_q=self._zeros[:n],
                block_ids=block_tables.reshape(-1), max_q=1, q_pos=s["positions"][:n].view(n, 1),
                block_tables=block_tables, seq_lens=s["seq_lens"][:n],
                num_keys=width * self.block_size, query_start_loc=self.query_start_loc[: n + 1],
            )  # fmt: skip
            slot_mapping = s[f"slot_mapping.{g}"][:n]
            metas.append(AttentionMetadata(slot_mapping=slot_mapping, batches=[batch]))
        meta = metas[0]
        if len(metas) > 1:
            meta = AttentionMetadata(meta.slot_mapping, meta.batches, groups=metas)
        target, input_ids, positions = self.target, s["input_ids"], s["positions"]

        def forward() -> torch.Tensor:
            for m in metas:  # masks are cached per batch: an eager replay rebuilds them
                m.batches[0].clear_masks()
            # Fresh views per run: the rotary module reuses its cos/sin for the same positions
            # tensor object, which must not carry the warm-up's lookup into the capture.
            return target.model(input_ids[:n], positions[:n], meta, target.kv_caches)

        return forward

    @contextmanager
    def _masked(self) -> Iterator[None]:
        """The recorders weigh rows by the static row mask meanwhile (padding counts 0)."""
        mask = self.static["row_mask"]
        for recorder in self._recorders:
            recorder.set_row_mask(mask)
        try:
            yield
        finally:
            for recorder in self._recorders:
                recorder.set_row_mask(None)
