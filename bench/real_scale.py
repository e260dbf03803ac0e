"""Real-size benchmark: moe-engine against llama.cpp on gpt-oss-20b- and Qwen3-30B-A3B-shaped
random-weight checkpoints (issue 41), in one sitting, engines alternating.

Steps (everything under `--workdir`, default $MOE_ENGINE_CACHE/real-scale, reused by later runs):
  1. the checkpoint (bench/real_checkpoint.py): gpt-oss-20b as released (MXFP4 experts, bf16
     elsewhere, 3 shards + index, 12.8 GiB), or Qwen3-30B-A3B in bf16 cut to `--layers`;
     `--layers` / `--vocab` cut either (the tests and smoke runs use 2 layers and 8192 ids);
  2. its GGUFs, made by llama.cpp's own converter and `llama_model_quantize`
     (bench/llamacpp_gguf.py, quantized from the bf16 GGUF): gpt-oss `bf16` (experts MXFP4 as
     shipped) and `mxfp4_moe` (attention and LM head Q8_0); Qwen3 `q4_0`; in
     `WORKDIR/gguf/<checkpoint>/`. llama.cpp is built first if missing (bench/setup_llamacpp.sh);
  3. a streaming-read microbenchmark (`torch.sum` over a `--stream-gib` float32 tensor, 2
     threads, median of 7) before the rows load and after they close (bench/real_bytes.py);
  4. the rows, each its own process (load = process start to ready), all up at once
     (`--resident all`) or, at real size where two do not fit in memory (`one`, what `auto`
     picks when the checkpoint is over a quarter of the RAM), one at a time: every round
     starts each row in turn, warms it up (8 x 4 tokens, untimed), runs it, stops it:
     moe-engine as a user runs it, `moe-serve --model DIR` plus the row's flags and
     `--serve-args`, driven over gRPC (bench/served_engine.py); llama.cpp through
     bench/llamacpp_runner.py (bench/peer_runner.py), with its default OpenMP wait policy (NOT
     OMP_WAIT_POLICY=PASSIVE, which slows it up to 7x);
  5. `--runs` rounds (after `--warmup` untimed ones when all are up), every row and mode once
     per round (bench/measure.py):
     `batch1`: the first 8 requests one at a time, 32-token prompt, `--batch1-len` (64) tokens
     each; `batched`: 16 requests of 32-token prompts x `--batched-len` (128) tokens at once;
     medians of tok/s;
  6. peak RSS of each row's process tree (/proc VmHWM: the largest process, and the sum);
  7. the first-token logprob gap to llama.cpp at full depth: for 4 prompts, the engine's top-20
     first-token logprobs against llama.cpp's log-softmax at the same ids (max and mean |gap|,
     argmax agreement), every engine row against every llama.cpp row;
  8. bytes of weights one batch-1 token reads (checkpoint or GGUF tensor sizes: top_k / E of the
     experts, attention, LM head, routers; bench/real_bytes.py) and the read rate, bytes/token
     x batch-1 tok/s, against the streaming read's median;
  9. greedy agreement with transformers in float32 on a 2-layer cut (`--agreement-vocab` ids),
     in a child process (bench/real_agreement.py).
The table goes to stdout (or one JSON object with --json; --json-out FILE writes it too).

    python bench/real_scale.py --model gpt-oss-20b                 # the issue's sitting
    python bench/real_scale.py --model qwen3-30b-a3b --layers 12
    python bench/real_scale.py --model gpt-oss-20b --layers 2 --vocab 8192 --runs 1 \\
        --warmup 0 --stream-gib 1 --serve-args "--max-model-len 1024"   # smoke run, minutes
    python bench/real_scale.py --model gpt-oss-20b --prepare-only  # checkpoint + GGUFs only
"""

from __future__ import annotations

import os

