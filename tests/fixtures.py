"""Tiny random-initialised MoE checkpoints and `transformers` oracles for the tests.

The checkpoints are the real architectures (`Qwen3MoeForCausalLM`, `MixtralForCausalLM`) built by
`transformers.AutoModelForCausalLM.from_config` from a seeded RNG and saved as safetensors, so the
engine's own model code can be compared token for token against `transformers.generate`.

Weights are drawn with a large `initializer_range` (0.5 instead of 0.02) so that greedy
continuations depend on the prompt and do not collapse into one repeated token.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any

import torch

#: Shared shape of the tiny models: 512-token vocabulary, hidden 64, 4 query heads and 2 KV heads
#: of 16 dims, 8 experts with top-2 routing, 32-wide experts.
_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

#: Per-architecture fields. Qwen3: 3 layers, layer 1 a dense MLP (mlp_only_layers), the others MoE,
#: top-k weights renormalised. Mixtral: 2 layers, all MoE (its experts use intermediate_size).
_KINDS: dict[str, dict[str, Any]] = {
    "qwen3_moe": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
    },
    "mixtral": {
        "num_hidden_layers": 2,
        "intermediate_size": 32,
        "num_local_experts": 8,
    },
    # gpt-oss: 4 layers alternating sliding (window 8 tokens, shorter than most test prompts)
    # and full attention, YaRN rope (factor 4 over 256 original positions), non-default swiglu
    # alpha and limit; sinks and every bias are drawn non-zero by make_tiny_checkpoint.
    "gpt_oss": {
        "num_hidden_layers": 4,
        "intermediate_size": 32,
        "num_local_experts": 8,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "sliding_window": 8,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        "swiglu_alpha": 1.6,
        "swiglu_limit": 5.0,
    },
    # DeepSeek-V3: 3 layers, layer 0 dense (first_k_dense_replace), MLA with a q LoRA, rope
    # interleaved, YaRN with mscale_all_dim (the softmax-scale correction); 16 routed experts in
    # 4 groups, 2 groups kept, top-4 by sigmoid + correction bias, one shared expert, scaling 2.5.
    # make_tiny_checkpoint draws the correction bias non-zero (transformers initialises it to 0).
    "deepseek_v3": {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "head_dim": 8,
        "rope_interleave": True,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    },
    # DeepSeek-V2: 3 layers, layer 0 dense; MLA without a q LoRA (q_proj), complex-pair rope;
    # 16 experts in 4 groups, softmax group-limited greedy (2 groups), top-4, 2 shared experts.
    "deepseek_v2": {
        "num_hidden_layers": 3,
        "num_key_value_heads": 4,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "topk_method": "group_limited_greedy",
        "n_group": 4,
        "topk_group": 2,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "head_dim": 8,
    },
    # GLM-4.5 (glm4_moe): 3 layers, layer 0 dense; GQA with biases on q/k/v, q/k norm, half the
    # head rotated (partial_rotary_factor 0.5); 16 experts in 2 groups (1 kept), top-4 by
    # sigmoid + correction bias, one shared expert.
    "glm4_moe": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 2,
        "topk_group": 1,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 1.5,
        "norm_topk_prob": True,
        "attention_bias": True,
        "use_qk_norm": True,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
        },
    },
    # Qwen2-MoE: 3 layers, layer 1 dense (mlp_only_layers); q/k/v biases; softmax top-2 not
    # renormalised; a shared expert of width 48 behind a sigmoid gate.
    "qwen2_moe": {
        "num_hidden_layers": 3,
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1],
        "qkv_bias": True,
    },
    # Qwen3-Next: 4 layers, Gated DeltaNet except layer 1 (gated full attention), layer 2 a
    # dense MLP; 2 q/k and 4 value heads of 16 dims in the linear layers, conv width 4;
    # partial rope on 4 of 16 dims (the default factor 0.25); a gated shared expert.
    "qwen3_next": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                        "linear_attention"],
        "intermediate_size": 96,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [2],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
    # Qwen3.5-MoE's text model: Qwen3-Next's layers (full attention at layer 1 here), every
    # layer MoE, the linear layers' four split input projections.
    "qwen3_5_moe_text": {
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention",
                        "linear_attention"],
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "num_experts": 8,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
    },
}


#: Per kind, the name endings of tensors drawn at random after `from_config` (transformers
#: initialises them to zero, which would leave their code paths untested): gpt-oss's biases and
#: sinks, the DeepSeek-V3 / GLM routers' `e_score_correction_bias` (it changes which experts are
#: picked, so a zero bias would hide a wrong implementation) and the attention biases.
_DRAWN_BIASES: dict[str, tuple[str, ...]] = {
    "gpt_oss": ("bias", ".sinks"),
    "deepseek_v3": ("e_score_correction_bias",),
    "glm4_moe": ("e_score_correction_bias", "bias"),
    "qwen2_moe": ("bias",),
    # zero-centred norms start at 0 (y = x / rms): draw them so that (1 + w) is tested
    "qwen3_next": ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight"),
    "qwen3_5_moe_text": ("layernorm.weight", "q_norm.weight", "k_norm.weight",
                         "model.norm.weight"),
}


def tiny_config(kind: str, **overrides: Any):
    """The `transformers` config of a tiny checkpoint.

    Args:
        kind: one of `_KINDS` ("qwen3_moe", "mixtral", "gpt_oss", "deepseek_v3", "deepseek_v2",
            "glm4_moe", "qwen2_moe").
        overrides: config fields that replace the defaults above (e.g. `norm_topk_prob=False`,
            `decoder_sparse_step=2, mlp_only_layers=[]`, `num_hidden_layers=4`).

    Raises:
        ValueError: for an unknown kind.
    """
    from transformers import AutoConfig

    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    fields = {**_COMMON, **_KINDS[kind], **overrides}
    return AutoConfig.for_model(kind, **fields)


def make_tiny_checkpoint(
    kind: str,
    root: Path,
    *,
    dtype: torch.dtype = torch.float32,
    sharded: bool = False,
    seed: int = 0,
    **overrides: Any,
) -> Path:
    """Create a tiny random-weight checkpoint directory (config.json + safetensors).

    Args:
        kind: one of `_KINDS` (see `tiny_config`).
        root: parent directory; the checkpoint goes to `root / <name>` and is reused when its
            config.json already exists there.
        dtype: dtype of the saved weights (torch.float32 or torch.bfloat16).
        sharded: save in shards of at most 100 kB, so that `model.safetensors.index.json`
            appears; otherwise one `model.safetensors`.
        seed: `torch.manual_seed` before the weights are drawn.
        overrides: config fields, see `tiny_config`.

    Returns:
        The checkpoint directory.
    """
    from transformers import AutoModelForCausalLM

    suffix = "".join(f"-{k}={v}" for k, v in sorted(overrides.items())).replace(" ", "")
    dtype_name = str(dtype).removeprefix("torch.")
    name = f"{kind}-{dtype_name}-s{seed}{'-sharded' if sharded else ''}{suffix}"
    path = Path(root) / name
    if (path / "config.json").is_file():
        return path
    config = tiny_config(kind, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if kind in _DRAWN_BIASES:  # transformers initialises these to 0: draw them all
        with torch.no_grad():
            for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
                if name.endswith(_DRAWN_BIASES[kind]):
                    tensor.normal_(0.0, config.initializer_range)
    model.save_pretrained(
        path, safe_serialization=True, max_shard_size="100KB" if sharded else "2GB"
    )
    return path


def make_mxfp4_experts_checkpoint(ckpt: Path, root: Path) -> Path:
    """A copy of a gpt-oss checkpoint with its experts in the native MXFP4 layout, as OpenAI
    released gpt-oss: `experts.gate_up_proj_blocks` [E, 2I, H // 32, 16] / `_scales`
    [E, 2I, H // 32] and `experts.down_proj_blocks` [E, H, I // 32, 16] / `_scales`
    [E, H, I // 32] (rows = output features, gate/up still interleaved), written by
    `quant.mxfp4.quantize_mxfp4`, and config.json's quantization_config {"quant_method":
    "mxfp4"}. Reused when it exists already.

    Returns:
        The new checkpoint directory (`root / (ckpt.name + "-mxfp4")`).
    """
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from quant.mxfp4 import quantize_mxfp4

    out = Path(root) / f"{Path(ckpt).name}-mxfp4"
    if (out / "config.json").is_file():
        return out
    tmp = Path(root) / f"{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(ckpt, tmp)
    tensors = load_file(tmp / "model.safetensors")
    for name in list(tensors):
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            weight = tensors.pop(name)  # transformers' [E, in, out]
            blocks, scales = quantize_mxfp4(weight.transpose(1, 2).contiguous())
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
    save_file(tensors, tmp / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head",
        ],
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    tmp.rename(out)
    return out


@functools.lru_cache(maxsize=8)
def _load_hf(ckpt: str):
    """The checkpoint loaded by transformers in float32, eval mode (cached per path)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    return model.eval()


def hf_greedy(
    ckpt: Path, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = True
) -> list[list[int]]:
    """Greedy continuations from `transformers.generate`, float32, one prompt at a time.

    Args:
        ckpt: checkpoint directory.
        prompts: token ids per prompt (no padding is ever applied).
        max_new_tokens: tokens to generate per prompt.
        ignore_eos: when True, generation runs to `max_new_tokens` even through the EOS token
            (the engine's `ignore_eos=True`); when False it stops after EOS (which is included).

    Returns:
        The generated token ids per prompt (prompt excluded).
    """
    return greedy_generate(_load_hf(str(ckpt)), prompts, max_new_tokens, ignore_eos=ignore_eos)


def greedy_generate(
    model, prompts: list[list[int]], max_new_tokens: int, *, ignore_eos: bool = True
) -> list[list[int]]:
    """`hf_greedy` on a `transformers` model already loaded (e.g. with a quantization config).

    Returns:
        The generated token ids per prompt (prompt excluded).
    """
    outputs = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt], dtype=torch.long)
        kwargs: dict[str, Any] = {}
        if ignore_eos:
            # An id no token can take: generation never sees its stop token.
            kwargs["eos_token_id"] = model.config.vocab_size + 1
        with torch.inference_mode():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=model.config.pad_token_id,
                **kwargs,
            )
        outputs.append(out[0, len(prompt):].tolist())
    return outputs


