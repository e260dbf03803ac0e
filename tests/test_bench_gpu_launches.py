"""bench/gpu_launches.py: the launch counter itself, and the MoE block's launches on the CUDA
code path (issue 42: align, router and the sum tail one kernel each)."""

from __future__ import annotations

import pytest
import torch
from bench_loader import load_bench

launches = load_bench("gpu_launches")


def test_views_allocations_and_no_op_casts_are_not_launches() -> None:
    counter = launches.LaunchCounter()
    with counter:
        x = torch.zeros(4)  # a fill kernel on CUDA
        y = x.view(2, 2).t().unsqueeze(0).expand(3, 2, 2)  # views
        torch.empty(8)  # the caching allocator, no kernel
        y.float().contiguous()  # already float32; expanded, so contiguous() copies: a launch
        x.add_(1)
        x.to(torch.float64)  # a real cast
    assert [launch.op for launch in counter.launches] == ["zeros", "clone", "add_", "_to_copy"]


@pytest.mark.slow
def test_qwen3_moe_block_is_one_kernel_per_step_of_the_pipeline(tmp_path) -> None:
    """One decode step of 2 requests: per MoE layer the router is its linear and one fused
    top-k, the alignment one kernel, the experts the two grouped GEMMs and moe_sum; attention
    the QKV and output projections, the prologue (q/k norm, rope, KV-cache write) and the
    paged kernel; the two norms one kernel each, the residual adds fused into them."""
    ckpt = launches.make_checkpoint("qwen3_moe", tmp_path)
    counter = launches.count_decode_step(ckpt, 2)
    layers = launches.per_layer(counter)
    assert [lc.moe for lc in layers] == [True, True]
    for lc in layers:
        assert (lc.parts["router"], lc.parts["align"], lc.parts["experts"]) == (2, 1, 3), lc
        adds = lc.parts.get("residual", 0)
        assert (lc.parts["attention"], lc.parts["norms"], adds) == (4, 2, 0), lc
    ops = {(x.part, x.op) for x in counter.launches if x.layer == 1}
    assert {
        ("align", "triton:moe_align_block_size_kernel"),
        ("router", "triton:router_topk_kernel"),
        ("experts", "triton:moe_sum_kernel"),
        ("attention", "triton:paged_attention_kernel"),
        ("attention", "triton:qk_norm_rope_cache_kernel"),
        ("norms", "triton:rms_norm_kernel"),
    } <= ops


@pytest.mark.slow
def test_deepseek_v3_moe_block_folds_the_shared_experts_and_the_load_count(tmp_path) -> None:
    """One decode step of 1 request: DeepSeek-V3's MoE layer has the shared experts as one
    gate_up GEMM, `silu_and_mul` and the down GEMM; their add is in `moe_sum` and the expert
    load is counted by the router kernel, so nothing else runs in the block (10 launches)."""
    ckpt = launches.make_checkpoint("deepseek_v3", tmp_path)
    counter = launches.count_decode_step(ckpt, 1)
    moe = [lc for lc in launches.per_layer(counter) if lc.moe]
    assert len(moe) == 1
    parts = moe[0].parts
    assert (parts["shared"], parts.get("moe_other", 0)) == (3, 0), parts
    assert (parts["router"], parts["align"], parts["experts"]) == (3, 1, 3), parts
    ops = {(x.part, x.op) for x in counter.launches if x.layer == moe[0].layer}
    assert ("shared", "triton:silu_and_mul_kernel") in ops
