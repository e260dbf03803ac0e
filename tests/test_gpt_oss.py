"""gpt-oss against `transformers`: sliding-window and full layers, attention sinks, YaRN, biases,
top-k-then-softmax routing, clamped SwiGLU; the float layout and the native MXFP4 one.

The fixture (`fixtures._KINDS["gpt_oss"]`) has a window of 8 tokens, so the prompts below are
shorter than, equal to, one past and five times the window, and decoding crosses it too.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from fixtures import greedy_generate, hf_greedy, hf_last_logits

from moe_engine import LLM, SamplingParams
from moe_engine.errors import StartupError
from moe_engine.models.layers.attention import (
    AttentionMetadata,
    PagedAttention,
    build_attention_batch,
)

WINDOW = 8
PROMPT_LENS = [3, WINDOW, WINDOW + 1, 5 * WINDOW + 1, 4 * WINDOW + 1]
MAX_NEW = 10


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@functools.lru_cache(maxsize=2)
def _expected(ckpt: Path) -> list[list[int]]:
    """transformers' greedy tokens for `_prompts(0)` (computed once per checkpoint)."""
    return hf_greedy(ckpt, _prompts(0), MAX_NEW)


@pytest.mark.parametrize(
    "chunk, block_size, num_blocks",
    [
        (5, 4, 22),  # prefill chunks shorter than the window; windows span several blocks
        (13, 16, 10),  # chunks longer than the window; one block holds two windows
    ],
)
def test_greedy_matches_transformers_with_chunking_and_preemption(
    gpt_oss_ckpt, chunk, block_size, num_blocks
):
    prompts, expected = _prompts(0), _expected(gpt_oss_ckpt)
    # The five requests reach 144 tokens (36 blocks of 4, or 12 of 16) with their full-attention
    # layers alone; the pool holds fewer, so some are preempted.
    llm = LLM(
        model=str(gpt_oss_ckpt),
        max_model_len=64,
        max_num_batched_tokens=chunk,
        block_size=block_size,
        num_blocks_override=num_blocks,
    )
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_last_position_logits_within_tolerance(gpt_oss_ckpt):
    llm = LLM(model=str(gpt_oss_ckpt), max_model_len=64, max_num_batched_tokens=16)
    captured: list[torch.Tensor] = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    for prompt in _prompts(seed=3)[2:4]:
        captured.clear()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        ours, ref = captured[0][0], hf_last_logits(gpt_oss_ckpt, prompt)
        rel = (ours - ref).norm() / ref.norm()
        assert rel < 1e-4, f"relative error {rel:.2e} for a prompt of {len(prompt)} tokens"
    _assert_plan_bytes_are_the_loaded_bytes(llm)


def test_mxfp4_checkpoint_matches_transformers_dequantizing_it(gpt_oss_mxfp4_ckpt):
    """The native `*_blocks` / `*_scales` experts: served as MXFP4 (no float copy), and the
    same tokens as transformers' own MXFP4 dequantization of the checkpoint."""
    from transformers import AutoModelForCausalLM, Mxfp4Config

    prompts = _prompts(seed=7)[1:4]
    hf = AutoModelForCausalLM.from_pretrained(
        gpt_oss_mxfp4_ckpt, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True)
    ).eval()
    expected = greedy_generate(hf, prompts, MAX_NEW)
    llm = LLM(model=str(gpt_oss_mxfp4_ckpt), max_model_len=64, max_num_batched_tokens=13)
    assert llm.engine.config.quant.checkpoint_format == "mxfp4"
    moes = llm.engine.model.moe_layers()
    assert [i for i, _ in moes] == list(range(llm.engine.spec.num_layers))
    for _, moe in moes:
        assert moe.quantized.method == "mxfp4" and not hasattr(moe, "w13")
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    _assert_plan_bytes_are_the_loaded_bytes(llm)


def _assert_plan_bytes_are_the_loaded_bytes(llm: LLM) -> None:
    """The startup plan's weight bytes (biases and sinks included) are the loaded tensors'."""
    info, plan = llm.engine.weight_info(), llm.engine.plan
    assert info["weight_bytes_experts"] == plan.weight_bytes_experts
    rest = sum(info[f"weight_bytes_{k}"] for k in ("attention", "embeddings", "other"))
    assert rest == plan.weight_bytes_other


