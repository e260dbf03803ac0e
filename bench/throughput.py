"""Offline throughput on the reference workload (../shared/BENCH.md): moe-engine vs its peers.

Checkpoint `bench-qwen3-moe` (random weights, real Qwen3-MoE architecture, 114.4 M parameters,
made once into the cache directory) and workload `mixed-64` (64 requests, prompts of 32-256
token ids, outputs of 16-256 tokens, greedy, ignore EOS, min_tokens = max_tokens), in two modes
(bench/workload.py): `batched` (everything submitted at once, BENCH.md's figure) and `batch1`
(the first 8 requests one at a time, each its own generate call). Every row is loaded once
(untimed), then the rows take turns: `--warmup` untimed rounds, then `--runs` timed rounds, each
row running each mode once per round (bench/measure.py); a figure is output tokens / seconds of
the generate call(s), median over the timed runs, and each row's ratio is against the best
peer (the fastest row that is not moe-engine) of that mode.

Rows:
  - `moe-engine`, `moe-engine-int4`, ...: moe-engine's offline `LLM`, one per `--quantization`;
  - `transformers-static-batching` (`--baseline transformers`): `generate` in this process,
    static batches of 8 (batch1: batches of 1);
  - `vllm-cpu-bf16`, `vllm-cpu-fp32` (`--baseline vllm`): vLLM's CPU build in each dtype, each
    in its own runner process (bench/vllm_peer.py, bench/vllm_runner.py), in its best
    configuration (both cores, tcmalloc + Intel OpenMP) and, as `vllm-cpu-*-default`, in its
    own default binding (one compute thread, the faster one when the machine is busy);
  - `llama.cpp-f32`, `llama.cpp-bf16`, `llama.cpp-q8_0`, `llama.cpp-q4_0` (`--baseline
    llamacpp`): llama.cpp built from the llama-cpp-python sdist (bench/setup_llamacpp.sh), one
    runner process per GGUF of the same checkpoint (bench/llamacpp_peer.py,
    bench/llamacpp_runner.py), all requests in one batch;
  - any other registered peer (`PEERS`): a runner speaking bench/peer_runner.py's protocol.

    python bench/throughput.py --table --baseline vllm      # the issue's table (many minutes)
    python bench/throughput.py --table --baseline vllm,llamacpp
    python bench/throughput.py --table --baseline all --json
    python bench/throughput.py --num-requests 8 --runs 1 --warmup 0   # smoke run
    python bench/throughput.py --engines moe-engine --json  # one row, one JSON object
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

# what `import moe_engine` sets (its docstring), before torch loads libgomp: this script
# imports torch first (peers' runners get the environment without it: `peer_environ`)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT"] = "1"
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import llamacpp_peer  # noqa: E402
import vllm_peer  # noqa: E402
from local_engines import (  # noqa: E402
    DTYPES,
    ENGINE,
    HF_STATIC,
    HFStaticRow,
    MoeEngineRow,
    engine_row_name,
)
from measure import greedy_agreement, measure_alternating  # noqa: E402
from peer_runner import PeerContext, PeerFamily, PeerRunner  # noqa: E402
from served_engine import SERVED_ROWS, ServedRow  # noqa: E402
from workload import (  # noqa: E402, F401  (re-exported for bench/ep.py, kv_cache.py, serve.py)
    MIXED64_OUTPUT_TOKENS,
    MIXED64_PROMPT_TOKENS,
    MODES,
    BenchEngine,
    BenchRequest,
    ensure_bench_checkpoint,
    mixed_workload,
    mode_requests,
    write_requests_file,
)

logger = logging.getLogger("bench.throughput")

#: `--baseline` name -> the peer. Adding one is an entry here plus its module (its rows and
#: flags, as bench/vllm_peer.py) and its runner (the protocol of bench/peer_runner.py).
PEERS: dict[str, PeerFamily] = {"vllm": vllm_peer.VLLM, "llamacpp": llamacpp_peer.LLAMACPP}
BASELINES = ("transformers", *PEERS)
#: Keys of a row's info the printed report leaves to the JSON (they repeat others).
_REPEATED_INFO = ("preload", "ld_preload", "num_requests", "dtype")
MODE_TITLES = {"batched": "mixed-64 batched", "batch1": "batch 1, first 8 one at a time"}


def is_peer(name: str) -> bool:
    """Every row that is not a moe-engine variant is a peer."""
    return name != ENGINE and not name.startswith(ENGINE + "-")


def _listed(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def selected_baselines(args: argparse.Namespace) -> list[str]:
    """The peer families to load: `--baseline` (`all` = every one), or, when `--engines` is
    given, the families its entries name (`transformers...`, `vllm-cpu...`)."""
    if args.engines:
        wanted = _listed(args.engines)
        prefixes = {"transformers": HF_STATIC, **{k: v.row_prefix for k, v in PEERS.items()}}
        return [k for k, p in prefixes.items()
                if any(w.startswith(p) or p.startswith(w) for w in wanted)]
    chosen = _listed(args.baseline)
    return list(BASELINES) if "all" in chosen else chosen


def inherited_omp_note(args: argparse.Namespace) -> str | None:
    """A warning for the report when the user's own OMP_WAIT_POLICY (not moe-engine's default,
    which `peer_runner.peer_environ` strips) reaches the peers' runners; else None."""
    policy = os.environ.get("OMP_WAIT_POLICY")
    if (not policy or os.environ.get("MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT")
            or not any(f in PEERS for f in selected_baselines(args))):
        return None
    return (f"note: OMP_WAIT_POLICY={policy} from this shell reaches the peers' runners "
            "(llama.cpp's OpenMP ran 6-12x slower at batch 1 under PASSIVE, bench/NOTES.md "
            "section 17); unset it to measure the peers' best")


