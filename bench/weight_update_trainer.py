"""The update side of bench/weight_update.py: what runs each weight update and times its phases.

  - checkpoints: every tensor of a folder in name order (`checkpoint_tensors`), its counts
    from the headers (`checkpoint_facts`), and the perturbed copy every other update goes to
    (`ensure_perturbed`: floating tensors + 0.01 x randn under seed 1, made once);
  - `UpdatePhases`: seconds inside the engine's update functions, by wrapping them in this
    process (monkeypatching, restored by `uninstall`);
  - peak RSS: `reset_peak_rss` (/proc/self/clear_refs), `proc_kib` (VmRSS, VmHWM);
  - the trainer: `trainer_main`, rank 0 of the weight-update group in a spawned process, and
    `Trainer`, the parent's handle on it (commands and reports over two queues);
  - `Row` and `update_once`: one engine and its next update (from disk or from the trainer),
    timed.

Imported by bench/weight_update.py as module `weight_update_trainer` (bench/ on sys.path, which
the command arranges and a spawned child inherits), so the trainer's target imports by name.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import os
import queue
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import moe_engine  # noqa: F401  (first: it sets OMP_WAIT_POLICY before torch loads)

# isort: split
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe_engine.models.loader import safetensors_files
from moe_engine.weight_update.buckets import nbytes_of
from moe_engine.weight_update.group import WeightGroup
from moe_engine.weight_update.targets import meta_of

logger = logging.getLogger("bench.weight_update")

#: The perturbation of the "next RL step": floating tensors + SCALE x randn under SEED.
PERTURB_SEED, PERTURB_SCALE = 1, 0.01
GROUP_NAME = "weight_update"
GROUP_TIMEOUT_S = 120.0


# -- checkpoints ----------------------------------------------------------------------------


def checkpoint_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of every safetensors file of `path`, in sorted name order."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        tensors.update(load_file(str(file)))
    return dict(sorted(tensors.items()))


def checkpoint_facts(path: str | Path) -> dict[str, int]:
    """Tensors, parameters and bytes of a checkpoint, from its files' headers."""
    tensors = params = nbytes = 0
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                piece = f.get_slice(name)
                n = 1
                for d in piece.get_shape():
                    n *= d
                tensors += 1
                params += n
                nbytes += n * _SAFETENSORS_ITEMSIZE.get(piece.get_dtype(), 4)
    return {"tensors": tensors, "params": params, "bytes": nbytes}


