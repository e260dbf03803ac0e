"""Multi-head latent attention: `MLAAttention` against transformers' DeepseekV3Attention and
DeepseekV2Attention (same random float32 weights) over a paged latent cache, under a
multi-token prefill, a chunked continuation and decode steps for requests of different lengths;
absorbed decode against expanded decode; interleaved RoPE (V3 slices vs V2 complex); YaRN's
mscale softmax correction; and the latent cache end to end through the ModelRunner and the
scheduler with prefix caching."""

from __future__ import annotations

import pytest
import torch
from mla_helpers import (
    HEADS,
    HIDDEN,
    KV_LORA,
    MAX_POS,
    NOPE,
    ROPE,
    V,
    engine_attention,
    hf_attention,
    hf_config,
    hf_reference,
    step_metadata,
)

from moe_engine.models.layers.rotary import RotaryEmbedding, deinterleave

BS = 4  # tokens per block
#: Two requests of different lengths: block tables out of order, the null block 0 unused.
TABLES = {"a": [3, 7, 1, 5], "b": [2, 6, 4]}
#: (request, start, num_tokens) per step, decodes first as the ModelRunner orders them:
#: both prefill; b decodes while a's prefill continues (chunked: its queries read the 9 cached
#: latents and their own); then three decode steps.
STEPS = [
    [("a", 0, 9), ("b", 0, 6)],
    [("b", 6, 1), ("a", 9, 4)],
    *([("a", 13 + i, 1), ("b", 7 + i, 1)] for i in range(3)),
]
LENGTHS = {"a": 16, "b": 10}
CASES = [  # (family, q_lora_rank, yarn, rope_interleave)
    ("v3", 24, False, True),
    ("v3", None, True, True),
    ("v3", 24, True, False),  # rope_interleave off: plain rotate-half
    ("v2", 24, True, True),
    ("v2", None, False, True),
]


