"""Greedy agreement of moe-engine with transformers on one checkpoint, in float32, exact ids.

Both load the checkpoint in float32 (transformers dequantizes gpt-oss's MXFP4 experts with
`Mxfp4Config(dequantize=True)`; the engine runs them in its MXFP4 kernels, whose dequantized
values are the same numbers), one after the other in this process, and generate greedily for
`--prompts` prompts of `--prompt-len` random token ids (seed 0), `--output-len` tokens each;
the engine through its offline `LLM` API, all prompts at once. `bench/real_scale.py` runs it on
a 2-layer cut of each shipped config.

    python bench/real_agreement.py --model /work/realscale/gpt-oss-20b-L2-V8192-... --json
"""

from __future__ import annotations

import os

# what `import moe_engine` sets before torch loads libgomp (bench/throughput.py does the same)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from measure import greedy_agreement  # noqa: E402


def prompts_for(vocab_size: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of `length` token ids uniform in 3..vocab_size-1."""
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(length)] for _ in range(n)]


def hf_greedy(ckpt: Path, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """transformers' greedy ids, float32, one prompt at a time (no padding)."""
    from transformers import AutoModelForCausalLM

    config = json.loads((ckpt / "config.json").read_text())
    kwargs = {}
    if config.get("quantization_config", {}).get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32, **kwargs).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=output_len,
                                 min_new_tokens=output_len, do_sample=False,
                                 pad_token_id=config.get("pad_token_id") or 0)
            out.append(ids[0, len(p):].tolist())
    return out


def engine_greedy(ckpt: Path, prompts: list[list[int]], output_len: int) -> list[list[int]]:
    """moe-engine's greedy ids, float32, offline `LLM`, all prompts in one generate call."""
    from moe_engine import LLM
    from moe_engine.sampling_params import SamplingParams

    llm = LLM(model=str(ckpt), dtype="float32",
              max_model_len=max(len(p) for p in prompts) + output_len, kv_cache_memory=2**28)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, min_tokens=output_len,
                            ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def agreement(ckpt: Path, n: int = 4, prompt_len: int = 32, output_len: int = 32) -> dict:
    """`measure.greedy_agreement` of the engine against transformers, with the seconds each
    took (load and generate) and both id lists."""
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    prompts = prompts_for(vocab, n, prompt_len)
    t0 = time.perf_counter()
    ours = engine_greedy(ckpt, prompts, output_len)
    t1 = time.perf_counter()
    theirs = hf_greedy(ckpt, prompts, output_len)
    t2 = time.perf_counter()
    return {"checkpoint": str(ckpt), "dtype": "float32", "prompts": n, "prompt_len": prompt_len,
            "output_len": output_len, **greedy_agreement(ours, theirs),
            "engine_s": round(t1 - t0, 1), "transformers_s": round(t2 - t1, 1),
            "engine_ids": ours, "transformers_ids": theirs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = p.parse_args(argv)
    res = agreement(args.model, args.prompts, args.prompt_len, args.output_len)
    if args.json:
        print(json.dumps(res))
    else:
        print(f"{res['identical']}/{res['prompts']} identical, matching prefix "
              f"{res['matching_prefix_fraction']:.1%}")
    return 0 if res["identical"] == res["prompts"] else 1


if __name__ == "__main__":
    sys.exit(main())
