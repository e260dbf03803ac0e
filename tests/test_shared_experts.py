"""Shared experts in FusedMoE: equal to a float64 reference and to transformers' MoE blocks
(DeepseekV3MoE ungated, Qwen2MoeSparseMoeBlock sigmoid-gated) loaded through the checkpoint
names; under a 2-rank all-to-all split each rank's output equals one rank's, and the shared
experts run once per token, on its own rank, outside the routed load."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from dist_utils import run_ranks

from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.layers.routers import SigmoidGroupedTopKRouter, SoftmaxTopKRouter
from moe_engine.models.layers.shared_experts import SharedExperts, shared_expert_param_name
from moe_engine.phase_timer import PhaseTimer

H, I_EXPERT, I_SHARED, E, K = 32, 16, 24, 16, 4


def _v3_block(seed: int = 0) -> FusedMoE:
    """A DeepSeek-V3-style block (sigmoid grouped router, ungated shared experts), random."""
    router = SigmoidGroupedTopKRouter(H, E, K, n_group=4, topk_group=2, norm_topk_prob=True,
                                      routed_scaling_factor=2.5)
    moe = FusedMoE(E, K, H, I_EXPERT, renormalize=False, dtype=torch.float32, router=router,
                   shared_experts=SharedExperts(H, I_SHARED, torch.float32))
    g = torch.Generator().manual_seed(seed)
    for t in [*moe.parameters(), *moe.buffers()]:
        t.data.copy_(torch.randn(t.shape, generator=g) * 0.3)
    return moe


def _reference(moe: FusedMoE, hidden: torch.Tensor) -> torch.Tensor:
    """float64 loop over tokens and their experts, plus the shared MLP (gated when it is)."""
    weights, ids = moe.gate(hidden)  # the routing itself is tested in test_routing_grouped.py
    x = hidden.double()
    w13, w2 = moe.w13.double(), moe.w2.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].double(), ids[t].tolist(), strict=True):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    se = moe.shared_experts
    gate, up = x @ se.gate_proj.weight.double().T, x @ se.up_proj.weight.double().T
    shared = (F.silu(gate) * up) @ se.down_proj.weight.double().T
    if se.expert_gate is not None:
        shared = torch.sigmoid(x @ se.expert_gate.weight.double().T) * shared
    return out + shared


def test_shared_experts_add_to_the_routed_output_like_a_float64_reference():
    moe = _v3_block()
    moe.timer = PhaseTimer()
    hidden = torch.randn(9, H, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        out = moe(hidden)
    torch.testing.assert_close(out.double(), _reference(moe, hidden), rtol=1e-5, atol=1e-5)
    assert moe.timer.calls["shared_experts"] == 1 and moe.timer.calls["combine"] == 1
    gated = _v3_block()
    gated.shared_experts = SharedExperts(H, I_SHARED, torch.float32, gated=True)
    for p in gated.shared_experts.parameters():
        torch.nn.init.normal_(p, std=0.3)
    with torch.inference_mode():
        out = gated(hidden)
    torch.testing.assert_close(out.double(), _reference(gated, hidden), rtol=1e-5, atol=1e-5)


def _load_from_transformers(moe: FusedMoE, block: torch.nn.Module) -> None:
    """Fill `moe` from a transformers MoE block's state dict through the checkpoint names."""
    params = dict(moe.named_parameters()) | dict(moe.named_buffers())
    prefix = "model.layers.0.mlp."
    for name, tensor in block.state_dict().items():
        if name == "experts.gate_up_proj":
            moe.w13.data.copy_(tensor)
        elif name == "experts.down_proj":
            moe.w2.data.copy_(tensor)
        else:
            params[shared_expert_param_name(prefix + name).removeprefix(prefix)].data.copy_(tensor)


