"""End to end on one CUDA GPU: random-weight cuts of real releases served by the engine.

    python bench/gpu_e2e.py --case qwen3-30b-a3b-bf16 --out DIR     # on the GPU machine
    python bench/gpu_e2e.py --plan                                   # any machine: what it does
    python bench/gpu_e2e.py --dry-run --case deepseek-v2-lite-bf16   # CPU, tiny shapes

Each case (`CASES`) is a shipped config (tests/data/configs) cut to `--layers` decoder layers and
a `--vocab`-id vocabulary, written with random weights by `bench/real_checkpoint.py` (the real
layer shapes: 128 experts of 2048x768 for Qwen3-30B-A3B, 32 MXFP4 experts of 2880x2880 for
gpt-oss-20b, MLA rank 512 + rope 64 and 64 experts for DeepSeek-V2-Lite), then:

1. exact: transformers in float32 on the device against the engine in float32 (greedy ids of
   `PROMPTS` prompts x `OUTPUT_LEN` tokens identical); cases whose engine weights are not the
   checkpoint's values (int4 at load) skip it.
2. graphs vs eager: the engine in the case's dtype and quantization with CUDA graphs, then with
   `enforce_eager`: identical greedy ids; the graphed ids' agreement with transformers' float32
   ids is reported (bf16 rounding may move a near tie: reported, not gated).
3. decode step time at batch 1, 8 and 64 (`(time of 1 + STEPS tokens - time of 1 token) /
   STEPS`, prompts of 16 tokens), against the roofline: bytes one decode step must read (every
   non-expert weight, the LM head, the experts a batch of B hits in expectation under uniform
   routing, E * (1 - (1 - k/E)^B) per layer, the KV cache of the batch) / the device's copy
   bandwidth (1 GiB `copy_`, read + write). Kernels per decode step: CUDA kernels that
   torch.profiler sees in eager decode steps (the graph of a step holds the same kernels).
4. memory (cases with `memory`): the engine at the default `--gpu-memory-utilization 0.9` and
   the config's `max_model_len`, after one prompt of `max_model_len - 1` tokens: device memory
   in use must stay within 0.9 of the total.

One JSON object per case on stdout, and `<out>/e2e-<case>.json` rewritten after every part (with
`"partial": true` until the case ends, so a run stopped by its timeout keeps what it finished);
exit 1 when a gated check fails or a step raises. `--dry-run` runs the same code on this CPU
with tiny versions of the configs (hidden 64, 8 experts, vocab 512: `tiny_config`), the
engine's CPU kernels, no graphs and no memory step: it proves the script, its numbers mean
nothing. `--plan` prints, without
building anything, each case's checkpoint size and its roofline bytes per decode step.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # what `import moe_engine` sets first

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_checkpoint  # noqa: E402
from measure import greedy_agreement  # noqa: E402

PROMPTS, PROMPT_LEN, OUTPUT_LEN = 4, 16, 16
BATCHES, STEPS = (1, 8, 64), 32
MEMORY_UTILIZATION = 0.9
#: int4 at load: group 128, float32 scales (`quant.int4`): bytes per weight.
INT4_BYTES = 0.5 + 4 / 128


@dataclass(frozen=True)
class Case:
    """One served configuration: shipped config `stem`, `--quantization`, whether the engine's
    weights are the checkpoint's values (so float32 must match transformers exactly), whether
    the memory step runs."""

    stem: str
    quantization: str = "none"
    exact: bool = True
    memory: bool = False


CASES = {
    "qwen3-30b-a3b-bf16": Case("qwen3-30b-a3b", memory=True),
    "qwen3-30b-a3b-int4": Case("qwen3-30b-a3b", "int4", exact=False),
    "gpt-oss-20b-mxfp4": Case("gpt-oss-20b"),  # the checkpoint's own MXFP4 experts
    "deepseek-v2-lite-bf16": Case("deepseek-v2-lite"),
}


def tiny_config(config: dict) -> dict:
    """`config` with the widths of a test fixture (same model type, layer kinds, routing):
    hidden 64, 4 heads of 16 (2 KV heads), 8 experts (top-2) of 32 (64 for MXFP4, which needs
    multiples of 32), vocab 512, MLA rank 32 + rope 8."""
    small = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 64, "moe_intermediate_size": 32,
             "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
             "num_experts_per_tok": 2, "experts_per_token": 2, "kv_lora_rank": 32,
             "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
             "max_position_embeddings": 1024, "sliding_window": 8}
    out = {**config, **{k: v for k, v in small.items() if k in config}}
    if out["model_type"] == "deepseek_v2":
        out["num_key_value_heads"] = out["num_attention_heads"]
    out["vocab_size"] = 512
    for key, fallback in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0)):
        if isinstance(out.get(key), int) and out[key] >= 512:
            out[key] = 509 + fallback
    return out


def case_config(case: Case, layers: int, vocab: int, tiny: bool) -> dict:
    config = real_checkpoint.shipped_config(case.stem, layers, None if tiny else vocab)
    return tiny_config(config) if tiny else config


def _expert_bytes(config: dict, quantization: str) -> tuple[int, int]:
    """(bytes of all routed experts' tensors of one layer, experts per layer)."""
    specs = real_checkpoint.tensor_specs({**config, "num_hidden_layers": 1,
                                          "first_k_dense_replace": 0})
    nbytes = sum(s.nbytes for s in specs if ".mlp.experts." in s.name)
    if quantization == "int4":
        nbytes = int(nbytes / 2 * INT4_BYTES)  # bf16 values at 2 bytes each -> int4
    experts = next(config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts")
                   if k in config)
    return nbytes, experts


def _kv_bytes_per_token(config: dict) -> int:
    """bf16 KV cache bytes per token over every layer (MLA: the latent and rope key)."""
    if "kv_lora_rank" in config:
        per_layer = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
    else:
        per_layer = 2 * config["num_key_value_heads"] * config["head_dim"] * 2
    return per_layer * config["num_hidden_layers"]


def roofline_bytes(config: dict, quantization: str, batch: int, context: int) -> int:
    """Bytes one decode step of `batch` sequences of `context` tokens reads (module docstring)."""
    specs = real_checkpoint.tensor_specs(config)
    dense = sum(s.nbytes for s in specs
                if ".mlp.experts." not in s.name and "embed_tokens" not in s.name)
    per_layer, experts = _expert_bytes(config, quantization)
    top_k = next(config[k] for k in ("num_experts_per_tok", "experts_per_token") if k in config)
    hit = experts * (1 - (1 - top_k / experts) ** batch)
    moe_layers = sum(1 for i in range(config["num_hidden_layers"])
                     if i >= config.get("first_k_dense_replace", 0))
    embed = batch * config["hidden_size"] * 2
    kv = batch * context * _kv_bytes_per_token(config)
    return int(dense + moe_layers * per_layer * hit / experts + embed + kv)


def prompts_for(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab - 3) for _ in range(length)] for _ in range(n)]


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def hf_ids(ckpt: Path, prompts: list[list[int]], device: str) -> list[list[int]]:
    """transformers' float32 greedy ids, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    config = json.loads((ckpt / "config.json").read_text())
    kwargs = {}
    if config.get("quantization_config", {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, **kwargs)
    model = model.to(device).eval()  # not device_map=: that needs accelerate
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p], device=device), max_new_tokens=OUTPUT_LEN,
                                 min_new_tokens=OUTPUT_LEN, do_sample=False, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    del model
    _free()
    return out


def make_llm(ckpt: Path, device: str, **kwargs):
    from moe_engine import LLM

    kwargs.setdefault("kv_cache_memory", "4GiB" if device == "cuda" else 2**26)
    kwargs.setdefault("max_model_len", 512)
    return LLM(model=str(ckpt), device=device, **kwargs)


def greedy(llm, prompts: list[list[int]], tokens: int) -> tuple[list[list[int]], float]:
    """Greedy ids of `tokens` tokens per prompt and the call's wall seconds."""
    from moe_engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, min_tokens=tokens,
                            ignore_eos=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0


