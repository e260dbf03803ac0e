"""The transfer arithmetic of a prefill/decode split (moe_engine/disagg/arithmetic) and
`moe-disagg plan`: bytes per prompt by hand for full attention, MLA and sliding windows, link
times, the CLI on published configs and its refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moe_engine.cli import disagg
from moe_engine.disagg.arithmetic import link_seconds, transfer_bytes, transfer_table
from moe_engine.kv_cache.spec import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

CONFIGS = Path(__file__).resolve().parent / "data" / "configs"


def test_bytes_per_prompt_by_hand() -> None:
    full = FullAttentionSpec(16, 4, 128, torch.bfloat16, 48)  # Qwen3-30B-A3B's cache
    assert transfer_bytes([full], 1) == 16 * 48 * 2 * 4 * 128 * 2  # one whole block
    assert transfer_bytes([full], 1024) == 1024 * 98304
    mla = MLAAttentionSpec.make(block_size=16, kv_lora_rank=512, qk_rope_head_dim=64,
                                dtype=torch.bfloat16, num_layers=61)
    assert transfer_bytes([mla], 32) == 32 * 61 * 576 * 2
    window = SlidingWindowSpec(16, 8, 64, torch.bfloat16, 12, window=128)
    # 4096 tokens: only the blocks the last query still reads stay (<= window / 16 + 1)
    kept = transfer_bytes([window], 4096) // window.bytes_per_block
    assert 128 // 16 <= kept <= 128 // 16 + 1
    assert transfer_bytes([full, window], 64) == 4 * (full.bytes_per_block
                                                      + window.bytes_per_block)


def test_link_seconds_and_table() -> None:
    assert link_seconds(100 * 10**9 // 8, 100.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="link rate must be > 0 Gb/s, got 0"):
        link_seconds(1, 0)
    full = FullAttentionSpec(16, 2, 64, torch.bfloat16, 8)
    (row,) = transfer_table([full], [160], [25.0], {160: 0.02})
    assert row.num_bytes == 160 * 4096 and row.prefill_s == 0.02
    assert row.link_s[25.0] == pytest.approx(160 * 4096 * 8 / 25e9)


def test_cli_plan_published_configs(capsys) -> None:
    assert disagg.main(["plan", "--model", str(CONFIGS / "deepseek-v3.json"), "--json",
                        "--prompt-lens", "1024", "--link-gbps", "100"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architecture"] == "DeepseekV3ForCausalLM"
    assert out["kv_bytes_per_token"] == 61 * 576 * 2
    (row,) = out["rows"]
    assert row["bytes"] == 1024 * 61 * 576 * 2
    assert row["link_s"]["100"] == pytest.approx(row["bytes"] * 8 / 100e9)
    assert disagg.main(["plan", "--model", str(CONFIGS / "qwen3-30b-a3b.json")]) == 0
    text = capsys.readouterr().out
    assert "98304 bytes per prompt token" in text and "| 1024 | 96.00 MiB |" in text


def test_cli_plan_measures_prefill(qwen3_ckpt: Path, capsys) -> None:
    assert disagg.main(["plan", "--model", str(qwen3_ckpt), "--prompt-lens", "8,40",
                        "--measure-prefill", "--dtype", "float32", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["prompt_len"] for r in rows] == [8, 40]
    assert all(r["prefill_s"] > 0 for r in rows)


def test_cli_plan_refusals(tmp_path: Path, capsys) -> None:
    for flag, value, why in (("--link-gbps", "0", "every value must be a finite number > 0"),
                             ("--link-gbps", "nan", "every value must be a finite number > 0"),
                             ("--link-gbps", "25,,100", "expected comma-separated numbers"),
                             ("--prompt-lens", "a,b", "expected comma-separated numbers"),
                             ("--block-size", "0", "must be a power of two >= 1"),
                             ("--block-size", "-1", "must be a power of two >= 1")):
        with pytest.raises(SystemExit):
            disagg.main(["plan", "--model", "x", flag, value])
        assert f"argument {flag}: {why}" in capsys.readouterr().err
    assert disagg.main(["plan", "--model", str(tmp_path)]) == 2
    assert f"--model {tmp_path}" in capsys.readouterr().err
    config = str(CONFIGS / "deepseek-v3.json")
    assert disagg.main(["plan", "--model", config, "--measure-prefill"]) == 2
    assert "--measure-prefill needs a checkpoint folder" in capsys.readouterr().err


def test_cli_plan_prompts_beyond_the_context(qwen3_ckpt: Path, capsys) -> None:
    assert disagg.main(["plan", "--model", str(qwen3_ckpt), "--prompt-lens", "8,5000",
                        "--measure-prefill", "--dtype", "float32", "--json"]) == 0
    captured = capsys.readouterr()
    assert [r["prompt_len"] for r in json.loads(captured.out)["rows"]] == [8]
    assert "reach the model's max_position_embeddings" in captured.err