_SAFETENSORS_ITEMSIZE = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1, "I32": 4, "I64": 8,
                         "F64": 8, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def ensure_perturbed(src: Path, cache_dir: Path, seed: int = PERTURB_SEED,
                     scale: float = PERTURB_SCALE) -> Path:
    """`cache_dir/<src name>-perturbed-s<seed>`: `src`'s files with `scale * randn` added to
    every floating tensor (file by file in `safetensors_files` order, names sorted, one
    generator seeded `seed`; rounded back to the tensor's dtype), the other files (config.json,
    an index) copied. Made once, atomically; remade when it was made from another folder."""
    final = cache_dir / f"{src.name}-perturbed-s{seed}"
    made_from = {"source": str(src.resolve()), "seed": seed, "scale": scale}
    marker = final / "perturbed_from.json"
    if marker.is_file() and json.loads(marker.read_text()) == made_from:
        return final
    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("creating %s", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=cache_dir))
    try:
        _write_perturbed(src, tmp, seed, scale)
        (tmp / marker.name).write_text(json.dumps(made_from) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # a stale copy (made from another folder)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _write_perturbed(src: Path, dst: Path, seed: int, scale: float) -> None:
    """`src`'s non-safetensors files copied into `dst`, its safetensors files perturbed."""
    files = safetensors_files(src)
    for entry in src.iterdir():
        if entry.is_file() and entry.suffix != ".safetensors":
            shutil.copy2(entry, dst / entry.name)
    gen = torch.Generator().manual_seed(seed)
    for file in files:
        tensors = load_file(str(file))
        out = {}
        for name in sorted(tensors):
            t = tensors[name]
            if t.is_floating_point():
                noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
                t = (t.float() + scale * noise).to(t.dtype)
            out[name] = t.contiguous()
        save_file(out, str(dst / file.name), metadata={"format": "pt"})


# -- the engine's phases --------------------------------------------------------------------


class UpdatePhases:
    """Seconds an update spends in the engine's functions, by wrapping them (class attributes
    and `staging.rebind`), restored by `uninstall`. Keys: "read" (inside `DiskUpdate.tensors`),
    "receive" (inside `RolloutControl._handshake` and `_receive`), "stage"
    (`StagedWeights.add`), "commit" (`StagedWeights.commit`), and within commit
    "requantize" (`StagedWeights._requantized`) and "rebind" (`staging.rebind`)."""

    KEYS = ("read", "receive", "stage", "commit", "requantize", "rebind")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.KEYS, 0.0)
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> UpdatePhases:
        from moe_engine.weight_update import staging
        from moe_engine.weight_update.control import RolloutControl
        from moe_engine.weight_update.disk import DiskUpdate

        self._wrap_iter(DiskUpdate, "tensors", "read")
        self._wrap(RolloutControl, "_handshake", "receive")
        self._wrap_iter(RolloutControl, "_receive", "receive")
        self._wrap(staging.StagedWeights, "add", "stage")
        self._wrap(staging.StagedWeights, "commit", "commit")
        self._wrap(staging.StagedWeights, "_requantized", "requantize")
        self._wrap(staging, "rebind", "rebind")
        return self

    def uninstall(self) -> None:
        for owner, attr, orig in reversed(self._undo):
            setattr(owner, attr, orig)
        self._undo = []

    def take(self) -> dict[str, float]:
        """Seconds per key since the last take."""
        out, self.totals = self.totals, dict.fromkeys(self.KEYS, 0.0)
        return out

    def _wrap(self, owner: Any, attr: str, key: str) -> None:
        orig = getattr(owner, attr)
        totals = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                totals.totals[key] += time.perf_counter() - t

        self._undo.append((owner, attr, orig))
        setattr(owner, attr, timed)

    def _wrap_iter(self, owner: Any, attr: str, key: str) -> None:
        """Time only the generator's own work (each `next`), not its consumer's."""
        orig = getattr(owner, attr)
        totals = self

        def timed(*args: Any, **kwargs: Any) -> Any:
            it = iter(orig(*args, **kwargs))
            while True:
                t = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                finally:
                    totals.totals[key] += time.perf_counter() - t
                yield item

        self._undo.append((owner, attr, orig))
        setattr(owner, attr, timed)


def proc_kib(field: str, file: str = "/proc/self/status") -> int | None:
    """A "<field>: <n> kB" line of a /proc file (this process's status by default), in KiB."""
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path(file).read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its RSS; False where Linux does not let it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


# -- the trainer ----------------------------------------------------------------------------


def trainer_main(paths: dict[str, str], commands: Any, results: Any) -> None:
    """Rank 0 of the weight-update group, in its own (spawned) process.

    Loads every checkpoint of `paths` (key -> folder; all safetensors files, names sorted)
    into memory, says ("ready", seconds), then obeys `commands`: ("join", port, world_size)
    hosts the store and forms the group -> ("joined", seconds); ("send", key, bucket_bytes)
    waits for the engine's verdict on the list, then packs and broadcasts every bucket ->
    ("sent", {"handshake_s", "transfer_s", "buckets", "bytes"}) or ("refused", None);
    ("stop",) leaves. An error is reported as ("error", text) before the process exits 1.
    One torch thread: packing is a copy, and the engine computes on the same cores."""
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        tensors = {k: checkpoint_tensors(p) for k, p in paths.items()}
        metas = {k: [meta_of(n, t) for n, t in ts.items()] for k, ts in tensors.items()}
        values = {k: list(ts.values()) for k, ts in tensors.items()}
        results.put(("ready", time.perf_counter() - t0))
        group: WeightGroup | None = None
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            if cmd[0] == "join":
                _, port, world_size = cmd
                t0 = time.perf_counter()
                group = WeightGroup("127.0.0.1", port, 0, world_size, "gloo", GROUP_NAME,
                                    GROUP_TIMEOUT_S)
                results.put(("joined", time.perf_counter() - t0))
            elif cmd[0] == "send":
                assert group is not None, "send before join"
                _, key, bucket_bytes = cmd
                results.put(_send(group, metas[key], values[key], bucket_bytes))
        if group is not None:
            group.close()
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _send(group: WeightGroup, metas: list, values: list[torch.Tensor],
          bucket_bytes: int) -> tuple[str, Any]:
    """One update's side of the trainer: the engine's verdict, then every bucket broadcast."""
    t0 = time.perf_counter()
    ok = group.agree(False)
    t1 = time.perf_counter()
    if not ok:
        return ("refused", None)
    buckets = group.send(metas, values, bucket_bytes)
    t2 = time.perf_counter()
    return ("sent", {"handshake_s": t1 - t0, "transfer_s": t2 - t1, "buckets": buckets,
                     "bytes": sum(nbytes_of(m) for m in metas)})