def row_selected(name: str, args: argparse.Namespace) -> bool:
    """Whether `--engines` (row names; an entry also selects the rows it prefixes, e.g.
    `vllm-cpu` both dtypes) keeps row `name`; everything is kept without `--engines`."""
    if not args.engines:
        return True
    return any(name == w or name.startswith(w + "-") for w in _listed(args.engines))


def load_rows(ckpt: Path, requests: list[BenchRequest], requests_path: Path,
              args: argparse.Namespace) -> tuple[dict[str, BenchEngine], dict[str, dict]]:
    """Load every selected row (untimed): moe-engine variants, then transformers, then peers.
    Returns the loaded rows and `{name: {"error": ...}}` for those that failed to load."""
    loaded: dict[str, BenchEngine] = {}
    failed: dict[str, dict] = {}
    makers: list[tuple[str, Callable[[], BenchEngine]]] = []
    for q in _listed(args.quantization):
        makers.append((engine_row_name(q),
                       lambda q=q: MoeEngineRow(ckpt, requests, args, q)))
    if args.served:
        for name in SERVED_ROWS:
            makers.append((name, lambda name=name: ServedRow(name, ckpt, requests, args)))
    families = selected_baselines(args)
    if "transformers" in families:
        makers.append((HF_STATIC, lambda: HFStaticRow(
            ckpt, requests, args.baseline_dtype or args.dtype, args.batch_size)))
    ctx = PeerContext(ckpt, requests_path, args)
    for family in families:
        if family == "transformers":
            continue
        try:
            for launch in PEERS[family].launches(ctx):
                makers.append((launch.name, lambda launch=launch: PeerRunner(launch, requests)))
        except Exception as exc:  # report the other rows anyway
            logger.exception("%s failed to prepare", family)
            failed[PEERS[family].row_prefix] = {"error": f"{type(exc).__name__}: {exc}"}
    for name, make in makers:
        if not row_selected(name, args):
            continue
        try:
            loaded[name] = make()
        except Exception as exc:
            logger.exception("%s failed to load", name)
            failed[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return loaded, failed


def add_ratios(engines: dict[str, dict], modes: list[str]) -> dict[str, str | None]:
    """Per mode, the best peer's name; each row's figure gets `ratio_vs_best_peer`."""
    best: dict[str, str | None] = {}
    for mode in modes:
        figures = {n: r.get(mode, {}).get("output_tokens_per_s") for n, r in engines.items()}
        peers = {n: f for n, f in figures.items() if is_peer(n) and f}
        best[mode] = max(peers, key=peers.__getitem__) if peers else None
        for name, figure in figures.items():
            if figure and best[mode]:
                engines[name][mode]["ratio_vs_best_peer"] = round(figure / peers[best[mode]], 2)
    return best


def add_served_ratios(engines: dict[str, dict], modes: list[str]) -> None:
    """Each served row's figure gets `ratio_vs_offline`: its tok/s over the offline row's."""
    for name in SERVED_ROWS:
        for mode in modes:
            figure = engines.get(name, {}).get(mode, {}).get("output_tokens_per_s")
            offline = engines.get(ENGINE, {}).get(mode, {}).get("output_tokens_per_s")
            if figure and offline:
                engines[name][mode]["ratio_vs_offline"] = round(figure / offline, 2)


def markdown_table(result: dict) -> str:
    """The rows x modes table, with each row's ratio to the best peer of that mode."""
    modes = result["modes"]
    head = ["engine", "computes in"]
    for mode in modes:
        head += [f"{MODE_TITLES[mode]} tok/s", "vs best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["engines"].items():
        cells = [name, row.get("compute_dtype", "-")]
        for mode in modes:
            r = row.get(mode, {})
            rate = r.get("output_tokens_per_s")
            mark = "**" if name == result["best_peer"].get(mode) else ""
            cells.append(f"{mark}{rate:.1f}{mark}" if rate else
                         f"failed: {r.get('error', row.get('error', 'not run'))}")
            ratio = r.get("ratio_vs_best_peer")
            cells.append(f"{ratio:.2f}x" if ratio else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def print_report(result: dict) -> None:
    """The human-readable report: a header with the workload and load, the table, details."""
    load = result["load_average"]
    print(f"{result['workload']}: {result['num_requests']} requests, {result['prompt_tokens']} "
          f"prompt / {result['output_tokens']} output tokens; dtype {result['dtype']}, "
          f"{result['threads']} threads; median of {result['runs']} runs after "
          f"{result['warmup']} warm-up, rows alternating; {result['date']}; load average "
          f"{load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end")
    print(f"command: {result['command']}")
    if result.get("note"):
        print(result["note"])
    print()
    print(markdown_table(result))
    print("\nbest peer (bold): " + ", ".join(f"{m}: {n}" for m, n in result["best_peer"].items()))
    for name, row in result["engines"].items():
        runs = "; ".join(f"{m} {row[m]['runs_s']} s" for m in result["modes"]
                         if row.get(m, {}).get("runs_s"))
        info = {k: v for k, v in row.get("info", {}).items() if k not in _REPEATED_INFO}
        print(f"  {name}: {runs}  {json.dumps(info)}")
    for name, row in result["engines"].items():
        ratios = [f"{m} {row[m]['ratio_vs_offline']:.2f}x" for m in result["modes"]
                  if row.get(m, {}).get("ratio_vs_offline")]
        if ratios:
            print(f"  {name} against the offline {ENGINE}: {', '.join(ratios)}")
    for names, load in result["idle_cpu"].items():
        if load["share"] is not None:
            print(f"  idle CPU of [{names}] while others ran: {load['share']} cores "
                  f"({load['cpu_s']} s over {load['wall_s']} s)")
    for other, agree in result["greedy_agreement"].items():
        print(f"  greedy agreement {ENGINE} vs {other}: {agree['identical']}/"
              f"{agree['requests']} identical, matching prefix "
              f"{agree['matching_prefix_fraction']:.1%} on average")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_engine.startup.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="store_true",
                   help="the whole table: modes batched,batch1 and moe-engine plain and int4 "
                        "(unless --modes / --quantization say otherwise), printed as markdown")
    p.add_argument("--modes", default=None, help=f"comma-separated of {','.join(MODES)} "
                   "(default batched; with --table both)")
    p.add_argument("--runs", type=int, default=3, help="timed runs per row and mode (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    p.add_argument("--num-requests", type=int, default=64,
                   help="first N requests of mixed-64 (for a quick smoke run)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    p.add_argument("--baseline", default="transformers",
                   help=f"comma-separated peers to compare with, of {','.join(BASELINES)} or "
                        "all (default transformers)")
    p.add_argument("--engines", default=None,
                   help="comma-separated rows to run (a prefix selects its variants, e.g. "
                        "moe-engine,vllm-cpu); overrides --baseline")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help="moe-engine's device (default: the engine's own); peers stay on the CPU")
    p.add_argument("--kernel-backend", default="auto", metavar="SPEC",
                   help="moe-engine's kernel backends (moe-serve --kernel-backend)")
    p.add_argument("--quantization", default=None,
                   help="comma-separated moe-engine rows by 4-bit format, of none, int4, "
                        "mxfp4, int4-all, mxfp4-all (-all: --quantized-layers all, the dense "
                        "projections too; default none; with --table none,int4,int4-all)")
    p.add_argument("--served", action="store_true",
                   help="also moe-engine behind its gRPC front end (moe-serve in its own "
                        "process, this process the client): rows moe-engine-grpc (final_only "
                        "requests) and moe-engine-grpc-stream (every step streamed), each "
                        "with its ratio to the offline row; on with --table")
    p.add_argument("--baseline-dtype", choices=sorted(DTYPES), default=None,
                   help="dtype of the transformers baseline (default: --dtype)")
    p.add_argument("--batch-size", type=int, default=8, help="transformers static batch size")
    for family in PEERS.values():
        family.add_arguments(p)
    p.add_argument("--settle-s", type=float, default=5.0,
                   help="before each run, wait up to this long for the other rows to go idle")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: derived)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where bench-qwen3-moe is made once (default: $MOE_ENGINE_CACHE or "
                        "~/.cache/moe-engine)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--json-out", type=Path, default=None,
                   help="also write the JSON object to this file (with the printed report)")
    args = p.parse_args(argv)
    args.modes = _listed(args.modes or ("batched,batch1" if args.table else "batched"))
    served = [w for w in _listed(args.engines or "") if w in SERVED_ROWS]
    args.served = args.served or args.table or bool(served)
    if args.quantization is None and args.engines:  # `--engines moe-engine-int4` runs int4
        named = [w.removeprefix(ENGINE).lstrip("-") or "none" for w in _listed(args.engines)
                 if not is_peer(w) and w not in SERVED_ROWS]
        args.quantization = ",".join(named) if named else None
    args.quantization = args.quantization or ("none,int4,int4-all" if args.table else "none")
    if args.runs < 1 or args.warmup < 0:
        p.error("--runs must be >= 1 and --warmup >= 0")
    if unknown := [m for m in args.modes if m not in MODES]:
        p.error(f"--modes: unknown {unknown}; choose from {MODES}")
    if not args.engines and (unknown := [b for b in _listed(args.baseline)
                                         if b not in (*BASELINES, "all")]):
        p.error(f"--baseline: unknown {unknown}; choose from {BASELINES} or all")
    return args