def _randomise(module: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(5)
    for t in [*module.parameters(), *module.buffers()]:
        t.data.copy_(torch.randn(t.shape, generator=g) * 0.3)


def test_deepseek_v3_block_equals_transformers():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    config = DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=I_EXPERT, n_shared_experts=2, n_routed_experts=E,
        n_group=4, topk_group=2, num_experts_per_tok=K, norm_topk_prob=True,
        routed_scaling_factor=2.5,
    )
    block = DeepseekV3MoE(config).eval()
    _randomise(block)
    router = SigmoidGroupedTopKRouter(H, E, K, 4, 2, True, 2.5)
    moe = FusedMoE(E, K, H, I_EXPERT, False, torch.float32, router=router,
                   shared_experts=SharedExperts(H, 2 * I_EXPERT, torch.float32))
    _load_from_transformers(moe, block)
    hidden = torch.randn(11, H, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        torch.testing.assert_close(moe(hidden), block(hidden[None])[0], rtol=1e-5, atol=1e-5)


def test_qwen2_moe_block_with_the_gated_shared_expert_equals_transformers():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = Qwen2MoeConfig(
        hidden_size=H, moe_intermediate_size=I_EXPERT, shared_expert_intermediate_size=I_SHARED,
        num_experts=E, num_experts_per_tok=K, norm_topk_prob=False,
    )
    block = Qwen2MoeSparseMoeBlock(config).eval()
    _randomise(block)
    moe = FusedMoE(E, K, H, I_EXPERT, False, torch.float32,
                   router=SoftmaxTopKRouter(H, E, K, norm_topk_prob=False),
                   shared_experts=SharedExperts(H, I_SHARED, torch.float32, gated=True))
    _load_from_transformers(moe, block)  # shared_expert(_gate) -> shared_experts(.expert_gate)
    hidden = torch.randn(11, H, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        torch.testing.assert_close(moe(hidden), block(hidden[None])[0], rtol=1e-5, atol=1e-5)


def test_checkpoint_names_reach_the_parameters():
    moe = FusedMoE(E, K, H, I_EXPERT, False, torch.float32,
                   router=SigmoidGroupedTopKRouter(H, E, K, 4, 2, True, 1.0),
                   shared_experts=SharedExperts(H, I_SHARED, torch.float32, gated=True))
    names = set(dict(moe.named_parameters())) | set(dict(moe.named_buffers()))
    assert {"gate.weight", "gate.e_score_correction_bias", "shared_experts.gate_proj.weight",
            "shared_experts.up_proj.weight", "shared_experts.down_proj.weight",
            "shared_experts.expert_gate.weight"} <= names
    qwen2 = "model.layers.3.mlp.shared_expert_gate.weight"
    assert shared_expert_param_name(qwen2) == "model.layers.3.mlp.shared_experts.expert_gate.weight"
    assert (shared_expert_param_name("model.layers.3.mlp.shared_expert.down_proj.weight")
            == "model.layers.3.mlp.shared_experts.down_proj.weight")
    v3 = "model.layers.3.mlp.shared_experts.up_proj.weight"
    assert shared_expert_param_name(v3) == v3


# --- two ranks over the real all-to-all (gloo) ---------------------------------------------------

TOKENS_PER_RANK = (5, 9)


def _two_rank_case(rank: int, world: int) -> dict:
    from comm import ExpertPlacement, TorchAllToAll
    from moe_engine.instrumentation import ExpertLoadRecorder

    whole = _v3_block()
    placement = ExpertPlacement.contiguous(E, world)
    local = list(placement.slots[rank])
    moe = _v3_block()
    moe.shard_experts(local, TorchAllToAll(None, placement), rank)
    moe.w13.data.copy_(whole.w13.data[local])
    moe.w2.data.copy_(whole.w2.data[local])
    recorder = ExpertLoadRecorder([0], E, ep_size=world)
    moe.attach_recorder(recorder, 0)
    shared_rows: list[int] = []
    moe.shared_experts.register_forward_hook(lambda m, args, out: shared_rows.append(len(args[0])))
    hidden = torch.randn(sum(TOKENS_PER_RANK), H, generator=torch.Generator().manual_seed(4))
    start = sum(TOKENS_PER_RANK[:rank])
    mine = hidden[start : start + TOKENS_PER_RANK[rank]]  # the tokens this rank owns
    with torch.inference_mode():
        out, expected = moe(mine), whole(mine)
    return dict(
        max_diff=float((out - expected).abs().max()),
        shared_rows=shared_rows,
        routed_pairs=int(recorder.counts.sum()),
        rank_pairs=recorder.rank_tokens[0].tolist(),
    )


def test_shared_experts_under_a_two_rank_split_run_once_per_token_on_its_own_rank():
    results = run_ranks(_two_rank_case, 2, timeout_s=120)
    for rank, r in enumerate(results):
        assert r["max_diff"] < 1e-5
        assert r["shared_rows"] == [TOKENS_PER_RANK[rank]]  # its own tokens, once
        assert r["routed_pairs"] == TOKENS_PER_RANK[rank] * K  # routed pairs only
    # pairs processed per rank add up to the routed pairs: no shared-expert work in them
    assert sum(sum(r["rank_pairs"]) for r in results) == sum(TOKENS_PER_RANK) * K


def test_triton_plan_merges_gate_up_and_adds_in_the_tail_like_the_separate_ops():
    """Bound to the triton backend (interpreter), a bf16 V3 block runs the shared experts as
    one gate_up GEMM + `silu_and_mul`, adds them inside `moe_sum` and counts the load in the
    router; the output is bit for bit the separate torch ops on the same routing and routed
    experts (`routed + down(silu(gate(x)) * up(x))`), the counts `index_add_`'s; a weight
    copied into gate_proj in place (a reload) reaches the merged GEMM."""
    from kernels.plan import TRITON, KernelPlan
    from moe_engine.instrumentation import ExpertLoadRecorder
    from moe_engine.models.kernel_binding import bind_kernels

    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(3)).bfloat16()
    moe = _v3_block(seed=4).to(torch.bfloat16)
    moe.gate.float()  # the router stays float32, as the model keeps it
    recorder = ExpertLoadRecorder([0], E)
    moe.attach_recorder(recorder, 0)
    bind_kernels(torch.nn.ModuleList([moe]), KernelPlan.uniform(TRITON, "cpu"))
    se = moe.shared_experts
    assert se._gate_up is not None
    assert se.gate_proj.weight.data_ptr() == se._gate_up[1].data_ptr()

    def separate() -> torch.Tensor:
        weights, ids = moe.gate(hidden)
        routed = moe.bound_experts(hidden, weights, ids)
        gate, up = F.linear(hidden, se.gate_proj.weight), F.linear(hidden, se.up_proj.weight)
        return routed + F.linear(F.silu(gate) * up, se.down_proj.weight), ids

    with torch.inference_mode():
        want, ids = separate()
        assert torch.equal(moe(hidden), want)
        counts = torch.zeros(E, dtype=torch.int64).index_add_(
            0, ids.reshape(-1).long(), torch.ones(ids.numel(), dtype=torch.int64)
        )
        assert torch.equal(recorder.counts[0], counts)
        new = torch.randn(I_SHARED, H, generator=torch.Generator().manual_seed(5)).bfloat16()
        se.gate_proj.weight.data.copy_(new)
        want, _ = separate()
        assert torch.equal(moe(hidden), want)
