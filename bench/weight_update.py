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
  - `distributed-bf16`: a trainer process (`trainer_main` of
    bench/weight_update_trainer.py, spawned) is rank 0 of a
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
    tensors), "receive" = time inside `RolloutControl._handshake` and `_receive` (the
    handshake and every bucket's broadcast), "stage" = `StagedWeights.add` (cast and copy
    into the staged copies), "commit" = `StagedWeights.commit` (swap in, re-quantize 4-bit
    experts, rebind = repack the native kernels' weights; its "requantize" and "rebind"
    parts shown too),
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
import json
import logging
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/: the trainer's module

import moe_engine  # noqa: E402, F401  (first: it sets OMP_WAIT_POLICY before torch loads)

# isort: split
import torch  # noqa: E402
from weight_update_report import print_report, yes_no  # noqa: E402
from weight_update_trainer import (  # noqa: E402
    GROUP_NAME,
    GROUP_TIMEOUT_S,
    PERTURB_SCALE,
    PERTURB_SEED,
    Row,
    Trainer,
    UpdatePhases,
    checkpoint_facts,
    checkpoint_tensors,
    ensure_perturbed,
    proc_kib,
    update_once,
)

from moe_engine.engine.launcher import free_port  # noqa: E402
from moe_engine.weight_update.buckets import bucket_layout  # noqa: E402
from moe_engine.weight_update.targets import meta_of  # noqa: E402

logger = logging.getLogger("bench.weight_update")

MiB = 1 << 20
#: The arithmetic's model: 1T parameters in bf16.
TARGET_PARAMS = 10**12
TARGET_BYTES = 2 * TARGET_PARAMS
#: Stated link rates for comparison (Gb/s; arithmetic, not measured).
LINK_GBPS = (25, 100, 400)
#: Rows (`--rows`): name -> (source, quantization).
ROWS = {"disk-bf16": ("disk", "none"), "disk-int4": ("disk", "int4"),
        "distributed-bf16": ("distributed", "none")}


# -- rows -----------------------------------------------------------------------------------


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
    mem = proc_kib("MemTotal", "/proc/meminfo")
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "bf16": bf16,
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "memory_gib": (mem or 0) / 2**20}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_engine.startup.demo import default_cache_dir

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
        from workload import apply_quick_defaults

        apply_quick_defaults(args, argv, {"--runs": 1, "--quant-group-size": 32,
                                          "--output-len": 8})
    args.row_list = [r.strip() for r in args.rows.split(",") if r.strip()]
    if not args.row_list or any(r not in ROWS for r in args.row_list):
        p.error(f"--rows: {args.rows!r}; choose from {','.join(ROWS)}")
    if args.runs < 1 or args.output_len < 1 or args.bucket_mib <= 0:
        p.error("--runs and --output-len must be >= 1, --bucket-mib > 0")
    args.bucket_bytes = max(int(args.bucket_mib * MiB), 1)
    return args


def resolve_checkpoint(args: argparse.Namespace) -> Path:
    """`--model`, else the demo checkpoint (`--quick`), else bench-qwen3-moe (made once)."""
    if args.model is not None:
        return args.model.resolve()
    if args.quick:
        from moe_engine.startup.demo import ensure_demo_checkpoint

        return Path(ensure_demo_checkpoint(str(args.cache_dir)))
    from workload import ensure_bench_checkpoint

    return ensure_bench_checkpoint(args.cache_dir)


def fresh_outputs(perturbed: Path, args: argparse.Namespace, prompts: list[list[int]],
                  quants: list[str]) -> dict[str, list[list[int]]]:
    """The oracle: greedy outputs of a fresh engine on the perturbed copy, per quantization."""
    reference = {}
    for q in quants:
        fresh = load_llm(perturbed, args, q)
        reference[q] = greedy(fresh, prompts, args.output_len)
        del fresh
    return reference


def form_group(llm: Any, trainer: Trainer, metas: dict[str, list],
               bucket_bytes: int) -> dict[str, Any]:
    """The weight-update group of `llm` (ranks 1..) and the trainer (rank 0), formed once."""
    port = free_port()
    trainer.commands.put(("join", port, 2))
    t0 = time.perf_counter()
    llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2,
                                 backend="gloo", group_name=GROUP_NAME,
                                 timeout_s=GROUP_TIMEOUT_S)
    form_s = time.perf_counter() - t0
    return {"form_s": round(form_s, 4), "trainer_join_s": round(trainer.expect("joined"), 4),
            "trainer_ready_s": round(trainer.ready_s, 2),
            "trainer_load_s": round(trainer.load_s, 2),
            "bucket_bytes": bucket_bytes,
            "buckets": len(bucket_layout(metas["original"], bucket_bytes))}


def check_row(row: Row, rec: dict[str, Any], after: list[list[int]],
              reference: dict[str, list[list[int]]], before: list[list[int]]) -> None:
    """After the warm-up update (to the perturbed copy): equal to a fresh start, and changed."""
    row.check = {"version": rec["version"],
                 "equal": after == reference[row.quantization],
                 "changed": after != before,
                 "peak_rss_over_before_mib": (
                     None if rec["peak_rss_over_before_mib"] is None
                     else round(rec["peak_rss_over_before_mib"], 1))}
    logger.info("%s: outputs equal a fresh start: %s", row.name, yes_no(row.check["equal"]))


def run_updates(rows: list[Row], ckpts: dict[str, Path], args: argparse.Namespace,
                prompts: list[list[int]],
                reference: dict[str, list[list[int]]]) -> dict[str, Any] | None:
    """One warm-up round (checked) and `--runs` timed rounds, the rows taking turns; the
    trainer and its group where a row is distributed. Returns the group's facts (or None)."""
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
            group = form_group(llm, trainer, metas, args.bucket_bytes)
        for rnd in range(1 + args.runs):
            for row in rows:
                rec = update_once(row, ckpts, metas, phases, trainer, args.bucket_bytes)
                if rnd == 0:  # the warm-up: to the perturbed copy; the check
                    after = greedy(row.llm, prompts, args.output_len)
                    check_row(row, rec, after, reference, before[row.name])
                else:
                    row.runs.append(rec)
        for row in rows:
            if row.source == "distributed":
                row.llm.destroy_weight_update_group()
    finally:
        phases.uninstall()
        if trainer is not None:
            trainer.close()
    return group


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    started = time.perf_counter()
    load_start = os.getloadavg()
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    ckpt = resolve_checkpoint(args)
    ckpts = {"original": ckpt, "perturbed": ensure_perturbed(ckpt, args.cache_dir)}
    prompts = prompts_for(ckpt)
    quants = sorted({ROWS[r][1] for r in args.row_list})
    reference = fresh_outputs(ckpts["perturbed"], args, prompts, quants)  # the oracle first

    rows: list[Row] = []
    for name in args.row_list:
        source, q = ROWS[name]
        rows.append(Row(name, load_llm(ckpt, args, q), source, q))
    group = run_updates(rows, ckpts, args, prompts, reference)

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
