"""Decode speed of a gpt-oss model of the bench model's size, module path against one native call
per layer (bench/NOTES.md section 26).

Checkpoint `bench-gpt-oss` (random weights, made once into the cache directory): gpt-oss's
architecture at `bench-qwen3-moe`'s sizes (BENCH.md: hidden 512, 8 layers, 8 query / 2 KV heads
of 64, 32 experts of width 256, top-4, vocabulary 8192), sliding-window (128 tokens) and full
layers alternating, sinks and every bias drawn non-zero; `--shape 20b-cut` takes gpt-oss-20b's
layer shapes instead (hidden 2880, 64 query / 8 KV heads of 64, experts of width 2880, top-4,
window 128: a layer reads what one of gpt-oss-20b's reads) cut to 2 layers, 8 experts and a
1024-token vocabulary; `--experts mxfp4` writes the experts in gpt-oss's MXFP4 layout
(`*_blocks` / `*_scales`) as OpenAI released them. Each setting of
`--backends` is one `LLM` (bfloat16) loaded once; then, round after round, each runs the
same greedy request (`--prompt-len` prompt ids, exactly `--output-len` tokens; `--batch`
copies of it at once), and the figure is output tokens / seconds of the generate call, median
over `--runs` rounds after `--warmup` untimed ones.

    python bench/gpt_oss_decode.py                         # batch 1, bf16 experts
    python bench/gpt_oss_decode.py --experts mxfp4 --batch 8 --runs 7
    python bench/gpt_oss_decode.py --shape 20b-cut --experts mxfp4 --output-len 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

if "OMP_WAIT_POLICY" not in os.environ:  # what `import moe_engine` sets, before torch loads
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
import torch  # noqa: E402

from moe_engine import LLM, SamplingParams  # noqa: E402
from moe_engine.startup.demo import default_cache_dir  # noqa: E402

#: gpt-oss at BENCH.md's bench-qwen3-moe sizes.
CONFIG = {
    "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 256, "num_hidden_layers": 8,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "max_position_embeddings": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 4, "sliding_window": 128,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                        "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                        "beta_slow": 1.0, "truncate": False},
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}
#: The configs of `--shape`: the bench model's size, or gpt-oss-20b's layers cut down.
SHAPES = {
    "bench": CONFIG,
    "20b-cut": {**CONFIG, "vocab_size": 1024, "hidden_size": 2880, "intermediate_size": 2880,
                "num_hidden_layers": 2, "num_attention_heads": 64, "num_key_value_heads": 8,
                "num_local_experts": 8, "layer_types": ["sliding_attention", "full_attention"]},
}


def ensure_checkpoint(cache_dir: Path, shape: str, experts: str) -> Path:
    """`cache_dir/bench-gpt-oss[-20b-cut][-mxfp4]`, made on first use (seed 0, bfloat16
    weights)."""
    name = "bench-gpt-oss" + ("" if shape == "bench" else f"-{shape}")
    path = cache_dir / (name if experts == "bf16" else f"{name}-mxfp4")
    if (path / "config.json").is_file():
        return path
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from quant.mxfp4 import quantize_mxfp4

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt_oss", **SHAPES[shape]),
                                             dtype=torch.bfloat16)
    with torch.no_grad():  # transformers initialises them to zero
        for name, p in model.named_parameters():
            if name.endswith(("bias", ".sinks")):
                p.normal_(0.0, 0.02)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp, safe_serialization=True)
    if experts == "mxfp4":
        tensors = load_file(tmp / "model.safetensors")
        for name in [n for n in tensors if n.endswith((".gate_up_proj", ".down_proj"))]:
            weight = tensors.pop(name).float()  # [E, in, out]
            blocks, scales = quantize_mxfp4(weight.transpose(1, 2).contiguous())
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
        save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
        config = json.loads((tmp / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "mxfp4"}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--experts", choices=["bf16", "mxfp4"], default="bf16")
    p.add_argument("--backends", default="decode_layer=torch,auto",
                   help="comma-separated --kernel-backend settings, one LLM each")
    p.add_argument("--batch", type=int, default=1, help="copies of the request at once")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    args = p.parse_args()
    ckpt = ensure_checkpoint(args.cache_dir, args.shape, args.experts)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompt = [(31 * i) % (vocab - 3) + 3 for i in range(args.prompt_len)]
    sp = SamplingParams(max_tokens=args.output_len, min_tokens=args.output_len,
                        temperature=0.0, ignore_eos=True)
    llms = {b: LLM(model=str(ckpt), dtype="bfloat16", max_model_len=1024, kernel_backend=b,
                   kv_cache_memory=256 << 20) for b in args.backends.split(",")}
    rates: dict[str, list[float]] = {b: [] for b in llms}
    for round_ in range(args.warmup + args.runs):
        for backend, llm in llms.items():
            start = time.perf_counter()
            llm.generate([prompt] * args.batch, sp, use_tqdm=False)
            if round_ >= args.warmup:
                rates[backend].append(args.batch * args.output_len
                                      / (time.perf_counter() - start))
    print(json.dumps({"shape": args.shape, "experts": args.experts, "batch": args.batch,
                      "load_average": os.getloadavg(),
                      "tok_s": {b: {"median": round(statistics.median(r), 1),
                                    "runs": [round(x, 1) for x in r]}
                                for b, r in rates.items()}}))


if __name__ == "__main__":
    main()
