"""Qwen3-Next (`Qwen3NextForCausalLM`: Gated DeltaNet linear attention + gated full attention)
and Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`) against transformers 5.24 on tiny
float32 random checkpoints (tests/fixtures.py kinds "qwen3_next", "qwen3_5_moe_text"),
offline through `LLM`; the gRPC, ep 2 and chaos side is tests/test_qwen3_next_server.py.

- greedy ids equal `transformers.generate` for prompts of 1..300 tokens with a 32-token budget
  (prefills chunked, each chunk continuing the state the last one left) and a small block pool
  (preemption drops the state and recomputes it); last-position logits within 1e-4 relative;
- n > 1 completions, each computing its own state (no block sharing for these models);
- state slots: one per running request, all back after finishes, aborts and preemptions; the
  null slot stays zero;
- the plan: state bytes per request from the layer sizes, taken out of the KV budget and
  printed; weight bytes equal the built model's;
- refusals at startup: prefix caching and speculative decoding, naming the flag and reason.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures import hf_greedy, hf_last_logits, make_tiny_checkpoint

from moe_engine import LLM, SamplingParams
from moe_engine.errors import StartupError
from moe_engine.kv_cache.manager import KVCacheManager
from moe_engine.kv_cache.spec import FullAttentionSpec
from moe_engine.kv_cache.state import MambaSpec, StateSlotPool
from moe_engine.models import model_shape
from moe_engine.request import Request
from moe_engine.startup.plan import make_plan

PROMPT_LENS = [1, 2, 3, 7, 16, 17, 31, 32, 33, 64, 129, 300]
MAX_NEW = 10
LOGITS_RTOL = 1e-4
MAX_NUM_SEQS = 6


def _prompts(lens: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def llm(qwen3_next_ckpt) -> LLM:
    """A 32-token budget (longer prompts are chunked) and 21 blocks of 16 tokens (the prompts
    cannot all be cached at once: some are preempted)."""
    return LLM(model=str(qwen3_next_ckpt), max_num_batched_tokens=32, num_blocks_override=21,
               max_model_len=320, max_num_seqs=MAX_NUM_SEQS)


def _idle(llm: LLM) -> None:
    s = llm.engine.get_stats()
    assert s.kv_blocks_free == s.kv_blocks_total
    assert s.state_slots_free == s.state_slots_total == MAX_NUM_SEQS


def test_greedy_matches_transformers_with_chunking_and_preemption(llm, qwen3_next_ckpt):
    prompts = _prompts(PROMPT_LENS, seed=11)
    expected = hf_greedy(qwen3_next_ckpt, prompts, MAX_NEW)
    before = llm.engine.get_stats().num_preemptions
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.engine.get_stats().num_preemptions > before
    _idle(llm)
    # the null slot (padding, and the profile run's scratch) stays all zeros
    for conv, ssm in (llm.engine.runner.kv_caches[i] for i in (0, 2, 3)):
        assert not conv[0].any() and not ssm[0].any()


def test_one_request_at_a_time_and_decodes_batched(llm, qwen3_next_ckpt):
    """Batch 1 (each decode the recurrent step of one request) and a batch whose decodes run
    together while another request prefills."""
    prompts = _prompts([5, 90, 1], seed=4)
    expected = hf_greedy(qwen3_next_ckpt, prompts, 12)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [llm.generate([p], sp)[0].outputs[0].token_ids for p in prompts]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert alone == together == expected
    _idle(llm)


def test_last_position_logits_within_tolerance(llm, qwen3_next_ckpt):
    captured: list[torch.Tensor] = []
    model = llm.engine.model
    compute = model.compute_logits
    model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    try:
        for prompt in _prompts([16, 40, 129], seed=3):  # 40 and 129: chunked prefills
            captured.clear()
            llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
            ours, ref = captured[-1][0], hf_last_logits(qwen3_next_ckpt, prompt)
            rel = ((ours - ref).norm() / ref.norm()).item()
            assert rel < LOGITS_RTOL, f"relative error {rel:.2e}, prompt of {len(prompt)} tokens"
    finally:
        del model.compute_logits


def test_parallel_sampling_children_compute_their_own_state(llm, qwen3_next_ckpt):
    """n = 3 greedy completions of one prompt: each child computes the prompt itself (a
    sibling's blocks would carry no state), so all three equal transformers."""
    prompt = _prompts([45], seed=9)[0]
    expected = hf_greedy(qwen3_next_ckpt, [prompt], 6)[0]
    out = llm.generate([prompt], SamplingParams(n=3, max_tokens=6, temperature=0,
                                                ignore_eos=True))[0]
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    _idle(llm)


def test_aborts_return_every_slot_and_block(llm):
    engine = llm.engine
    sp = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    for i, p in enumerate(_prompts([3, 50, 120, 8, 70], seed=5)):
        engine.add_request(f"abort-{i}", p, sp)
    for _ in range(4):
        engine.step()
    assert engine.get_stats().state_slots_free < MAX_NUM_SEQS
    engine.abort_requests([f"abort-{i}" for i in range(5)])
    while engine.has_unfinished_requests():
        engine.step()
    _idle(llm)


def test_weight_bytes_equal_the_plan(llm):
    engine = llm.engine
    info = {k: v for k, v in engine.weight_info().items() if k.startswith("weight_bytes_")}
    assert info["weight_bytes_experts"] == engine.plan.weight_bytes_experts
    rest = sum(v for k, v in info.items() if k != "weight_bytes_experts")
    assert rest == engine.plan.weight_bytes_other
    assert sum(info.values()) == sum(p.numel() * 4 for p in engine.model.parameters())


def test_plan_takes_the_state_out_of_the_kv_budget(qwen3_next_ckpt):
    shape = model_shape(json.loads((qwen3_next_ckpt / "config.json").read_text()))
    assert shape.linear_attention_layers() == (0, 2, 3)
    (c, w), (hv, dk, dv) = shape.linear_state_shapes()
    assert (c, w, hv, dk, dv) == (2 * 2 * 16 + 4 * 16, 3, 4, 16, 16)
    per_request = 3 * (c * w * 4 + hv * dk * dv * 4)
    budget = 1 << 20
    plan = make_plan(shape, torch.float32, block_size=16, max_model_len=256,
                     kv_cache_memory=budget, max_num_seqs=8)
    assert plan.state_bytes_per_request == per_request and plan.num_state_slots == 8
    assert plan.state_memory == 9 * per_request  # the null slot too
    # one full-attention layer's K and V: 2 x 2 heads x 16 dims x 4 bytes per token
    assert plan.kv_bytes_per_token == 256
    assert plan.num_blocks == (budget - plan.state_memory) // plan.kv_bytes_per_block
    text = plan.describe()
    assert "linear-attention state:" in text and "8 slots (max_num_seqs) + 1 null slot" in text
    # a budget the slots fill before one max_model_len request's KV fits: refused, with the
    # max_num_seqs that fits ((budget - 16 blocks of 4 KiB) // per_request - 1 null slot)
    small = 40 * per_request
    with pytest.raises(StartupError) as err:
        make_plan(shape, torch.float32, block_size=16, max_model_len=256,
                  kv_cache_memory=small, max_num_seqs=64)
    fits = (small - 16 * plan.kv_bytes_per_block) // per_request - 1
    assert f"lower --max-num-seqs to {fits} or less" in str(err.value)


def test_state_slot_pool_and_the_manager():
    pool = StateSlotPool(2)
    kv = KVCacheManager([FullAttentionSpec(16, 1, 4, torch.float32, 1)], 8, state_slots=pool)
    reqs = [Request(f"r{i}", [5] * 20, SamplingParams(max_tokens=4)) for i in range(3)]
    assert kv.allocate_slots(reqs[0], 20) and kv.allocate_slots(reqs[1], 20)
    assert {kv.state_slot("r0"), kv.state_slot("r1")} == {1, 2}
    free_blocks = kv.num_free_blocks
    assert not kv.allocate_slots(reqs[2], 4)  # no slot left: nothing taken
    assert kv.num_free_blocks == free_blocks
    with pytest.raises(KeyError, match="r2"):
        kv.state_slot("r2")
    kv.free("r0")
    assert kv.allocate_slots(reqs[2], 4) and kv.state_slot("r2") == 1
    assert kv.get_computed_blocks(reqs[1]).num_tokens == 0  # never a prefix hit
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        KVCacheManager([FullAttentionSpec(16, 1, 4, torch.float32, 1)], 8,
                       enable_prefix_caching=True, state_slots=StateSlotPool(1))
    spec = MambaSpec((0, 2), (6, 3), (2, 4, 5), torch.bfloat16)
    assert spec.bytes_per_request == 2 * (6 * 3 * 2 + 2 * 4 * 5 * 4)
    conv, ssm = spec.allocate(3)[0]
    assert conv.shape == (4, 6, 3) and ssm.shape == (4, 2, 4, 5) and ssm.dtype == torch.float32


@pytest.mark.parametrize("flags,named", [
    (dict(enable_prefix_caching=True), "--enable-prefix-caching"),
    (dict(speculative_method="ngram", num_speculative_tokens=2), "--speculative-method ngram"),
    # refused as a hybrid first (the model has no MTP layers either, whose refusal says ngram)
    (dict(speculative_method="mtp", num_speculative_tokens=1), "--speculative-method mtp"),
])
def test_refused_at_startup_naming_the_flag(qwen3_next_ckpt, flags, named):
    with pytest.raises(StartupError) as err:
        LLM(model=str(qwen3_next_ckpt), max_model_len=64, **flags)
    assert named in str(err.value) and "3 of its 4 layers are linear attention" in str(err.value)


def test_qwen3_5_moe_text_matches_transformers(tiny_ckpt_root):
    """Qwen3.5-MoE's text model (`Qwen3_5MoeForCausalLM`): the split linear projections, every
    layer MoE; greedy ids equal transformers with chunked prefill."""
    ckpt = make_tiny_checkpoint("qwen3_5_moe_text", tiny_ckpt_root)
    prompts = _prompts([1, 33, 200], seed=6)
    expected = hf_greedy(ckpt, prompts, 8)
    llm = LLM(model=str(ckpt), max_num_batched_tokens=32, max_model_len=256)
    assert llm.engine.architecture == "Qwen3_5MoeForCausalLM"
    assert llm.engine.spec.moe_layers == (0, 1, 2, 3)
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_pieces_match_transformers(qwen3_next_ckpt):
    """The zero-centred and gated norms and the gated attention's q/gate split against
    transformers' modules on random inputs."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextRMSNorm,
        Qwen3NextRMSNormGated,
    )

    from moe_engine.models.layers.norm import GatedRMSNorm, ZeroCenteredRMSNorm

    g = torch.Generator().manual_seed(0)
    x, gate = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    w = torch.randn(16, generator=g)
    ref, ours = Qwen3NextRMSNorm(16, 1e-6), ZeroCenteredRMSNorm(16, 1e-6)
    ref_g, ours_g = Qwen3NextRMSNormGated(16, 1e-6), GatedRMSNorm(16, 1e-6)
    with torch.no_grad():
        for m in (ref, ours, ref_g, ours_g):
            m.weight.copy_(w)
        assert torch.equal(ours(x), ref(x))
        assert torch.equal(ours_g(x, gate), ref_g(x, gate))
        xb = x.bfloat16()
        ref.bfloat16(), ours.bfloat16()
        assert torch.equal(ours(xb), ref(xb))