def test_gpt_oss_20b_config_plan(tmp_path):
    """gpt-oss-20b's released config.json (transformers 4.55 keys: `rope_scaling`,
    `experts_per_token`, MXFP4 quantization_config): 20.91 B parameters and a 12.8 GiB
    checkpoint as the model card states (OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card", 2025,
    table 1), YaRN factor 32 untruncated, alpha 1.702 by default, even layers sliding (128)."""
    import json

    from transformers import AutoConfig

    from moe_engine.models import resolve_quant_config
    from moe_engine.models.gpt_oss import GptOssForCausalLM
    from moe_engine.startup.config import QuantConfig
    from moe_engine.startup.plan import make_plan

    layer_types = ["sliding_attention", "full_attention"] * 12
    config = {
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True,
        "experts_per_token": 4, "num_experts_per_tok": 4, "head_dim": 64, "hidden_size": 2880,
        "intermediate_size": 2880, "layer_types": layer_types, "num_hidden_layers": 24,
        "max_position_embeddings": 131072, "num_attention_heads": 64, "num_key_value_heads": 8,
        "num_local_experts": 32, "rms_norm_eps": 1e-05, "rope_theta": 150000,
        "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
            "original_max_position_embeddings": 4096, "truncate": False,
        },
        "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": False,
        "vocab_size": 201088,
        "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": []},
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = GptOssForCausalLM.arch_spec(AutoConfig.from_pretrained(tmp_path))
    assert (spec.top_k, spec.num_experts, spec.moe_intermediate_size) == (4, 32, 2880)
    assert (spec.yarn.factor, spec.yarn.truncate, spec.rope_theta) == (32.0, False, 150000.0)
    assert (spec.swiglu_alpha, spec.swiglu_limit, spec.sliding_window) == (1.702, 7.0, 128)
    assert spec.layer_types == tuple(layer_types)
    total = spec.expert_params() + spec.expert_bias_params() + spec.other_params()
    assert round(total / 1e9, 2) == 20.91
    quant = resolve_quant_config(QuantConfig("auto"), config)
    assert (quant.method, quant.checkpoint_format) == ("mxfp4", "mxfp4")
    plan = make_plan(
        spec, torch.bfloat16, block_size=16, max_model_len=4096, kv_cache_memory=2**30,
        expert_bits_per_weight=quant.bits_per_weight,
    )
    assert round(plan.weight_bytes / 2**30, 1) == 12.8


def test_int4_flag_on_an_mxfp4_checkpoint_fails_at_startup(gpt_oss_mxfp4_ckpt):
    with pytest.raises(StartupError, match="--quantization int4 conflicts.*mxfp4"):
        LLM(model=str(gpt_oss_mxfp4_ckpt), max_model_len=64, quantization="int4")


class _SliceCommunicator:
    """One rank of expert parallelism without the exchange: every token stays, its global
    expert ids become this rank's slots (-1 for experts held elsewhere). Summing the ranks'
    outputs gives what the all-to-all would."""

    def __init__(self, local_experts: list[int]) -> None:
        self.slot_of = torch.full((64,), -1, dtype=torch.int32)
        self.slot_of[torch.tensor(local_experts)] = torch.arange(len(local_experts)).int()

    def dispatch(self, hidden, topk_ids, topk_weights):
        from comm.base import DispatchResult

        return DispatchResult(hidden, self.slot_of[topk_ids.long()], topk_weights, None)

    def combine(self, expert_out, handle):
        return expert_out


