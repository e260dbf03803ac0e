"""Expert-load trace files: a versioned NPZ (numpy `savez_compressed`) of per-step routing counts.

Schema (format_version 1; docs/trace_format.md is the reference, kept in step with this module):

| key              | dtype     | shape     | meaning                                             |
|------------------|-----------|-----------|-----------------------------------------------------|
| `format_version` | int64     | []        | 1                                                   |
| `moe_layers`     | int64     | [L]       | decoder-layer index of each MoE layer, ascending    |
| `counts`         | int32     | [S, L, E] | token-expert pairs routed to each expert, per row   |
| `step_time_s`    | float64   | [S]       | wall seconds of the row's engine steps (summed)     |
| `num_tokens`     | int64     | [S]       | tokens (not pairs) the row's steps ran              |
| `num_steps`      | int64     | [S]       | engine steps aggregated into the row (>= 1)         |
| `rank_tokens`    | int32     | [S, L, R] | optional: tokens received per EP rank (dispatch)    |
| `meta`           | str (0-d) | []        | JSON object: model, ep_size, num_experts, top_k,    |
|                  |           |           | placement (object or null), start_time_unix, and    |
|                  |           |           | n_group (expert groups) when the model has groups   |

A row is one engine step, or `aggregate_steps` consecutive steps summed (counts, times, tokens).
Everything loads with `numpy.load(path, allow_pickle=False)`.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_VERSION = 1
_REQUIRED = ("format_version", "moe_layers", "counts", "step_time_s", "num_tokens", "meta")


class TraceFormatError(ValueError):
    """A trace file that is missing, unreadable, of another format version, or inconsistent."""


@dataclass
class ExpertTrace:
    """One trace in memory (see the module docstring for the schema).

    Attributes:
        moe_layers: [L] int64 decoder-layer indices.
        counts: [S, L, E] int32 token-expert pairs per row, MoE layer and expert.
        step_time_s: [S] float64 seconds per row.
        num_tokens: [S] int64 tokens per row.
        num_steps: [S] int64 engine steps per row.
        rank_tokens: [S, L, R] int32 tokens received per rank, or None.
        meta: free-form facts (model, ep_size, num_experts, top_k, placement, start_time_unix).
    """

    moe_layers: np.ndarray
    counts: np.ndarray
    step_time_s: np.ndarray
    num_tokens: np.ndarray
    num_steps: np.ndarray
    rank_tokens: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return int(self.counts.shape[0])

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[2])

    def total_counts(self) -> np.ndarray:
        """[L, E] int64: the counts summed over all rows."""
        return self.counts.sum(axis=0, dtype=np.int64)

    def validate(self) -> None:
        """Check dtypes and that every array agrees on S, L, E.

        Raises:
            TraceFormatError: naming the field, its shape and the expected one.
        """
        if self.counts.ndim != 3:
            raise TraceFormatError(
                f"counts must be [steps, moe_layers, experts], got shape {self.counts.shape}"
            )
        s, num_layers, num_experts = self.counts.shape
        if num_experts < 1:
            raise TraceFormatError("counts has 0 experts")
        expected = {
            "moe_layers": (self.moe_layers, (num_layers,)),
            "step_time_s": (self.step_time_s, (s,)),
            "num_tokens": (self.num_tokens, (s,)),
            "num_steps": (self.num_steps, (s,)),
        }
        for name, (array, shape) in expected.items():
            if array.shape != shape:
                raise TraceFormatError(
                    f"{name} has shape {array.shape}, expected {shape} "
                    f"(counts is {(s, num_layers, num_experts)})"
                )
        for name in ("counts", "moe_layers", "num_tokens", "num_steps"):
            if not np.issubdtype(getattr(self, name).dtype, np.integer):
                raise TraceFormatError(f"{name} must be integers, got {getattr(self, name).dtype}")
        if not np.issubdtype(self.step_time_s.dtype, np.floating):
            raise TraceFormatError(f"step_time_s must be floats, got {self.step_time_s.dtype}")
        if (self.counts < 0).any():
            raise TraceFormatError("counts has negative entries")
        if num_layers and (np.diff(self.moe_layers) <= 0).any():
            raise TraceFormatError(f"moe_layers must ascend, got {self.moe_layers.tolist()}")
        if self.rank_tokens is not None:
            rt = self.rank_tokens
            if rt.ndim != 3 or rt.shape[:2] != (s, num_layers):
                raise TraceFormatError(
                    f"rank_tokens has shape {rt.shape}, expected ({s}, {num_layers}, ep_size)"
                )
        meta_experts = self.meta.get("num_experts")
        if meta_experts is not None and meta_experts != num_experts:
            raise TraceFormatError(
                f"meta num_experts is {meta_experts} but counts has {num_experts} experts"
            )
        n_group = self.meta.get("n_group")
        if n_group is not None and (
            not isinstance(n_group, int) or n_group < 1 or num_experts % n_group
        ):
            raise TraceFormatError(
                f"meta n_group is {n_group!r}; it must be an integer >= 1 dividing the "
                f"{num_experts} experts"
            )


def write_trace(path: str | os.PathLike[str], trace: ExpertTrace) -> None:
    """Write `trace` to `path` atomically (a temporary file in the same folder, then a rename).

    Raises:
        TraceFormatError: when the trace is inconsistent (see `ExpertTrace.validate`).
        OSError: when the folder cannot be written.
    """
    trace.validate()
    arrays: dict[str, np.ndarray] = dict(
        format_version=np.asarray(FORMAT_VERSION, dtype=np.int64),
        moe_layers=np.asarray(trace.moe_layers, dtype=np.int64),
        counts=np.asarray(trace.counts, dtype=np.int32),
        step_time_s=np.asarray(trace.step_time_s, dtype=np.float64),
        num_tokens=np.asarray(trace.num_tokens, dtype=np.int64),
        num_steps=np.asarray(trace.num_steps, dtype=np.int64),
        meta=np.asarray(json.dumps(trace.meta, sort_keys=True)),
    )
    if trace.rank_tokens is not None:
        arrays["rank_tokens"] = np.asarray(trace.rank_tokens, dtype=np.int32)
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:  # a file object: savez would append ".npz" to a bare name
        np.savez_compressed(f, **arrays)
    os.replace(tmp, target)


def read_trace(path: str | os.PathLike[str]) -> ExpertTrace:
    """Load and validate a trace file.

    Raises:
        TraceFormatError: missing file, not an NPZ, a missing key, another format_version,
            bad meta JSON, or arrays whose shapes disagree (the message names the field).
    """
    p = Path(path)
    if not p.is_file():
        raise TraceFormatError(f"trace file {str(p)!r} does not exist")
    try:
        npz = np.load(p, allow_pickle=False)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise TraceFormatError(f"{str(p)!r} is not an NPZ trace file: {exc}") from exc
    if not isinstance(npz, np.lib.npyio.NpzFile):
        raise TraceFormatError(f"{str(p)!r} is a single .npy array, not an NPZ trace file")
    with npz:
        keys = set(npz.files)
        if "format_version" not in keys:
            raise TraceFormatError(
                f"{str(p)!r} has no format_version: not a moe-engine expert trace "
                f"(keys: {sorted(keys)})"
            )
        version = int(npz["format_version"])
        if version != FORMAT_VERSION:
            raise TraceFormatError(
                f"{str(p)!r} has trace format_version {version}; this moe-engine reads "
                f"version {FORMAT_VERSION} only"
            )
        missing = [k for k in _REQUIRED if k not in keys]
        if missing:
            raise TraceFormatError(f"{str(p)!r} lacks required field(s) {missing}")
        try:
            meta = json.loads(str(npz["meta"]))
        except json.JSONDecodeError as exc:
            raise TraceFormatError(f"meta is not valid JSON: {exc}") from exc
        if not isinstance(meta, dict):
            raise TraceFormatError(f"meta must be a JSON object, got {type(meta).__name__}")
        counts = npz["counts"]
        num_steps = npz["num_steps"] if "num_steps" in keys else np.ones(len(counts), np.int64)
        trace = ExpertTrace(
            moe_layers=npz["moe_layers"],
            counts=counts,
            step_time_s=npz["step_time_s"],
            num_tokens=npz["num_tokens"],
            num_steps=num_steps,
            rank_tokens=npz["rank_tokens"] if "rank_tokens" in keys else None,
            meta=meta,
        )
    trace.validate()
    return trace


class TraceWriter:
    """Collects per-step counts in memory and writes them as a trace (used by `--expert-trace`).

    `add_step` copies the step's numbers into preallocated numpy buffers (amortised doubling);
    nothing touches the disk until `flush()` or `close()`, which (re)write the whole file
    atomically. Rows are `aggregate_steps` consecutive steps summed, which bounds memory on long
    runs: L * E * 4 bytes per row.

    Args:
        path: the NPZ file to write.
        moe_layers: decoder-layer indices of the MoE layers, ascending.
        num_experts: E.
        ep_size: ranks whose received tokens `add_step(rank_tokens=...)` gives (1: none).
        meta: extra facts stored in `meta` (model, top_k, placement, ...); `num_experts`,
            `ep_size`, `aggregate_steps` and `start_time_unix` are filled in.
        aggregate_steps: engine steps summed into one row (>= 1).

    Raises:
        ValueError: aggregate_steps < 1 or num_experts < 1.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        moe_layers: list[int],
        num_experts: int,
        ep_size: int = 1,
        meta: dict[str, Any] | None = None,
        aggregate_steps: int = 1,
    ) -> None:
        if aggregate_steps < 1:
            raise ValueError(f"aggregate_steps must be >= 1, got {aggregate_steps}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be >= 1, got {num_experts}")
        self.path = Path(path)
        self.moe_layers = np.asarray(sorted(moe_layers), dtype=np.int64)
        self.num_experts, self.ep_size, self.aggregate_steps = num_experts, ep_size, aggregate_steps
        self.meta = dict(meta or {})
        self.meta.update(
            num_experts=num_experts,
            ep_size=ep_size,
            aggregate_steps=aggregate_steps,
            start_time_unix=self.meta.get("start_time_unix", time.time()),
        )
        num_layers = len(self.moe_layers)
        self._counts = np.zeros((16, num_layers, num_experts), dtype=np.int32)
        self._rank_tokens: np.ndarray | None = None
        self._time = np.zeros(16, dtype=np.float64)
        self._tokens = np.zeros(16, dtype=np.int64)
        self._steps = np.zeros(16, dtype=np.int64)
        self._rows = 0  # complete and partial rows in use
        self.closed = False

    def _grow(self) -> None:
        cap = 2 * len(self._time)
        for name in ("_counts", "_rank_tokens", "_time", "_tokens", "_steps"):
            old = getattr(self, name)
            if old is not None:
                new = np.zeros((cap, *old.shape[1:]), dtype=old.dtype)
                new[: len(old)] = old
                setattr(self, name, new)

    def add_step(
        self,
        counts: Any,
        step_time_s: float,
        num_tokens: int,
        rank_tokens: Any | None = None,
    ) -> None:
        """Append one engine step.

        Args:
            counts: [L, E] integer token-expert pairs of this step (numpy or a torch tensor on
                any device; it is copied to host here).
            step_time_s: the step's wall time in seconds.
            num_tokens: tokens the step ran.
            rank_tokens: optional [L, ep_size] tokens received per rank.

        Raises:
            ValueError: shapes that disagree with the writer's (naming both); RuntimeError after
                close().
        """
        if self.closed:
            raise RuntimeError(f"trace writer for {str(self.path)!r} is closed")
        step = _to_numpy(counts)
        if step.shape != self._counts.shape[1:]:
            raise ValueError(f"counts has shape {step.shape}, expected {self._counts.shape[1:]}")
        ranks = None
        if rank_tokens is not None:
            ranks = _to_numpy(rank_tokens)
            if ranks.shape != (len(self.moe_layers), self.ep_size):
                raise ValueError(
                    f"rank_tokens has shape {ranks.shape}, expected "
                    f"{(len(self.moe_layers), self.ep_size)}"
                )
            if self._rank_tokens is None:
                if self._rows:
                    raise ValueError("rank_tokens must be given from the first step on")
                self._rank_tokens = np.zeros(
                    (len(self._time), *ranks.shape), dtype=np.int32
                )
        elif self._rank_tokens is not None:
            raise ValueError("rank_tokens was given for earlier steps; give it every step")
        if self._rows == 0 or self._steps[self._rows - 1] >= self.aggregate_steps:
            if self._rows == len(self._time):
                self._grow()
            self._rows += 1
        row = self._rows - 1
        self._counts[row] += step.astype(np.int32, copy=False)
        if ranks is not None:
            self._rank_tokens[row] += ranks.astype(np.int32, copy=False)
        self._time[row] += float(step_time_s)
        self._tokens[row] += int(num_tokens)
        self._steps[row] += 1

    def snapshot(self) -> ExpertTrace:
        """The rows so far (copies) as an `ExpertTrace`."""
        n = self._rows
        return ExpertTrace(
            moe_layers=self.moe_layers.copy(),
            counts=self._counts[:n].copy(),
            step_time_s=self._time[:n].copy(),
            num_tokens=self._tokens[:n].copy(),
            num_steps=self._steps[:n].copy(),
            rank_tokens=None if self._rank_tokens is None else self._rank_tokens[:n].copy(),
            meta=dict(self.meta),
        )

    def flush(self) -> None:
        """(Re)write the whole file with the rows so far (atomic rename)."""
        write_trace(self.path, self.snapshot())

    def close(self) -> None:
        """Write the file and refuse further steps; a second close does nothing."""
        if not self.closed:
            self.flush()
            self.closed = True

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PeriodicTraceWriter(TraceWriter):
    """A `TraceWriter` that also rewrites its file every `flush_interval_s` seconds (when
    `maybe_flush` is called once per step), so a server that is killed still leaves a trace
    of all but its last seconds.

    Args:
        flush_interval_s: seconds between rewrites (default 10).
        other arguments: as `TraceWriter`.
    """

    def __init__(self, *args: Any, flush_interval_s: float = 10.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flush_interval_s = flush_interval_s
        self._last_flush = time.monotonic()

    def maybe_flush(self) -> None:
        """Rewrite the file when the interval has passed since the last write."""
        now = time.monotonic()
        if now - self._last_flush >= self.flush_interval_s:
            self.flush()
            self._last_flush = now


def _to_numpy(x: Any) -> np.ndarray:
    """numpy view/copy of a numpy array or a torch tensor (any device)."""
    if hasattr(x, "detach"):
        return x.detach().cpu().numpy()
    return np.asarray(x)