def step_times(llm, vocab: int, copy_gbs: float, config: dict, quantization: str) -> list[dict]:
    """Decode step milliseconds at each of `BATCHES` and the roofline they are held to."""
    rows = []
    for batch in BATCHES:
        prompts = prompts_for(vocab, batch, PROMPT_LEN, seed=batch)
        greedy(llm, prompts, 2)  # compile / warm what this batch size takes
        _, one = greedy(llm, prompts, 1)
        _, many = greedy(llm, prompts, 1 + STEPS)
        step_ms = max(many - one, 0.0) / STEPS * 1e3
        nbytes = roofline_bytes(config, quantization, batch, PROMPT_LEN + STEPS // 2)
        floor_ms = nbytes / (copy_gbs * 1e9) * 1e3
        rows.append({"batch": batch, "step_ms": round(step_ms, 3), "roofline_bytes": nbytes,
                     "roofline_ms": round(floor_ms, 3),
                     "pct_of_roofline": round(100 * floor_ms / step_ms, 1) if step_ms else None})
    return rows


def kernels_per_step(llm, vocab: int) -> float | None:
    """CUDA kernels per eager decode step: (kernels of 1 + 8 tokens - of 1 token) / 8."""
    if not torch.cuda.is_available():
        return None
    from torch.profiler import ProfilerActivity, profile

    prompts = prompts_for(vocab, 1, PROMPT_LEN, seed=7)
    counts = []
    for tokens in (1, 9):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            greedy(llm, prompts, tokens)
        counts.append(sum(1 for e in prof.events() if e.device_type.name == "CUDA"))
    return (counts[1] - counts[0]) / 8


def copy_bandwidth_gbs(device: str) -> float:
    """(read + write) bytes of a 1 GiB `copy_` / its median time (64 MiB on a CPU)."""
    n = 2**30 if device == "cuda" else 2**26
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(7):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * n / sorted(times)[len(times) // 2] / 1e9


def memory_check(ckpt: Path, config: dict, device: str) -> dict:
    """Device memory after a `max_model_len - 1`-token prompt at the default utilization."""
    max_len = int(config["max_position_embeddings"])
    llm = make_llm(ckpt, device, kv_cache_memory=None, max_model_len=max_len,
                   gpu_memory_utilization=MEMORY_UTILIZATION)
    prompt = prompts_for(config["vocab_size"], 1, max_len - 1, seed=3)
    _, seconds = greedy(llm, prompt, 1)
    free, total = torch.cuda.mem_get_info()
    row = {"max_model_len": max_len, "prompt_s": round(seconds, 2),
           "used_gib": round((total - free) / 2**30, 2), "total_gib": round(total / 2**30, 2),
           "max_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2)}
    row["ok"] = total - free <= MEMORY_UTILIZATION * total * 1.02  # 2%: the CUDA context
    del llm
    _free()
    return row


def _attempt(result: dict, key: str, fn, save=None) -> object:
    """`fn()`, or None with `result["errors"][key]` set to what it raised; `save(result)` after
    it either way, so a run stopped by its timeout keeps the parts it finished."""
    try:
        return fn()
    except Exception as exc:  # one failing step must not hide the others' results
        result.setdefault("errors", {})[key] = f"{type(exc).__name__}: {exc}"[:500]
        return None
    finally:
        if save is not None:
            save(result)


def checkpoint_for(case: Case, config: dict, args: argparse.Namespace) -> Path:
    if args.dry_run:
        dest = Path(tempfile.mkdtemp(prefix=f"gpu-e2e-{case.stem}-", dir=args.workdir))
        real_checkpoint.write_checkpoint(config, dest, log=lambda *a: None)
        return dest
    return real_checkpoint.ensure_checkpoint(args.workdir, case.stem, args.layers, args.vocab,
                                             keep_free=2 * 10**9)


def run_case(name: str, args: argparse.Namespace, save=lambda result: None) -> dict:
    """Every step of one case (module docstring); `ok` is the gated verdict, False (with
    `partial`) in what `save` writes before the last step."""
    case, device = CASES[name], "cpu" if args.dry_run else "cuda"
    config = case_config(case, args.layers, args.vocab, args.dry_run)
    result: dict = {"case": name, "device": device, "dry_run": args.dry_run,
                    "layers": config["num_hidden_layers"], "vocab": config["vocab_size"],
                    "ok": False, "partial": True}
    t0 = time.perf_counter()
    ckpt = checkpoint_for(case, config, args)
    result |= {"checkpoint": str(ckpt), "checkpoint_s": round(time.perf_counter() - t0, 1),
               "copy_gbs": round(copy_bandwidth_gbs(device), 1)}
    prompts = prompts_for(config["vocab_size"], PROMPTS, PROMPT_LEN, seed=0)
    save(result)
    theirs = _attempt(result, "transformers", lambda: hf_ids(ckpt, prompts, device), save)
    if case.exact and theirs is not None:
        def fp32() -> list[list[int]]:
            llm = make_llm(ckpt, device, dtype="float32")
            return greedy(llm, prompts, OUTPUT_LEN)[0]

        ours = _attempt(result, "engine_fp32", fp32, save)
        _free()
        result["fp32_exact"] = ours == theirs
    served: dict = {"quantization": case.quantization}
    if case.quantization == "int4" and args.dry_run:
        served["quant_group_size"] = 32  # 128 does not divide the tiny widths

    def graphs() -> list[list[int]]:
        llm = make_llm(ckpt, device, **served)
        ids = greedy(llm, prompts, OUTPUT_LEN)[0]
        result["steps"] = step_times(llm, config["vocab_size"], result["copy_gbs"], config,
                                     case.quantization)
        return ids

    def eager() -> list[list[int]]:
        llm = make_llm(ckpt, device, enforce_eager=True, **served)
        ids = greedy(llm, prompts, OUTPUT_LEN)[0]
        result["kernels_per_decode_step"] = kernels_per_step(llm, config["vocab_size"])
        return ids

    ids_graphs = _attempt(result, "engine_graphs", graphs, save)
    _free()
    ids_eager = _attempt(result, "engine_eager", eager, save)
    _free()
    result["graphs_equal_eager"] = ids_graphs is not None and ids_graphs == ids_eager
    if ids_graphs is not None and theirs is not None:
        result["agreement_vs_fp32_transformers"] = greedy_agreement(ids_graphs, theirs)
    if case.memory and device == "cuda":
        result["memory"] = _attempt(result, "memory", lambda: memory_check(ckpt, config, device),
                                    save)
    result["ok"] = (not result.get("errors") and result["graphs_equal_eager"]
                    and result.get("fp32_exact", True)
                    and (result.get("memory") or {}).get("ok", True))
    result["seconds"] = round(time.perf_counter() - t0, 1)
    result.pop("partial")
    save(result)
    if args.dry_run:
        shutil.rmtree(ckpt, ignore_errors=True)  # a tiny temporary one; real cuts are reused
    return result


def plan(args: argparse.Namespace) -> list[dict]:
    """Without building anything: each case's checkpoint size and roofline bytes per step."""
    rows = []
    for name in args.case:
        case = CASES[name]
        config = case_config(case, args.layers, args.vocab, tiny=False)
        size = sum(s.nbytes for s in real_checkpoint.tensor_specs(config))
        rows.append({"case": name, "model_type": config["model_type"],
                     "layers": config["num_hidden_layers"], "vocab": config["vocab_size"],
                     "checkpoint_gib": round(size / 2**30, 2), "quantization": case.quantization,
                     "exact_vs_transformers": case.exact, "memory_step": case.memory,
                     "max_model_len": config["max_position_embeddings"],
                     "roofline_mib_per_step": {
                         b: round(roofline_bytes(config, case.quantization, b,
                                                 PROMPT_LEN + STEPS // 2) / 2**20, 1)
                         for b in BATCHES}})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--case", action="append", choices=sorted(CASES),
                   help="repeatable; default: every case")
    p.add_argument("--layers", type=int, default=3, help="decoder layers of each cut")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary of each cut")
    p.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "gpu-e2e")
    p.add_argument("--out", type=Path, default=None, help="write e2e-<case>.json here")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny configs (module docstring)")
    p.add_argument("--plan", action="store_true", help="print what would run; build nothing")
    args = p.parse_args(argv)
    args.case = args.case or list(CASES)
    if args.plan:
        for row in plan(args):
            print(json.dumps(row))
        return 0
    if not args.dry_run and not torch.cuda.is_available():
        print("bench/gpu_e2e.py: needs a CUDA GPU; --dry-run runs the code on the CPU, "
              "--plan prints what would run", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    # `timeout` stops a step with SIGTERM: leave through SystemExit, the parts already saved
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    failed = 0
    for name in args.case:

        def save(result: dict, name: str = name) -> None:
            if args.out is not None:
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / f"e2e-{name}.json").write_text(json.dumps(result, indent=1) + "\n")

        result = run_case(name, args, save)
        failed += not result["ok"]
        print(json.dumps(result), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
