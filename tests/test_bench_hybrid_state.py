"""bench/hybrid_state.py: part 1's arithmetic against an independent computation from the
published Qwen3-Next-80B-A3B sizes, its helpers, and one `--quick` run (both small checkpoints
made under tmp_path, contexts 256 and 1024, 8 output tokens, one run)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
import torch
from bench_loader import load_bench

from moe_engine.models import model_shape
from moe_engine.startup.plan import make_plan

GIB = 1 << 30
#: Qwen3-Next-80B-A3B, by hand: 48 layers, 12 full attention (2 KV heads of 256), 36 Gated
#: DeltaNet (conv channels 2 x 16 x 128 + 32 x 128 = 8192, width 4; recurrent 32 x 128 x 128).
KV_PER_TOKEN_HYBRID = 12 * 2 * 2 * 256 * 2  # layers x (K, V) x heads x dims x bf16 = 24 KiB
KV_PER_TOKEN_FULL = 48 * 2 * 2 * 256 * 2  # 96 KiB
CONV = 8192 * 3 * 2  # C x (W - 1) x bf16
STATE_BF16 = 36 * (CONV + 32 * 128 * 128 * 2)
STATE_FP32 = 36 * (CONV + 32 * 128 * 128 * 4)  # the recurrent state in float32, as stored
BLOCKS_4K = 4096 // 16


def _largest_batch(state: int, kv_per_token: int) -> int:
    """Largest B: the 4 GiB less B + 1 state slots (none without state) buys B x 256 blocks
    of 16 tokens."""
    block = 16 * kv_per_token
    b = 0
    while (GIB * 4 - ((b + 2) * state if state else 0)) // block >= (b + 1) * BLOCKS_4K:
        b += 1
    return b


@pytest.fixture(scope="module")
def hs() -> ModuleType:
    return load_bench("hybrid_state")


def test_arithmetic_matches_hand_computation(hs: ModuleType) -> None:
    assert STATE_BF16 == 39_518_208 and round(STATE_BF16 / 2**20, 1) == 37.7
    a = hs.arithmetic(4096, 4 * GIB, 16, "4GiB")
    hyb, full = a["rows"]
    assert (hyb["model"], full["model"]) == (hs.HYBRID, hs.FULL_ATTN)
    assert (hyb["full_attention_layers"], hyb["linear_attention_layers"]) == (12, 36)
    assert (full["full_attention_layers"], full["linear_attention_layers"]) == (48, 0)
    assert hyb["kv_bytes_per_token"] == KV_PER_TOKEN_HYBRID == 24 * 1024
    assert full["kv_bytes_per_token"] == KV_PER_TOKEN_FULL
    assert hyb["state_bytes_per_request"] == STATE_FP32
    assert hyb["state_bytes_per_request_bf16"] == STATE_BF16
    assert full["state_bytes_per_request"] == full["state_bytes_per_request_bf16"] == 0
    for r, kv, state in ((hyb, KV_PER_TOKEN_HYBRID, STATE_FP32), (full, KV_PER_TOKEN_FULL, 0)):
        assert r["blocks_per_request"] == BLOCKS_4K
        assert r["bytes_per_request"] == 4096 * kv + state
        assert r["max_batch"] == _largest_batch(state, kv)
        assert r["kv_manager_admits_max_batch"] is True
        assert r["kv_manager_admits_one_more"] is False
    assert hyb["max_batch_bf16_state"] == _largest_batch(STATE_BF16, KV_PER_TOKEN_HYBRID)
    assert (hyb["max_batch"], hyb["max_batch_bf16_state"], full["max_batch"]) == (23, 30, 10)
    assert a["ratio"] == 2.3 and a["ratio_bf16_state"] == 3.0


def test_max_batch_is_what_the_plan_admits(hs: ModuleType) -> None:
    """At max_num_seqs B the plan's blocks cover B requests of 4096 tokens, at B + 1 not."""
    shape = model_shape(hs.QWEN3_NEXT_80B)
    b = hs.arithmetic(4096, 4 * GIB, 16)["rows"][0]["max_batch"]
    for n, ok in ((b, True), (b + 1, False)):
        p = make_plan(shape, torch.bfloat16, block_size=16, max_model_len=4096,
                      kv_cache_memory=4 * GIB, max_num_seqs=n)
        assert p.state_memory == (n + 1) * STATE_FP32
        assert (p.num_blocks >= n * p.blocks_per_request(4096)) is ok