def run_benchmark(args: argparse.Namespace, requests: list[BenchRequest], ckpt: Path) -> dict:
    """Load the rows, measure them alternating, close them; the result without the header."""
    requests_path = write_requests_file(requests)
    loaded: dict[str, BenchEngine] = {}
    try:
        loaded, engines = load_rows(ckpt, requests, requests_path, args)
        measured = measure_alternating(loaded, args.modes, args.warmup, args.runs, args.settle_s)
        for name, row in loaded.items():
            engines[name] = {"compute_dtype": row.compute_dtype, "info": row.info,
                             **measured["results"][name]}
        ids = measured["token_ids"]
        agreement = {n: greedy_agreement(ids[ENGINE], t) for n, t in ids.items()
                     if n != ENGINE and ENGINE in ids}
    finally:
        for row in loaded.values():
            row.close()
        loaded.clear()
        gc.collect()
        requests_path.unlink(missing_ok=True)
    order = [n for n in engines if not is_peer(n)] + [n for n in engines if is_peer(n)]
    engines = {n: engines[n] for n in order}
    best = add_ratios(engines, args.modes)
    add_served_ratios(engines, args.modes)
    ratio = engines.get(ENGINE, {}).get("batched", {}).get("ratio_vs_best_peer")
    return {"engines": engines, "best_peer": best, "baseline": best.get("batched"),
            "ratio": ratio, "idle_cpu": measured["idle"], "greedy_agreement": agreement}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    requests = mixed_workload(args.num_requests)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(r.output_len for r in requests)
    if args.num_requests == 64 and (prompt_tokens, output_tokens) != (
        MIXED64_PROMPT_TOKENS, MIXED64_OUTPUT_TOKENS
    ):
        raise RuntimeError(f"mixed-64 drifted: {prompt_tokens} prompt, {output_tokens} output")
    ckpt = ensure_bench_checkpoint(args.cache_dir)
    note = inherited_omp_note(args)
    if note:
        logging.getLogger("bench.throughput").warning("%s", note)
    load_start = os.getloadavg()
    measured = run_benchmark(args, requests, ckpt)
    result = {
        "workload": "mixed-64" if args.num_requests == 64 else f"mixed-64[:{args.num_requests}]",
        "command": " ".join(["python", "bench/throughput.py", *(argv or sys.argv[1:])]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "checkpoint": str(ckpt), "dtype": args.dtype, "device": args.device,
        "kernel_backend": args.kernel_backend, "num_requests": len(requests),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "batch1_output_tokens": sum(r.output_len for r in mode_requests(requests, "batch1")),
        "modes": args.modes, "runs": args.runs, "warmup": args.warmup,
        "threads": torch.get_num_threads(), "alternating": True, **measured,
        **({"note": note} if note else {}),
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0 if all(r.get(m, {}).get("output_tokens_per_s") for r in result["engines"].values()
                    for m in args.modes) else 1


if __name__ == "__main__":
    sys.exit(main())
