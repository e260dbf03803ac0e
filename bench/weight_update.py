"""RL weight updates without a restart (issue 20): how fast new weights reach a serving engine.

Checkpoint `bench-qwen3-moe` (bench/workload.py: 114 M parameters, bfloat16, 229 MB, random
weights, made once into the cache directory) unless `--model` names another (`--quick`: the
demo checkpoint). A perturbed copy is made once beside it under the cache directory
(`<name>-perturbed-s1`: every floating tensor + 0.01 x randn under seed 1, the same files,
names and config.json). Each row is one offline `moe_engine.LLM` (loaded once, untimed) whose
updates alternate between the perturbed copy and the original, so that every update really
changes the weights:

  - `disk-bf16`: `llm.update_weights_from_disk(folder, version)`, bfloat16 experts. The page
    cache is warm: both folders were just written or read (the warm-up round reads them), and
    nothing drops caches, so "read" comes out of the page cache, not from the disk.
  - `disk-int4`: the same with `quantization="int4"`: the update re-quantizes every expert
    it touches (all of them) on the fly.
  - `distributed-bf16`: a trainer process (`trainer_main` below, spawned) is rank 0 of a
    weight-update group over gloo on loopback; per update it broadcasts the checkpoint's
    tensors (already in its memory, sorted by name) in buckets of `--bucket-mib` (32 MiB,
    `moe_engine.rl.WeightSync`'s default over gloo), while the engine runs
    `llm.update_weights_from_distributed(metas, version)` with the same list. The group is
    formed once (timed once, reported apart) and reused by every update.

Figures per row, median of `--runs` (3) timed updates after one warm-up update, the rows
taking turns update after update:
  - seconds: the engine's own `ControlReply.seconds` (the whole update: checks, read or
    receive, staging, commit, prefix-cache flush); GB/s = `num_bytes` (the bytes of the
    tensors taken, as received) / seconds, decimal GB;
  - the split, timed by wrapping the engine's functions in this process (monkeypatching,
    nothing changed in them): "read" = time inside `DiskUpdate.tensors` (safetensors ->
    tensors), "receive" = time inside `RolloutControl._receive` (the handshake and every
    bucket's broadcast), "stage" = `StagedWeights.add` (cast and copy into the staged
    copies), "commit" = `StagedWeights.commit` (swap in, re-quantize 4-bit experts, rebind =
    repack the native kernels' weights; its "requantize" and "rebind" parts shown too),
    "other" = the rest (resolving names, reading headers, the flush);
  - distributed: the trainer's own wall time for the update after the handshake (pack +
    broadcast of every bucket) and its GB/s;
  - peak RSS above the RSS before the update (the staged copy; /proc/self/clear_refs),
    first update of the row (later ones may reuse memory the allocator kept);
  - correctness, once per row: after the warm-up update (to the perturbed copy) greedy
    output of 2 short prompts must equal a fresh `LLM` started on the perturbed copy (same
    dtype and quantization); "outputs equal a fresh start: yes/no", exit status 1 on no.

Then arithmetic (not measured): a 1T-parameter model in bf16 (2.0 TB) at each measured rate
and at link rates of 25, 100 and 400 Gb/s. A broadcast sends every byte to every engine rank
(under expert parallelism each rank keeps only its experts but receives every bucket), so an
update is bound by one link's rate; it is not divided by the number of ranks.

    python bench/weight_update.py                       # the table (under a minute on 2 cores)
    python bench/weight_update.py --json-out wu.json    # and the raw numbers
    python bench/weight_update.py --bucket-mib 64 --runs 5
    python bench/weight_update.py --quick               # seconds: demo checkpoint, one run
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import logging
import multiprocessing
import os
import queue
import random
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_engine  # noqa: E402, F401  (first: it sets OMP_WAIT_POLICY before torch loads)

# isort: split
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from moe_engine.loader import safetensors_files  # noqa: E402
from moe_engine.weight_update.buckets import bucket_layout, nbytes_of, pack  # noqa: E402
from moe_engine.weight_update.group import WeightGroup  # noqa: E402
from moe_engine.weight_update.targets import meta_of  # noqa: E402

logger = logging.getLogger("bench.weight_update")

MiB = 1 << 20
#: The perturbation of the "next RL step": floating tensors + SCALE x randn under SEED.
PERTURB_SEED, PERTURB_SCALE = 1, 0.01
#: The arithmetic's model: 1T parameters in bf16.
TARGET_PARAMS = 10**12
TARGET_BYTES = 2 * TARGET_PARAMS
#: Stated link rates for comparison (Gb/s; arithmetic, not measured).
LINK_GBPS = (25, 100, 400)
GROUP_NAME = "weight_update"
GROUP_TIMEOUT_S = 120.0
#: Rows (`--rows`): name -> (source, quantization).
ROWS = {"disk-bf16": ("disk", "none"), "disk-int4": ("disk", "int4"),
        "distributed-bf16": ("distributed", "none")}


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
        files = safetensors_files(src)
        for entry in src.iterdir():
            if entry.is_file() and entry.suffix != ".safetensors":
                shutil.copy2(entry, tmp / entry.name)
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
            save_file(out, str(tmp / file.name), metadata={"format": "pt"})
        (tmp / marker.name).write_text(json.dumps(made_from) + "\n")
        shutil.rmtree(final, ignore_errors=True)  # a stale copy (made from another folder)
        os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# -- the engine's phases --------------------------------------------------------------------


class UpdatePhases:
    """Seconds an update spends in the engine's functions, by wrapping them (class attributes
    and `staging.rebind`), restored by `uninstall`. Keys: "read" (inside `DiskUpdate.tensors`),
    "receive" (inside `RolloutControl._receive`), "stage" (`StagedWeights.add`), "commit"
    (`StagedWeights.commit`), and within commit "requantize" (`StagedWeights._requantized`)
    and "rebind" (`staging.rebind`)."""

    KEYS = ("read", "receive", "stage", "commit", "requantize", "rebind")

    def __init__(self) -> None:
        self.totals = dict.fromkeys(self.KEYS, 0.0)
        self._undo: list[tuple[Any, str, Any]] = []

    def install(self) -> UpdatePhases:
        from moe_engine.weight_update import staging
        from moe_engine.weight_update.control import RolloutControl
        from moe_engine.weight_update.disk import DiskUpdate

        self._wrap_iter(DiskUpdate, "tensors", "read")
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


def _status_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
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
                t0 = time.perf_counter()
                ok = group.agree(False)
                t1 = time.perf_counter()
                if not ok:
                    results.put(("refused", None))
                    continue
                layout = bucket_layout(metas[key], bucket_bytes)
                for bucket in layout:
                    group.broadcast(pack(bucket, values[key]))
                t2 = time.perf_counter()
                results.put(("sent", {"handshake_s": t1 - t0, "transfer_s": t2 - t1,
                                      "buckets": len(layout),
                                      "bytes": sum(nbytes_of(m) for m in metas[key])}))
        if group is not None:
            group.close()
    except BaseException as exc:
        results.put(("error", f"{type(exc).__name__}: {exc}"))
        raise


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """The parent's handle on a `trainer_main` process (spawned; the target is imported as
    module `weight_update` from bench/, which the child's sys.path has, however this file was
    loaded)."""

    def __init__(self, paths: dict[str, Path]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.commands, self.results = ctx.Queue(), ctx.Queue()
        target = importlib.import_module("weight_update").trainer_main
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


# -- rows -----------------------------------------------------------------------------------


class Row:
    """One engine and its updates."""

    def __init__(self, name: str, llm: Any, source: str, quantization: str) -> None:
        self.name, self.llm, self.source, self.quantization = name, llm, source, quantization
        self.updates = 0
        self.runs: list[dict[str, Any]] = []
        self.check: dict[str, Any] = {}


def load_llm(path: Path, args: argparse.Namespace, quantization: str) -> Any:
    from moe_engine import LLM

    return LLM(str(path), dtype=args.dtype, max_model_len=args.max_model_len,
               kv_cache_memory=args.kv_cache_memory, quantization=quantization,
               quant_group_size=args.quant_group_size)


def prompts_for(path: Path) -> list[list[int]]:
    """Two short prompts of random ids (seeded) inside the checkpoint's vocabulary."""
    vocab = int(json.loads((path / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    return [[rng.randint(3, vocab - 1) for _ in range(n)] for n in (8, 13)]


def greedy(llm: Any, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    from moe_engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def update_once(row: Row, ckpts: dict[str, Path], metas: dict[str, list], phases: UpdatePhases,
                trainer: Trainer | None, bucket_bytes: int) -> dict[str, Any]:
    """The row's next update (to the perturbed copy when it has had an even number, else the
    original), timed."""
    key = "perturbed" if row.updates % 2 == 0 else "original"
    version = f"v{row.updates}"
    row.updates += 1
    phases.take()
    peak_ok = reset_peak_rss()
    rss_before = _status_kib("VmRSS")
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
    hwm = _status_kib("VmHWM")
    ph = phases.take()
    moved = ph["read"] + ph["receive"]
    rec = {
        "to": key, "version": version, "seconds": reply.seconds, "wall_s": wall,
        "num_tensors": reply.num_tensors, "num_bytes": reply.num_bytes,
        "gb_s": reply.num_bytes / reply.seconds / 1e9,
        "phases": {**ph, "other": max(reply.seconds - moved - ph["stage"] - ph["commit"], 0.0)},
        "peak_rss_over_before_mib": ((hwm - rss_before) / 1024 if peak_ok and hwm is not None
                                     and rss_before is not None else None),
    }
    if sent is not None:
        rec["trainer"] = {**sent, "gb_s": sent["bytes"] / sent["transfer_s"] / 1e9}
    logger.info("%s -> %s (%s): %.3f s, %.3f GB/s (read %.3f, receive %.3f, stage %.3f, "
                "commit %.3f: requantize %.3f, rebind %.3f)%s", row.name, key, version,
                reply.seconds, rec["gb_s"], ph["read"], ph["receive"], ph["stage"],
                ph["commit"], ph["requantize"], ph["rebind"],
                f"; trainer {sent['transfer_s']:.3f} s" if sent else "")
    return rec


def _median(xs: list[float]) -> float:
    return statistics.median(xs)


def summarize(row: Row) -> dict[str, Any]:
    runs = row.runs
    seconds = _median([r["seconds"] for r in runs])
    num_bytes = runs[-1]["num_bytes"]
    out: dict[str, Any] = {
        "row": row.name, "source": row.source, "quantization": row.quantization,
        "experts": "int4" if row.quantization == "int4" else "bf16",
        "compute_dtype": str(row.llm.engine.dtype).removeprefix("torch."),
        "num_tensors": runs[-1]["num_tensors"], "num_bytes": num_bytes,
        "seconds": round(seconds, 4), "runs_s": [round(r["seconds"], 4) for r in runs],
        "wall_s": round(_median([r["wall_s"] for r in runs]), 4),
        "gb_s": round(num_bytes / seconds / 1e9, 4),
        "phases": {k: round(_median([r["phases"][k] for r in runs]), 4)
                   for k in (*UpdatePhases.KEYS, "other")},
        "peak_rss_over_before_mib_first": row.check.get("peak_rss_over_before_mib"),
        "peak_rss_over_before_mib_runs": [None if r["peak_rss_over_before_mib"] is None
                                          else round(r["peak_rss_over_before_mib"], 1)
                                          for r in runs],
        "equal": row.check.get("equal"), "changed": row.check.get("changed"),
        "check_version": row.check.get("version"),
    }
    if row.source == "distributed":
        t = [r["trainer"] for r in runs]
        transfer = _median([x["transfer_s"] for x in t])
        out["trainer"] = {
            "transfer_s": round(transfer, 4), "runs_s": [round(x["transfer_s"], 4) for x in t],
            "handshake_s": round(_median([x["handshake_s"] for x in t]), 4),
            "buckets": t[-1]["buckets"], "bytes": t[-1]["bytes"],
            "gb_s": round(t[-1]["bytes"] / transfer / 1e9, 4),
        }
    return out


def arithmetic(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds for TARGET_BYTES at each measured rate and at LINK_GBPS (arithmetic)."""
    measured = []
    for r in rows:
        measured.append({"rate": f"{r['row']} (engine)", "gb_s": r["gb_s"],
                         "seconds": round(TARGET_BYTES / (r["gb_s"] * 1e9), 1)})
        if "trainer" in r:
            g = r["trainer"]["gb_s"]
            measured.append({"rate": f"{r['row']} (trainer send)", "gb_s": g,
                             "seconds": round(TARGET_BYTES / (g * 1e9), 1)})
    links = [{"gbit_s": g, "gb_s": g / 8, "seconds": round(TARGET_BYTES / (g * 1e9 / 8), 1)}
             for g in LINK_GBPS]
    return {"params": TARGET_PARAMS, "bytes": TARGET_BYTES, "measured": measured,
            "links": links}


# -- report ---------------------------------------------------------------------------------


def _yes(flag: bool | None) -> str:
    return {True: "yes", False: "no", None: "-"}[flag]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| row | experts | seconds | runs (s) | GB/s | read / receive s | stage s | "
             "commit s (requantize, rebind) | other s | trainer s | trainer GB/s | "
             "peak RSS + (first) | outputs equal a fresh start |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        p = r["phases"]
        moved = p["read"] if r["source"] == "disk" else p["receive"]
        t = r.get("trainer")
        rss = r["peak_rss_over_before_mib_first"]
        lines.append(
            f"| {r['row']} | {r['experts']} | {r['seconds']:.3f} | "
            f"{' / '.join(f'{x:.3f}' for x in r['runs_s'])} | {r['gb_s']:.3f} | "
            f"{moved:.3f} | {p['stage']:.3f} | {p['commit']:.3f} ({p['requantize']:.3f}, "
            f"{p['rebind']:.3f}) | {p['other']:.3f} | {_s(t['transfer_s'] if t else None)} | "
            f"{_s(t['gb_s'] if t else None)} | "
            f"{'-' if rss is None else f'{rss:.0f} MiB'} | {_yes(r['equal'])} |")
    return "\n".join(lines)


def arithmetic_table(a: dict[str, Any]) -> str:
    tb = a["bytes"] / 1e12
    lines = [f"| rate | GB/s | {a['params'] / 1e12:.0f}T parameters in bf16 ({tb:.1f} TB) |",
             "|---|---:|---:|"]
    for m in a["measured"]:
        lines.append(f"| measured: {m['rate']} | {m['gb_s']:.3f} | {m['seconds']:,.0f} s |")
    for link in a["links"]:
        lines.append(f"| stated link {link['gbit_s']} Gb/s (arithmetic) | {link['gb_s']:.3f} | "
                     f"{link['seconds']:,.0f} s |")
    return "\n".join(lines)


def print_report(res: dict[str, Any]) -> None:
    load, m, c = res["load_average"], res["machine"], res["checkpoint"]
    print(f"command: {res['command']}")
    print(f"{res['date']}; {m['cpu']}, {m['cores']} cores ({m['bf16']}), {m['threads']} torch "
          f"threads, {m['memory_gib']:.0f} GiB, torch {m['torch']}; load average "
          f"{' '.join(f'{x:.2f}' for x in load['start'])} at start, "
          f"{' '.join(f'{x:.2f}' for x in load['end'])} at end; {res['duration_s']:.0f} s")
    print(f"checkpoint {c['path']} ({c['params'] / 1e6:.1f} M parameters, {c['tensors']} "
          f"tensors, {c['bytes'] / 1e6:.0f} MB); perturbed copy {res['perturbed']}; dtype "
          f"{res['dtype']}, int4 group size {res['quant_group_size']}")
    print(f"median of {res['runs']} updates after 1 warm-up, rows taking turns, updates "
          f"alternating between the perturbed copy and the original; page cache warm (both "
          f"folders read in the warm-up round, no cache dropped): 'read' comes out of the "
          f"page cache, not from the disk")
    if res.get("group"):
        g = res["group"]
        print(f"distributed: gloo on loopback, buckets of {g['bucket_bytes'] / MiB:g} MiB "
              f"({g['buckets']} per update); trainer process started with both checkpoints "
              f"in its memory in {g['trainer_ready_s']:.1f} s (loading them "
              f"{g['trainer_load_s']:.1f} s); group formed once in {g['form_s']:.3f} s "
              f"(init_weight_update_group; not in the rows)")
    print()
    print(markdown_table(res["rows"]))
    print()
    print("seconds: the engine's own (ControlReply.seconds); GB/s: bytes taken (as received) / "
          "seconds, decimal; the split by wrapping the engine's functions (monkeypatched): "
          "read = DiskUpdate.tensors, receive = RolloutControl._receive (handshake + "
          "broadcasts), stage = StagedWeights.add, commit = StagedWeights.commit (requantize = "
          "_requantized, rebind = staging.rebind); trainer s: pack + broadcast after the "
          "handshake; peak RSS +: VmHWM over VmRSS before the row's first update (the staged "
          "copy, and the checkpoint pages safetensors maps while reading; the rows share this "
          "process, so a later row may reuse memory an earlier one freed)")
    for r in res["rows"]:
        print(f"  {r['row']}: outputs equal a fresh start: {_yes(r['equal'])} (after the "
              f"update to the perturbed copy, {r['check_version']}; the update changed the "
              f"outputs: {_yes(r['changed'])})")
    print()
    print("arithmetic, not measured: the same update for a 1T-parameter model at each rate")
    print()
    print(arithmetic_table(res["arithmetic"]))
    print()
    print("  a broadcast sends every byte to every engine rank (under expert parallelism a "
          "rank keeps only its experts but receives every bucket), so the time is bound by "
          "one link's rate, not divided by the number of ranks")


# -- main -----------------------------------------------------------------------------------


def machine_facts() -> dict[str, Any]:
    cpu, flags = "unknown CPU", set()
    try:
        info = Path("/proc/cpuinfo").read_text()
        if m := re.search(r"^model name\s*:\s*(.+)$", info, re.M):
            cpu = m.group(1).strip()
        if m := re.search(r"^flags\s*:\s*(.+)$", info, re.M):
            flags = set(m.group(1).split())
    except OSError:
        pass
    bf16 = ("AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags
            else "no native bf16")
    mem = _meminfo_kib("MemTotal")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "bf16": bf16,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "memory_gib": (mem or 0) / 2**20}


def _meminfo_kib(field: str) -> int | None:
    try:
        m = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_engine.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint folder (default: bench-qwen3-moe; with --quick the demo "
                        "checkpoint); its perturbed copy is made under --cache-dir")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated of {','.join(ROWS)}")
    p.add_argument("--runs", type=int, default=3, help="timed updates per row (median)")
    p.add_argument("--bucket-mib", type=float, default=32.0,
                   help="bytes per broadcast of the distributed row (MiB)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--quant-group-size", type=int, default=128, help="of the int4 row")
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache-memory", default="64MiB", help="per engine")
    p.add_argument("--output-len", type=int, default=16, help="greedy tokens of the check")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where bench-qwen3-moe and the perturbed copy are made once")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: demo checkpoint (unless --model), one run, "
                        "int4 groups of 32, 8 output tokens (each can still be given)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--json-out", type=Path, default=None, help="also write it to this file")
    args = p.parse_args(argv)
    if args.quick:
        given = {a.split("=")[0] for a in (argv if argv is not None else sys.argv[1:])}
        for flag, value in (("--runs", 1), ("--quant-group-size", 32), ("--output-len", 8)):
            if flag not in given:
                setattr(args, flag[2:].replace("-", "_"), value)
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not args.row_list or any(r not in ROWS for r in args.row_list):
        p.error(f"--rows: {args.rows!r}; choose from {','.join(ROWS)}")
    if args.runs < 1 or args.output_len < 1 or args.bucket_mib <= 0:
        p.error("--runs and --output-len must be >= 1, --bucket-mib > 0")
    args.bucket_bytes = max(int(args.bucket_mib * MiB), 1)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    started = time.perf_counter()
    load_start = os.getloadavg()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    if args.model is not None:
        ckpt = args.model.resolve()
    elif args.quick:
        from moe_engine.demo import ensure_demo_checkpoint

        ckpt = Path(ensure_demo_checkpoint(str(args.cache_dir)))
    else:
        from workload import ensure_bench_checkpoint

        ckpt = ensure_bench_checkpoint(args.cache_dir)
    ckpts = {"original": ckpt, "perturbed": ensure_perturbed(ckpt, args.cache_dir)}
    prompts = prompts_for(ckpt)

    # the oracle first: a fresh engine on the perturbed copy, per quantization
    quants = sorted({ROWS[r][1] for r in args.row_list})
    reference = {}
    for q in quants:
        fresh = load_llm(ckpts["perturbed"], args, q)
        reference[q] = greedy(fresh, prompts, args.output_len)
        del fresh

    rows: list[Row] = []
    for name in args.row_list:
        source, q = ROWS[name]
        rows.append(Row(name, load_llm(ckpt, args, q), source, q))
    before = {row.name: greedy(row.llm, prompts, args.output_len) for row in rows}

    metas: dict[str, list] = {}
    trainer: Trainer | None = None
    group: dict[str, Any] | None = None
    phases = UpdatePhases().install()
    try:
        if any(r.source == "distributed" for r in rows):
            for key, path in ckpts.items():
                metas[key] = [meta_of(n, t) for n, t in checkpoint_tensors(path).items()]
            trainer = Trainer(ckpts)
            llm = next(r for r in rows if r.source == "distributed").llm
            port = _free_port()
            trainer.commands.put(("join", port, 2))
            t0 = time.perf_counter()
            llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2,
                                         backend="gloo", group_name=GROUP_NAME,
                                         timeout_s=GROUP_TIMEOUT_S)
            form_s = time.perf_counter() - t0
            group = {"form_s": round(form_s, 4), "trainer_join_s": round(trainer.expect("joined"),
                                                                         4),
                     "trainer_ready_s": round(trainer.ready_s, 2),
                     "trainer_load_s": round(trainer.load_s, 2),
                     "bucket_bytes": args.bucket_bytes,
                     "buckets": len(bucket_layout(metas["original"], args.bucket_bytes))}
        for rnd in range(1 + args.runs):
            for row in rows:
                rec = update_once(row, ckpts, metas, phases, trainer, args.bucket_bytes)
                if rnd == 0:  # the warm-up: to the perturbed copy; the check
                    after = greedy(row.llm, prompts, args.output_len)
                    row.check = {"version": rec["version"],
                                 "equal": after == reference[row.quantization],
                                 "changed": after != before[row.name],
                                 "peak_rss_over_before_mib": (
                                     None if rec["peak_rss_over_before_mib"] is None
                                     else round(rec["peak_rss_over_before_mib"], 1))}
                    logger.info("%s: outputs equal a fresh start: %s", row.name,
                                _yes(row.check["equal"]))
                else:
                    row.runs.append(rec)
        for row in rows:
            if row.source == "distributed":
                row.llm.destroy_weight_update_group()
    finally:
        phases.uninstall()
        if trainer is not None:
            trainer.close()

    table = [summarize(r) for r in rows]
    res: dict[str, Any] = {
        "command": " ".join(["python", "bench/weight_update.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": date, "machine": machine_facts(),
        "checkpoint": {"path": str(ckpt), **checkpoint_facts(ckpt)},
        "perturbed": str(ckpts["perturbed"]),
        "perturbation": {"seed": PERTURB_SEED, "scale": PERTURB_SCALE},
        "dtype": args.dtype, "quant_group_size": args.quant_group_size, "runs": args.runs,
        "warmup": 1, "page_cache": "warm", "prompts": prompts, "output_len": args.output_len,
        "group": group, "rows": table, "arithmetic": arithmetic(table),
        "equal": all(r["equal"] for r in table),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "duration_s": round(time.perf_counter() - started, 1),
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(res, indent=1) + "\n")
    if args.json:
        print(json.dumps(res))
    else:
        print_report(res)
    return 0 if res["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
