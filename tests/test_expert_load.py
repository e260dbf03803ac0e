"""Expert-load counters equal a bincount of the topk_ids the model produced; formulas by hand."""

from __future__ import annotations

import torch

import kernels.dense.ops as dense_ops
import moe_engine.models.layers.moe as moe_module
from moe_engine import LLM, SamplingParams
from moe_engine.instrumentation import ExpertLoadRecorder, balancedness, imbalance_ratio


def test_counts_equal_bincount_of_produced_topk_ids(qwen3_nonorm_ckpt, monkeypatch):
    produced: list[torch.Tensor] = []

    def spy(real):
        def routed(logits, top_k, renormalize):
            weights, ids = real(logits, top_k, renormalize)
            produced.append(ids.clone())
            return weights, ids
        return routed

    # the torch routing and the native one (what a native-cpu FusedMoE calls)
    for module, name in ((moe_module, "softmax_topk"), (dense_ops, "router_softmax_topk")):
        monkeypatch.setattr(module, name, spy(getattr(module, name)))
    llm = LLM(model=str(qwen3_nonorm_ckpt), max_model_len=256, max_num_batched_tokens=32)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 50, 90)]
    llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    load = llm.engine.get_expert_load()
    num_moe = len(load.moe_layers)
    assert load.moe_layers == [1, 3]  # decoder_sparse_step 2
    num_experts = llm.engine.spec.num_experts
    expected = torch.zeros(num_moe, num_experts, dtype=torch.int64)
    for call, ids in enumerate(produced):  # MoE layers run in order within every step
        expected[call % num_moe] += torch.bincount(ids.flatten().long(), minlength=num_experts)
    assert load.counts == expected.tolist()
    total_tokens = sum(len(p) for p in prompts) + 3 * 6 - 3  # the last token is never fed
    assert expected.sum(dim=1).tolist() == [total_tokens * llm.engine.spec.top_k] * num_moe


def test_imbalance_formulas_on_hand_made_tables():
    load = torch.tensor([[4, 4, 4, 4], [10, 0, 0, 2], [0, 0, 0, 0]])
    assert imbalance_ratio(load).tolist() == [1.0, 10 / 3, 0.0]
    assert balancedness(load).tolist() == [1.0, 0.3, 0.0]


def test_record_layers_counts_as_record_does_layer_by_layer():
    """The native decode layers' one `index_add_` per step (`record_layers`) adds what one
    `record` per layer adds."""
    g = torch.Generator().manual_seed(3)
    a, b = ExpertLoadRecorder([1, 3, 4], 8), ExpertLoadRecorder([1, 3, 4], 8)
    ids = torch.randint(0, 8, (2, 5, 2), generator=g, dtype=torch.int32)
    for layer, layer_ids in zip([4, 1], ids, strict=True):
        a.record(layer, layer_ids)
    b.record_layers([4, 1], ids)
    assert torch.equal(a.counts, b.counts) and b.counts.sum() == 20
    assert not b.counts[1].any()  # layer 3: nothing routed
