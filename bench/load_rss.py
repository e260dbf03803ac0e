"""Peak host memory of building one rank's model (`build_model`): make a random-weight
Qwen3-MoE checkpoint of a few hundred MB, load it in a fresh process, print the peak RSS.

    python bench/load_rss.py --make /tmp/ckpt            # the checkpoint (~470 MB float32)
    python bench/load_rss.py --load /tmp/ckpt [--quantization int4] [--device cuda]

Run `--load` under two source trees (PYTHONPATH=...) to compare loaders; each load runs in its
own process, so its VmHWM is the build's peak (plus the interpreter and torch, printed first).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def make(path: str) -> None:
    """A Qwen3-MoE checkpoint: 4 layers, hidden 1024, 16 experts of 512, float32."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=8192, hidden_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, intermediate_size=2048,
        moe_intermediate_size=512, num_experts=16, num_experts_per_tok=2,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)


def load(path: str, quantization: str, device: str) -> dict:
    """Build the model through `build_model`; returns the peak RSS before and after (MiB)."""
    import torch

    from moe_engine.models import resolve_quant_config
    from moe_engine.models.build import build_model
    from moe_engine.startup.config import EngineConfig, ModelConfig
    from moe_engine.startup.quant_config import QuantConfig

    config = EngineConfig(
        ModelConfig(path, max_model_len=256), quant=QuantConfig(quantization, group_size=128),
        kernel_backend="torch",
    )  # fmt: skip
    quant = resolve_quant_config(config.quant, config.model.hf_config(), torch.float32)
    config = EngineConfig(config.model, quant=quant, kernel_backend="torch")
    before = _peak_mib()
    start = time.perf_counter()
    built = build_model(config, device=torch.device(device))
    seconds = time.perf_counter() - start
    weights = sum(built.model.weight_bytes_by_kind().values()) / 2**20
    return {
        "quantization": quantization, "device": device, "peak_before_mib": round(before),
        "peak_after_mib": round(_peak_mib()), "weights_mib": round(weights),
        "seconds": round(seconds, 2),
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--make", metavar="DIR")
    parser.add_argument("--load", metavar="DIR")
    parser.add_argument("--quantization", default="none", choices=("none", "int4", "mxfp4"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.make:
        make(args.make)
    if args.load:
        print(json.dumps(load(args.load, args.quantization, args.device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
