"""bench/spec_decode.py at toy size: its pure helpers (K lists, the two workloads' prompts, the
drafter-stats arithmetic, the crossover and the table) and one `--quick` run on the tiny Qwen3-MoE
checkpoint (float32: greedy output with drafts must equal output without)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import ModuleType

import pytest
from bench_loader import load_bench


@pytest.fixture(scope="module")
def sd() -> ModuleType:
    return load_bench("spec_decode")


def test_parse_ks_and_ints(sd: ModuleType) -> None:
    assert sd.parse_ks("off,2,4") == [None, 2, 4]
    assert sd.parse_ks(" 4, off ,4,") == [4, None]
    assert sd.parse_ints("1,8") == [1, 8] and sd.parse_ints("") == []
    with pytest.raises(ValueError):
        sd.parse_ks("off,0")
    assert [sd.row_name(k) for k in (None, 3)] == ["off", "K=3"]


def test_workload_prompts(sd: ModuleType) -> None:
    p = sd.spans_prompt(random.Random(1), 100, 50)
    assert len(p) == 100 and all(3 <= t < 50 for t in p)
    period = next(n for n in range(sd.SPAN_LEN[0], sd.SPAN_LEN[1] + 1)
                  if p[n:] == p[:-n])  # one span repeated
    assert period <= sd.SPAN_LEN[1]
    assert sd.echo_prefix_len(512, 128) == 192 and sd.echo_prefix_len(10, 128) == 1
    assert sd.echo_prompt([5, 6], [7]) == [5, 6, 7, 5, 6]
    assert sd.common_prefix([1, 2, 3], [1, 2, 4]) == 2 and sd.common_prefix([1], [1]) == 1
    assert sd.mismatches([[1], [2], [3]], [[1], [9], [3]]) == [1]


def test_stats_arithmetic(sd: ModuleType) -> None:
    zero = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
            "accepted_per_pos": [0, 0]}
    a = {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6,
         "accepted_per_pos": [4, 2]}
    d = sd.stats_delta(zero, a)
    assert d["mean_acceptance_length"] == 2.5 and d["drafts_per_step"] == 2.0
    assert d["acceptance_rate"] == 0.75 and d["accepted_per_pos_rate"] == [1.0, 0.5]
    assert sd.stats_delta(a, a)["mean_acceptance_length"] == 0.0
    m = sd.merge_stats([d, sd.stats_delta(zero, zero)])
    assert m["num_drafts"] == 4 and m["accepted_per_pos"] == [4, 2]
    rows = [{"workload": "w", "batch": b, "k": k, "ratio_vs_off": r}
            for b, k, r in [(1, "off", 1.0), (1, "K=2", 0.9), (8, "K=2", 1.2),
                            (16, "K=2", 0.9), (32, "K=2", 0.8), (8, "K=4", 1.1)]]
    # batch 1 loses, 8 pays, then 16 and up lose: it stops paying from 16
    assert sd.crossover(rows) == {"w K=2": 16, "w K=4": None}


def test_quick_run_on_tiny_checkpoint(sd: ModuleType, qwen3_ckpt: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = sd.main(["--quick", "--model", str(qwen3_ckpt), "--json", "--json-out", str(out)])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and res["greedy_mismatches"] == 0
    assert json.loads(out.read_text())["rows"] == res["rows"]
    assert res["command"].startswith("python bench/spec_decode.py --quick")
    keys = [(e["workload"], e["batch"], e["k"]) for e in res["rows"]]
    assert keys == [(w, b, k) for w in ("spans", "echo") for b in (1, 2, 4)
                    for k in ("off", "K=2")]
    for e in res["rows"]:
        assert e["decode_tok_s"] > 0 and e["e2e_tok_s"] > 0 and e["decode_tokens"] > 0
        assert e["decode_steps"] >= 1 and e["ms_per_step"] > 0
        if e["k"] == "off":
            assert e["ratio_vs_off"] == 1.0 and e["greedy_mismatches"] is None
        else:
            assert e["greedy_mismatches"] == 0 and len(e["spec"]["accepted_per_pos"]) == 2
    assert any("echo_agreement" in e for e in res["rows"])
    sd.print_report(res)  # the human-readable form of the same result
    printed = capsys.readouterr().out
    assert "| workload | batch | K | decode tok/s |" in printed and "command: " in printed