def test_helpers(hs: ModuleType) -> None:
    cfg = hs.all_full_attention(hs.QWEN3_NEXT_80B)
    assert cfg["layer_types"] == ["full_attention"] * 48 and "full_attention_interval" not in cfg
    assert hs.QWEN3_NEXT_80B["full_attention_interval"] == 4  # the original is untouched
    assert model_shape(hs.QWEN3_NEXT_80B).linear_attention_layers() == tuple(
        i for i in range(48) if (i + 1) % 4)
    assert hs.largest_batch(0, 100, 10, 1000) == 1 and hs.largest_batch(0, 100, 11, 1000) == 0
    # 3 requests: 4 slots x 50 + 3 x 2 blocks of 100 = 800 <= 1000; 4: 5 x 50 + 800 > 1000
    assert hs.largest_batch(50, 100, 2, 1000) == 3
    assert hs.expected_growth_ratio(hs.SMALL_CONFIG) == 0.25
    assert hs.parse_ints("1, 4,") == [1, 4]
    rows = [{"model": m, "context": c, "batch": 1, "ms_per_step": ms,
             "linear_ms_per_step": lin, "attention_ms_per_step": att}
            for m, c, ms, lin, att in (("hybrid", 1, 5.0, 2.0, 1.0), ("hybrid", 9, 6.0, 2.0, 2.0),
                                       ("full-attention", 1, 4.0, None, 2.0),
                                       ("full-attention", 9, 8.0, None, 6.0))]
    assert hs.growth(rows, [1, 9], [1]) == [{
        "batch": 1, "from_context": 1, "to_context": 9, "hybrid_ms": 1.0,
        "full_attention_ms": 4.0, "ratio": 0.25, "hybrid_linear_ms": 0.0,
        "hybrid_attention_ms": 1.0, "full_attention_attention_ms": 4.0,
        "attention_ratio": 0.25}]


def test_quick_run(hs: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = hs.main(["--quick", "--cache-dir", str(tmp_path / "cache"), "--json",
                  "--json-out", str(out)])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and json.loads(out.read_text()) == res
    assert res["command"].startswith("python bench/hybrid_state.py --quick")
    assert len(res["load_average"]["start"]) == len(res["load_average"]["end"]) == 3
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == [
        "bench-hybrid-full-attn-bfloat16", "bench-hybrid-qwen3-next-bfloat16"]
    assert [r["max_batch"] for r in res["arithmetic"]["rows"]] == [23, 10]
    d = res["decode"]
    assert [(r["model"], r["context"], r["batch"]) for r in d["rows"]] == [
        (m, c, 1) for c in (256, 1024) for m in ("hybrid", "full-attention")]
    for r in d["rows"]:
        assert r["ms_per_step"] > 0 and len(r["runs_ms"]) == 1
        assert r["decode_steps"] == 7  # 8 output tokens: the first comes with the prefill
        assert 0 < r["attention_ms_per_step"] < r["ms_per_step"]
        if r["model"] == "hybrid":
            assert 0 < r["linear_ms_per_step"] < r["ms_per_step"]
        else:
            assert r["linear_ms_per_step"] is None
    assert d["models"]["hybrid"]["attention_layers"] == 2
    assert d["models"]["full-attention"]["attention_layers"] == 8
    (g,) = d["growth"]
    assert (g["from_context"], g["to_context"]) == (256, 1024)
    assert g["hybrid_linear_ms"] is not None and g["full_attention_attention_ms"] is not None
    assert d["expected_growth_ratio"] == 0.25
    hs.print_report(res)
    printed = capsys.readouterr().out
    for text in ("command: python bench/hybrid_state.py --quick", "| model | layers",
                 "| hybrid / full |", "| model | context | batch | ms/decode step |",
                 "hybrid growth ms", "load average"):
        assert text in printed