@pytest.mark.parametrize("ckpt_name", ["gpt_oss_ckpt", "gpt_oss_mxfp4_ckpt"])
def test_expert_parallel_slices_sum_to_the_whole_layer(ckpt_name, request):
    """Two ranks holding experts in a shuffled slot order (weights, biases, MXFP4 blocks and
    scales sliced by global id) add up to the unsharded MoE block."""
    from transformers import AutoConfig

    from moe_engine.models.gpt_oss import GptOssForCausalLM
    from moe_engine.models.loader import load_model

    ckpt = request.getfixturevalue(ckpt_name)
    spec = GptOssForCausalLM.arch_spec(AutoConfig.from_pretrained(ckpt))

    def build(local_experts: list[int] | None) -> GptOssForCausalLM:
        model = GptOssForCausalLM(spec, torch.float32, max_position=64)
        if local_experts is not None:
            for _, moe in model.moe_layers():
                moe.shard_experts(local_experts, _SliceCommunicator(local_experts))
        load_model(model, ckpt, torch.float32)
        return model

    whole, ranks = build(None), [build([6, 1, 3, 4]), build([0, 2, 5, 7])]
    hidden = torch.randn(12, spec.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        blocks = [dict(rank.moe_layers()) for rank in ranks]
        for i, moe in whole.moe_layers():
            parts = sum(rank[i](hidden) for rank in blocks)
            torch.testing.assert_close(parts, moe(hidden), rtol=1e-5, atol=1e-5)


def _paged_case(window: int | None, seed: int):
    """A random step (two decodes, two prefill chunks) over a paged cache, and the per-request
    keys/values it should attend to."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, block_size, num_blocks = 4, 2, 16, 4, 40
    q_lens = torch.tensor([1, 1, 7, 12])
    starts = torch.tensor([9, 3, 0, 13])
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.zeros_like(k_cache)
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    tables, slots, full_k, full_v = [], [], [], []
    for r, (n, start) in enumerate(zip(q_lens.tolist(), starts.tolist(), strict=True)):
        blocks = perm[r * 8 : r * 8 + 8]
        tables.append(blocks)
        keys = torch.randn(start + n, kv_heads, dim, generator=g)
        values = torch.randn(start + n, kv_heads, dim, generator=g)
        pos = torch.arange(start + n)
        slot = blocks[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, kv_heads, dim)[slot[:start]] = keys[:start]  # cached earlier
        v_cache.view(-1, kv_heads, dim)[slot[:start]] = values[:start]
        slots.append(slot[start:])
        full_k.append(keys)
        full_v.append(values)
    q = torch.randn(int(q_lens.sum()), heads, dim, generator=g)
    new_k = torch.cat([k[s:] for k, s in zip(full_k, starts.tolist(), strict=True)])
    new_v = torch.cat([v[s:] for v, s in zip(full_v, starts.tolist(), strict=True)])
    block_tables = torch.stack(tables)
    batches = [
        build_attention_batch(0, q_lens[:2], starts[:2], block_tables[:2], block_size),
        build_attention_batch(2, q_lens[2:], starts[2:], block_tables[2:], block_size),
    ]
    meta = AttentionMetadata(slot_mapping=torch.cat(slots), batches=batches)
    attn = PagedAttention(heads, kv_heads, dim, dim**-0.5, sliding_window=window)
    sinks = torch.randn(heads, generator=g)
    args = (q, new_k, new_v, (k_cache, v_cache), meta, sinks)
    return attn, args, (q_lens, starts, full_k, full_v)


def _transformers_reference(q, sinks, window, q_lens, starts, full_k, full_v, scale):
    """transformers' gpt-oss eager attention, one request at a time, with its own causal and
    sliding-window mask functions."""
    from types import SimpleNamespace

    from transformers.masking_utils import causal_mask_function, sliding_window_overlay
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    module = SimpleNamespace(
        sinks=sinks, num_key_value_groups=q.shape[1] // full_k[0].shape[1], training=False
    )
    outs, offset = [], 0
    for n, start, keys, values in zip(
        q_lens.tolist(), starts.tolist(), full_k, full_v, strict=True
    ):
        q_idx = torch.arange(start, start + n)[:, None]
        kv_idx = torch.arange(start + n)[None, :]
        visible = causal_mask_function(0, 0, q_idx, kv_idx)
        if window is not None:
            visible = visible & sliding_window_overlay(window)(0, 0, q_idx, kv_idx)
        mask = torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))[None, None]
        query = q[offset : offset + n].transpose(0, 1)[None]
        out, _ = eager_attention_forward(
            module, query, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], mask, scale
        )
        outs.append(out[0].reshape(n, -1))
        offset += n
    return torch.cat(outs)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("cpu_kernel", [True, False])
def test_paged_attention_with_sinks_equals_transformers(window, cpu_kernel, monkeypatch):
    """Sinks and the sliding window inside the batched paged attention (decodes and prefill
    chunks, GQA) equal transformers' eager gpt-oss attention, through the CPU kernel's
    log-sum-exp and through the explicit-scores path."""
    import moe_engine.models.layers.attention as attention

    if not cpu_kernel:
        monkeypatch.setattr(attention, "_CPU_FLASH_WITH_LSE", None)
    attn, args, (q_lens, starts, full_k, full_v) = _paged_case(window, seed=1)
    q, sinks = args[0], args[-1]
    with torch.inference_mode():
        ours = attn(*args[:-1], sinks=sinks)
    want = _transformers_reference(q, sinks, window, q_lens, starts, full_k, full_v, attn.scale)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


def test_sliding_window_without_sinks_equals_transformers_with_sinks_at_minus_infinity():
    """The plain SDPA path (no sinks) honours the window too: a sink of -inf is no sink."""
    attn, args, (q_lens, starts, full_k, full_v) = _paged_case(5, seed=2)
    q = args[0]
    with torch.inference_mode():
        ours = attn(*args[:-1])
    no_sinks = torch.full((q.shape[1],), float("-inf"))
    want = _transformers_reference(q, no_sinks, 5, q_lens, starts, full_k, full_v, attn.scale)
    torch.testing.assert_close(ours, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("truncate", [True, False])
def test_yarn_rotary_tables_equal_transformers(truncate):
    """inv_freq, the attention factor and the cos/sin tables of YaRN equal transformers'
    `GptOssRotaryEmbedding` (truncate on and off; the factor multiplies cos and sin)."""
    from transformers import AutoConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    from moe_engine.models.layers.rotary import RotaryEmbedding, rope_with_scaling_of

    rope = {
        "rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
        "beta_slow": 1.0, "original_max_position_embeddings": 4096, "truncate": truncate,
    }
    config = AutoConfig.for_model(
        "gpt_oss", hidden_size=128, num_attention_heads=2, head_dim=64, rope_parameters=rope,
        max_position_embeddings=131072,
    )
    theta, yarn = rope_with_scaling_of(config)
    ours = RotaryEmbedding(64, 300, theta, yarn)
    hf = GptOssRotaryEmbedding(config)
    positions = torch.arange(300)
    cos, sin = hf(torch.zeros(1, dtype=torch.float32), positions[None])
    assert hf.attention_scaling > 1.3  # 0.1 ln 32 + 1
    torch.testing.assert_close(ours.cos_cache[:, :32], cos[0], rtol=0, atol=0)
    torch.testing.assert_close(ours.sin_cache[:, :32], sin[0], rtol=0, atol=0)