def run_steps(mla, hidden: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """Feed STEPS through `mla` over a fresh latent cache -> (outputs per request [N, H],
    the cache)."""
    cache = torch.zeros(9, BS, KV_LORA + ROPE)
    out = {r: torch.full_like(h, float("nan")) for r, h in hidden.items()}
    for step in STEPS:
        positions, meta = step_metadata([(TABLES[r], s, n) for r, s, n in step], BS)
        h = torch.cat([hidden[r][s : s + n] for r, s, n in step])
        with torch.inference_mode():
            o = mla(h, positions, meta, cache)
        i = 0
        for r, s, n in step:
            out[r][s : s + n] = o[i : i + n]
            i += n
    return out, cache


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("family,q_lora_rank,yarn,interleave", CASES)
def test_mla_matches_transformers_prefill_chunk_decode(family, q_lora_rank, yarn, interleave):
    cfg = hf_config(family, q_lora_rank, yarn, interleave)
    hf = hf_attention(cfg)
    torch.manual_seed(1)
    hidden = {r: torch.randn(n, HIDDEN) for r, n in LENGTHS.items()}
    ref = {r: hf_reference(cfg, hf, h) for r, h in hidden.items()}
    outs = {}
    for absorb in (True, False):
        mla = engine_attention(cfg, hf, absorb=absorb)
        outs[absorb], cache = run_steps(mla, hidden)
        assert (mla._w_uk is not None) == absorb  # the absorbed path ran only when asked
        for r in hidden:
            assert rel_err(outs[absorb][r], ref[r]) < 1e-5, (r, absorb)
        assert not cache[0].any()  # the null block is never written
    for r in hidden:  # decode rows (the last 4 of b, 3 of a): absorbed == expanded
        decodes = slice(LENGTHS[r] - (4 if r == "b" else 3), None)
        assert rel_err(outs[True][r][decodes], outs[False][r][decodes]) < 1e-5


def test_triton_prologue_and_decode_match_transformers():
    """The triton plan's MLA layer (under the interpreter): the one-launch prologue
    (kv_a_layernorm, rope of k_pe and q_pe, latent write) and the absorbed decode kernel
    reading q_lat and q_pe where they lie give transformers' outputs and the module path's
    cache, over prefills, a chunked continuation, mixed and decode-only steps."""
    from kernels.plan import KernelPlan

    cfg = hf_config("v3", 24, True, True)
    hf = hf_attention(cfg)
    torch.manual_seed(3)
    hidden = {r: torch.randn(n, HIDDEN) for r, n in LENGTHS.items()}
    mla = engine_attention(cfg, hf)
    mla.bind_kernels(KernelPlan.uniform("triton"))
    assert mla.prologue is not None and mla.decode_kernel is not None
    out, cache = run_steps(mla, hidden)
    _, want_cache = run_steps(engine_attention(cfg, hf), hidden)
    for r, h in hidden.items():
        assert rel_err(out[r], hf_reference(cfg, hf, h)) < 1e-5, r
    assert rel_err(cache, want_cache) < 1e-6


def test_latent_cache_holds_normalised_ckv_then_roped_kpe():
    cfg = hf_config("v3", 24, False)
    hf = hf_attention(cfg)
    mla = engine_attention(cfg, hf)
    torch.manual_seed(2)
    hidden = {r: torch.randn(n, HIDDEN) for r, n in LENGTHS.items()}
    _, cache = run_steps(mla, hidden)
    h = hidden["b"]
    c_kv, k_pe = hf.kv_a_proj_with_mqa(h).split([KV_LORA, ROPE], dim=-1)
    slots = [TABLES["b"][p // BS] * BS + p % BS for p in range(LENGTHS["b"])]
    stored = cache.view(-1, KV_LORA + ROPE)[slots]
    torch.testing.assert_close(stored[:, :KV_LORA], hf.kv_a_layernorm(c_kv))
    # k_pe at position 0 is unrotated (cos 1, sin 0), up to the de-interleaved layout
    torch.testing.assert_close(stored[0, KV_LORA:], deinterleave(k_pe[0]))


def test_v2_complex_rope_is_v3_interleave_up_to_one_permutation():
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import (
        DeepseekV2RotaryEmbedding,
        apply_rotary_emb,
    )
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3RotaryEmbedding,
        apply_rotary_pos_emb_interleave,
    )

    torch.manual_seed(3)
    q, k = torch.randn(1, HEADS, 7, ROPE), torch.randn(1, 1, 7, ROPE)
    pos = torch.arange(7)[None] * 3
    cos, sin = DeepseekV3RotaryEmbedding(hf_config("v3", 24, True))(q, pos)
    q3, k3 = apply_rotary_pos_emb_interleave(q, k, cos, sin)
    freqs = DeepseekV2RotaryEmbedding(hf_config("v2", 24, True))(q, pos)
    q2, k2 = apply_rotary_emb(q, k, freqs)
    # V2 leaves the rotated pairs interleaved, V3 de-interleaves them: one permutation ...
    torch.testing.assert_close(deinterleave(q2), q3)
    torch.testing.assert_close(deinterleave(k2), k3)
    # ... applied to q and k alike, so the scores agree
    torch.testing.assert_close(q2 @ k2.transpose(-1, -2), q3 @ k3.transpose(-1, -2))
    # and the engine's interleaved rotary is V3's
    from moe_engine.models.layers.rotary import YarnScaling

    yarn = YarnScaling.from_rope_parameters(hf_config("v3", 24, True).rope_parameters, MAX_POS)
    rotary = RotaryEmbedding(ROPE, MAX_POS, 10000.0, yarn, interleaved=True)
    qe, ke = rotary(pos[0], q[0].transpose(0, 1), k[0].transpose(0, 1))
    torch.testing.assert_close(qe, q3[0].transpose(0, 1))
    torch.testing.assert_close(ke, k3[0].transpose(0, 1))


def test_yarn_mscale_all_dim_corrects_the_softmax_scale():
    for yarn in (False, True):
        cfg = hf_config("v3", 24, yarn)
        hf = hf_attention(cfg)
        mla = engine_attention(cfg, hf)
        assert mla.scale == pytest.approx(hf.scaling, rel=1e-12)
        base = (NOPE + ROPE) ** -0.5
        assert (mla.scale == pytest.approx(base)) == (not yarn)


def test_absorbed_weights_follow_a_weight_reload():
    cfg = hf_config("v3", None, False)
    hf = hf_attention(cfg)
    torch.manual_seed(4)
    hidden = {r: torch.randn(n, HIDDEN) for r, n in LENGTHS.items()}
    mla = engine_attention(cfg, hf)
    run_steps(mla, hidden)
    with torch.no_grad():  # as a weight update would: in place, then the oracle changes too
        hf.kv_b_proj.weight.mul_(1.5)
        mla.kv_b_proj.weight.copy_(hf.kv_b_proj.weight)
    mla.kv_b_proj.reset_packed()
    out, _ = run_steps(mla, hidden)
    for r, h in hidden.items():
        assert rel_err(out[r], hf_reference(cfg, hf, h)) < 1e-5


def test_bad_sizes_are_refused():
    from moe_engine.models.layers.mla import MLAAttention

    rotary = RotaryEmbedding(ROPE, MAX_POS, 10000.0, interleaved=True)
    kw = dict(q_lora_rank=None, kv_lora_rank=KV_LORA, qk_nope_head_dim=NOPE,
              qk_rope_head_dim=ROPE, v_head_dim=V, rotary=rotary)
    with pytest.raises(ValueError, match="kv_lora_rank 0"):
        MLAAttention(HIDDEN, HEADS, **{**kw, "kv_lora_rank": 0})
    with pytest.raises(ValueError, match="rotary rotates 8 dims"):
        MLAAttention(HIDDEN, HEADS, **{**kw, "qk_rope_head_dim": 16})


def test_checkpoint_names_fill_the_fused_qkv_a_proj():
    """With a query LoRA, q_a_proj and kv_a_proj_with_mqa are the rows of one GEMM
    (`fused_qkv_a_proj`): the checkpoint's names load into its rows, missing pieces are named
    as the checkpoint names them, a weight update's names resolve to the rows they fill, and
    the one GEMM's output equals the two projections' bit for bit."""
    from fixtures import tiny_config
    from transformers import AutoModelForCausalLM

    from moe_engine.models.deepseek_v3 import DeepseekV3ForCausalLM
    from moe_engine.models.weight_mapping import WeightLoader
    from moe_engine.weight_update.messages import TensorMeta
    from moe_engine.weight_update.targets import ParamTarget, resolve_targets

    cfg = tiny_config("deepseek_v3", num_hidden_layers=1)
    torch.manual_seed(0)
    state = AutoModelForCausalLM.from_config(cfg).float().state_dict()
    model = DeepseekV3ForCausalLM(DeepseekV3ForCausalLM.arch_spec(cfg), torch.float32)
    loader = WeightLoader(model)
    assert loader.load(state.items()) == loader.expected_names()
    prefix = "model.layers.0.self_attn."
    names = [f"{prefix}q_a_proj.weight", f"{prefix}kv_a_proj_with_mqa.weight"]
    fused = model.model.layers[0].self_attn.fused_qkv_a_proj
    assert torch.equal(fused.weight, torch.cat([state[n] for n in names]))
    pieces = [f"{prefix}fused_qkv_a_proj.weight.q_a", f"{prefix}fused_qkv_a_proj.weight.kv_a"]
    assert loader.checkpoint_names(pieces) == names
    metas = [TensorMeta(n, "float32", list(state[n].shape)) for n in names]
    assert resolve_targets(model, metas) == [
        ParamTarget(f"{prefix}fused_qkv_a_proj.weight", shard) for shard in ("q_a", "kv_a")
    ]
    h = torch.randn(5, cfg.hidden_size)
    q_a, kv_a = fused(h).split([cfg.q_lora_rank, cfg.kv_lora_rank + cfg.qk_rope_head_dim], -1)
    assert torch.equal(q_a, h @ state[names[0]].T) and torch.equal(kv_a, h @ state[names[1]].T)