class Trainer:
    """The parent's handle on a `trainer_main` process (spawned; the target is imported as
    module `weight_update_trainer` from bench/, which the child's sys.path has, however this
    file was loaded)."""

    def __init__(self, paths: dict[str, Path]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        target = importlib.import_module("weight_update_trainer").trainer_main
        self.proc = ctx.Process(target=target, name="bench-weight-trainer", daemon=True,
                                args=({k: str(p) for k, p in paths.items()}, self.commands,
                                      self.results))
        t0 = time.perf_counter()
        self.proc.start()
        self.load_s = self.expect("ready", 300.0)  # the checkpoints, inside the child
        self.ready_s = time.perf_counter() - t0  # the process started, imports, checkpoints

    def expect(self, kind: str, timeout_s: float = GROUP_TIMEOUT_S) -> Any:
        """The trainer's next report, which must be `kind`.

        Raises:
            RuntimeError: another report, an error, the process gone, or nothing in time.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                got, value = self.results.get(timeout=0.5)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"the trainer exited ({self.proc.exitcode}) before "
                                       f"{kind!r}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {kind!r} from the trainer in {timeout_s:.0f} s"
                                       ) from None
        if got != kind:
            raise RuntimeError(f"the trainer said {got!r} ({value}), expected {kind!r}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            self.commands.put(("stop",))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)


# -- one update -----------------------------------------------------------------------------


class Row:
    """One engine and its updates."""

    def __init__(self, name: str, llm: Any, source: str, quantization: str) -> None:
        self.name, self.llm, self.source, self.quantization = name, llm, source, quantization
        self.updates = 0
        self.runs: list[dict[str, Any]] = []
        self.check: dict[str, Any] = {}


def update_once(row: Row, ckpts: dict[str, Path], metas: dict[str, list], phases: UpdatePhases,
                trainer: Trainer | None, bucket_bytes: int) -> dict[str, Any]:
    """The row's next update (to the perturbed copy when it has had an even number, else the
    original), timed."""
    key = "perturbed" if row.updates % 2 == 0 else "original"
    version = f"v{row.updates}"
    row.updates += 1
    phases.take()
    peak_ok = reset_peak_rss()
    rss_before = proc_kib("VmRSS")
    t0 = time.perf_counter()
    if row.source == "disk":
        reply = row.llm.update_weights_from_disk(str(ckpts[key]), version)
        sent = None
    else:
        assert trainer is not None
        trainer.commands.put(("send", key, bucket_bytes))
        reply = row.llm.update_weights_from_distributed(metas[key], version,
                                                        bucket_bytes=bucket_bytes)
    wall = time.perf_counter() - t0
    if row.source == "distributed":
        sent = trainer.expect("sent")
    hwm = proc_kib("VmHWM")
    ph = phases.take()
    rec = _record(key, version, reply, wall, ph, sent, (
        (hwm - rss_before) / 1024 if peak_ok and hwm is not None and rss_before is not None
        else None))
    logger.info("%s -> %s (%s): %.3f s, %.3f GB/s (read %.3f, receive %.3f, stage %.3f, "
                "commit %.3f: requantize %.3f, rebind %.3f)%s", row.name, key, version,
                reply.seconds, rec["gb_s"], ph["read"], ph["receive"], ph["stage"],
                ph["commit"], ph["requantize"], ph["rebind"],
                f"; trainer {sent['transfer_s']:.3f} s" if sent else "")
    return rec


def _record(key: str, version: str, reply: Any, wall: float, ph: dict[str, float],
            sent: dict[str, Any] | None, peak_rss_mib: float | None) -> dict[str, Any]:
    """One update's figures: the engine's reply, the phases (and "other", the rest of the
    reply's seconds), the peak RSS over the RSS before, and the trainer's send."""
    moved = ph["read"] + ph["receive"]
    rec = {
        "to": key, "version": version, "seconds": reply.seconds, "wall_s": wall,
        "num_tensors": reply.num_tensors, "num_bytes": reply.num_bytes,
        "gb_s": reply.num_bytes / reply.seconds / 1e9,
        "phases": {**ph, "other": max(reply.seconds - moved - ph["stage"] - ph["commit"], 0.0)},
        "peak_rss_over_before_mib": peak_rss_mib,
    }
    if sent is not None:
        rec["trainer"] = {**sent, "gb_s": sent["bytes"] / sent["transfer_s"] / 1e9}
    return rec