# what `import moe_engine` sets, before torch loads libgomp; stripped for llama.cpp's runners
# (peer_runner.peer_environ)
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import random  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_report  # noqa: E402
from llamacpp_gguf import DEFAULT_ROOT, llama_cpp_src  # noqa: E402
from llamacpp_peer import ensure_llamacpp, llamacpp_launches  # noqa: E402
from measure import measure_alternating  # noqa: E402
from peer_runner import PeerContext, PeerRunner  # noqa: E402
from real_bytes import (  # noqa: E402
    checkpoint_bytes_per_token,
    gguf_bytes_per_token,
    served_bytes_per_token,
    stream_read_gbps,
)
from real_checkpoint import ensure_checkpoint  # noqa: E402
from real_rows import LOGPROB_PROMPTS, FixedBatch1, add_runs, observe, start  # noqa: E402
from served_engine import ServedRow  # noqa: E402
from workload import BenchRequest, write_requests_file  # noqa: E402

from kernels.env import cache_root  # noqa: E402

logger = logging.getLogger("bench.real_scale")

#: Per shipped config: the bits an expert weight has in the checkpoint; the engine rows (name ->
#: moe-serve flags, expert bits as served (None: as stored), attention / LM head bits (None:
#: bf16)); the llama.cpp GGUF types.
MODELS = {
    "gpt-oss-20b": {
        "ckpt_expert_bits": 4.25,
        "engine_rows": {"moe-engine": ([], None, None),
                        "moe-engine-all": (["--quantization", "auto", "--quantized-layers", "all"],
                                           None, 4.25)},
        "gguf_types": "bf16,mxfp4_moe",
    },
    "qwen3-30b-a3b": {
        "ckpt_expert_bits": 16.0,
        "engine_rows": {"moe-engine-int4": (["--quantization", "int4"], 4.25, None),
                        "moe-engine-int4-all": (["--quantization", "int4",
                                                 "--quantized-layers", "all"], 4.25, 4.25)},
        "gguf_types": "q4_0",
    },
}
def workload(vocab: int, n: int = 16, prompt_len: int = 32, output_len: int = 128
             ) -> list[BenchRequest]:
    """`n` requests of `prompt_len` random ids (seed 0) and `output_len` tokens each."""
    rng = random.Random(0)
    return [BenchRequest([rng.randrange(3, vocab) for _ in range(prompt_len)], output_len)
            for _ in range(n)]


def row_makers(ckpt: Path, requests: list[BenchRequest], requests_path: Path,
               args: argparse.Namespace) -> list[tuple[str, Callable[[], FixedBatch1]]]:
    """(name, start the row's process and wait until ready) of every row, engine rows first."""
    model = MODELS[args.model]
    makers = []
    for name, (flags, _, _) in model["engine_rows"].items():
        if args.engines and name not in args.engines:
            continue
        serve = flags + shlex.split(args.serve_args)
        makers.append((name, lambda name=name, serve=serve: ServedRow(
            name, ckpt, requests, argparse.Namespace(dtype="auto"), flags=serve, stream=False)))
    ctx = PeerContext(ckpt, requests_path, args)
    for launch in llamacpp_launches(ctx):
        if not args.engines or launch.name in args.engines:
            makers.append((launch.name, lambda launch=launch: PeerRunner(launch, requests)))
    return [(name, lambda make=make: FixedBatch1(make(), args.batch1_len))
            for name, make in makers]


def read_bytes(model_name: str, ckpt: Path, rows: dict, ggufs: dict[str, Path], root: Path
               ) -> dict:
    """Bytes per batch-1 token of every row: engine rows from the checkpoint (re-stored
    at the row's bits), llama.cpp rows from their GGUF."""
    model = MODELS[model_name]
    ckpt_bytes = checkpoint_bytes_per_token(ckpt)
    out = {"checkpoint": ckpt_bytes}
    for name in rows:
        if name in model["engine_rows"]:
            _, eb, db = model["engine_rows"][name]
            out[name] = served_bytes_per_token(ckpt_bytes, model["ckpt_expert_bits"], eb, db)
        elif name.removeprefix("llama.cpp-") in ggufs:
            out[name] = gguf_bytes_per_token(ggufs[name.removeprefix("llama.cpp-")],
                                             llama_cpp_src(root) / "gguf-py")
    return out