def hf_last_logits(ckpt: Path, prompt_ids: list[int]) -> torch.Tensor:
    """Logits at the last prompt position from a plain `transformers` forward pass.

    Returns:
        [vocab_size] float32.
    """
    model = _load_hf(str(ckpt))
    with torch.inference_mode():
        logits = model(torch.tensor([prompt_ids], dtype=torch.long)).logits
    return logits[0, -1].float().clone()


#: Checkpoint tensors `--quantized-layers all` quantizes besides the experts (the attention
#: projections, dense MLPs, the LM head; not the router `mlp.gate`: moe_engine.models.dense_quant).
DENSE_QUANTIZED = re.compile(r"(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj|lm_head)\.weight$")


def dequantized_experts_copy(ckpt: Path, root: Path, method: str, group_size: int,
                             *, dense: bool = False) -> Path:
    """A copy of `ckpt` under `root` whose routed expert tensors (and with `dense` the
    `DENSE_QUANTIZED` ones) are replaced by their int4 (symmetric, `group_size`) or MXFP4
    quantize -> dequantize: what transformers serves as the oracle of an engine quantizing the
    same layers at load time."""
    import shutil

    from safetensors.torch import load_file, save_file

    from quant.int4 import dequantize_int4, quantize_int4
    from quant.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    out = root / f"{ckpt.name}-{method}-{'all' if dense else 'experts'}-deq"
    shutil.copytree(ckpt, out)
    tensors = load_file(out / "model.safetensors")
    for name, w in tensors.items():
        if ".experts." not in name and not (dense and DENSE_QUANTIZED.search(name)):
            continue
        if method == "int4":
            packed, scales, _ = quantize_int4(w, group_size, symmetric=True)
            tensors[name] = dequantize_int4(packed, scales, None, dtype=w.dtype)
        else:
            tensors[name] = dequantize_mxfp4(*quantize_mxfp4(w), dtype=w.dtype)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def perturbed_checkpoint(ckpt: Path, root: Path, *, seed: int = 1, scale: float = 0.05,
                         only: tuple[str, ...] | None = None) -> Path:
    """A copy of `ckpt` (saved by transformers, float32) whose parameters each have
    `scale * randn` added under `torch.manual_seed(seed)`: the "next RL step" of a weight
    update. With `only`, just the parameters whose names contain one of those substrings
    change (a partial update); the file then holds every tensor still, so tests pick the
    changed ones themselves. Reused when it exists."""
    from transformers import AutoModelForCausalLM

    tag = "all" if only is None else "-".join(o.strip(".").replace(".", "_") for o in only)
    path = Path(root) / f"{Path(ckpt).name}-perturbed-s{seed}-{tag}"
    if (path / "config.json").is_file():
        return path
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if only is None or any(o in name for o in only):
                p.add_(torch.randn_like(p) * scale)
    model.save_pretrained(path)
    return path