def agreement(args: argparse.Namespace) -> dict:
    """bench/real_agreement.py on the 2-layer cut, in a child process."""
    cut = ensure_checkpoint(args.workdir, args.model, 2, args.agreement_vocab or None,
                            log=logger.info)
    cmd = [sys.executable, str(Path(__file__).with_name("real_agreement.py")), "--model",
           str(cut), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        return {"error": done.stderr[-2000:]}
    res = json.loads(done.stdout.strip().splitlines()[-1])
    return {k: v for k, v in res.items() if not k.endswith("_ids")}


def sitting(args: argparse.Namespace, ckpt: Path, ggufs: dict[str, Path]) -> dict:
    """Steps 3-8 of the module docstring; the result's measurement part.

    `--resident all`: every row up at once, `--warmup` + `--runs` rounds alternating
    (bench/measure.py). `--resident one` (a real-size model: two rows do not fit in memory):
    `--runs` rounds, in each every row in turn started, warmed up (its batch-1 requests, 4
    tokens each, untimed), run once per mode, stopped; load time is then a median too.
    """
    config = json.loads((ckpt / "config.json").read_text())
    requests = workload(config["vocab_size"], 16, 32, args.batched_len)
    requests_path = write_requests_file(requests)
    prompts = [r.prompt_token_ids for r in requests[:LOGPROB_PROMPTS]]
    stream = [stream_read_gbps(args.stream_gib)]
    makers = row_makers(ckpt, requests, requests_path, args)
    info: dict = {name: {} for name, _ in makers}
    tops: dict = {}
    gaps: dict = {}
    modes = ["batch1", "batched"]
    try:
        if args.resident == "all":
            rows = {n: r for n, make in makers if (r := start(n, make, info[n])) is not None}
            try:
                measured = measure_alternating(rows, modes, args.warmup, args.runs,
                                               args.settle_s)
                for name in rows:
                    add_runs(info[name], measured["results"][name])
                observe(rows, info, prompts, tops, gaps)
            finally:
                for row in rows.values():
                    row.close()
        else:
            for _ in range(args.runs):
                for name, make in makers:
                    if "error" in info[name] or (row := start(name, make, info[name])) is None:
                        continue
                    try:
                        row.row.run("batch1", output_len=4)
                        add_runs(info[name], measure_alternating(
                            {name: row}, modes, 0, 1, args.settle_s)["results"][name])
                        observe({name: row}, info, prompts, tops, gaps)
                    except Exception as exc:  # e.g. killed for memory: the others go on
                        logger.exception("%s failed", name)
                        info[name]["error"] = f"{type(exc).__name__}: {exc}"
                    finally:
                        row.close()
    finally:
        requests_path.unlink(missing_ok=True)
    for row in info.values():
        if row.get("load_runs_s"):
            row["load_s"] = statistics.median(row["load_runs_s"])
    stream.append(stream_read_gbps(args.stream_gib))
    return {"resident": args.resident, "rows": info, "logprob_gap": gaps, "stream_read": stream,
            "bytes_per_token": read_bytes(args.model, ckpt, info, ggufs,
                                          Path(args.llamacpp_dir))}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="gpt-oss-20b")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary (default: the config's)")
    p.add_argument("--workdir", type=Path, default=cache_root() / "real-scale",
                   help="checkpoints and GGUFs (default $MOE_ENGINE_CACHE/real-scale, else "
                   "~/.cache/moe-engine/real-scale); a real-size sitting needs ~40 GB free")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--batch1-len", type=int, default=64, help="tokens per batch-1 request")
    p.add_argument("--batched-len", type=int, default=128, help="tokens per batched request")
    p.add_argument("--serve-args", default="", help="extra moe-serve flags for every engine row")
    p.add_argument("--engines", default=None, help="comma-separated rows to run (default all)")
    p.add_argument("--llamacpp-types", default=None,
                   help="GGUF types (default: gpt-oss bf16,mxfp4_moe; Qwen3 q4_0)")
    p.add_argument("--llamacpp-config", action="append", default=None,
                   help="bench/llamacpp_peer.py config of the llama.cpp rows")
    p.add_argument("--llamacpp-dir", default=os.environ.get("LLAMACPP_DIR", str(DEFAULT_ROOT)))
    p.add_argument("--resident", choices=["auto", "all", "one"], default="auto",
                   help="rows up at once (all) or one at a time, restarted every round (one); "
                        "auto: one when the checkpoint is over a quarter of the memory")
    p.add_argument("--stream-gib", type=float, default=4.0)
    p.add_argument("--settle-s", type=float, default=5.0)
    p.add_argument("--agreement-vocab", type=int, default=8192,
                   help="vocabulary of the 2-layer float32 agreement cut (0: the config's)")
    p.add_argument("--no-agreement", action="store_true", help="skip step 9")
    p.add_argument("--prepare-only", action="store_true", help="steps 1-2 only")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--json-out", type=Path, default=None)
    args = p.parse_args(argv)
    args.engines = args.engines.split(",") if args.engines else None
    args.llamacpp_types = args.llamacpp_types or MODELS[args.model]["gguf_types"]
    args.llamacpp_quant_base = "bf16"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    if os.environ.get("OMP_WAIT_POLICY") and not os.environ.get(
            "MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT"):
        logger.warning("OMP_WAIT_POLICY=%s reaches llama.cpp (it slows it up to 7x); unset it",
                       os.environ["OMP_WAIT_POLICY"])
    t0 = time.perf_counter()
    ckpt = ensure_checkpoint(args.workdir, args.model, args.layers, args.vocab, log=logger.info)
    args.llamacpp_gguf_dir = args.workdir / "gguf" / ckpt.name
    ensure_llamacpp(Path(args.llamacpp_dir))
    from llamacpp_gguf import ensure_ggufs

    ggufs = ensure_ggufs(ckpt, Path(args.llamacpp_dir), args.llamacpp_types.split(","), "bf16",
                         args.llamacpp_gguf_dir)
    prepared_s = round(time.perf_counter() - t0, 1)
    logger.info("checkpoint %s and GGUFs %s ready after %.1f s", ckpt, ggufs, prepared_s)
    if args.prepare_only:
        print(json.dumps({"checkpoint": str(ckpt), "ggufs": {k: str(v) for k, v in
                                                             ggufs.items()}}))
        return 0
    if args.resident == "auto":
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
        args.resident = "one" if size > os.sysconf("SC_PHYS_PAGES") * os.sysconf(
            "SC_PAGE_SIZE") / 4 else "all"
    load_start = os.getloadavg()
    result = {"command": " ".join(["python", "bench/real_scale.py", *(argv or sys.argv[1:])]),
              "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "checkpoint": str(ckpt), "ggufs": {k: str(v) for k, v in ggufs.items()},
              "prepare_s": prepared_s, "runs": args.runs, "warmup": args.warmup,
              "batch1": {"requests": 8, "prompt_len": 32, "output_len": args.batch1_len},
              "batched": {"requests": 16, "prompt_len": 32, "output_len": args.batched_len},
              **sitting(args, ckpt, ggufs)}
    if not args.no_agreement:
        result["agreement"] = agreement(args)
    result["load_average"] = {"start": load_start, "end": os.getloadavg()}
    real_report.add_figures(result)
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result) if args.json else real_report.render(result))
    return 0 if all(r.get("batch1", {}).get("output_tokens_per_s")
                    for r in result["rows"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
