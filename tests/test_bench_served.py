"""bench/served_engine.py: the served rows of bench/throughput.py (moe-serve in a subprocess,
driven over gRPC) give the offline engine's greedy tokens, in both modes, final-only and
streamed; the served-to-offline ratios and the row selection."""

from __future__ import annotations

import argparse
from pathlib import Path
from types import ModuleType

import pytest
from bench_loader import load_bench

from moe_engine.offline.llm import LLM
from moe_engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tp() -> ModuleType:
    return load_bench("throughput")  # puts bench/ on sys.path for served_engine


def test_served_rows_match_offline_greedy(tp: ModuleType, qwen3_ckpt: Path) -> None:
    import served_engine
    import workload

    requests = [workload.BenchRequest([3 + i, 40, 7 * i + 1] * (i + 1), 5 + 3 * i)
                for i in range(9)]
    args = argparse.Namespace(dtype="float32", max_model_len=128, max_num_seqs=8,
                              max_num_batched_tokens=64, kv_cache_memory=64 << 20,
                              kernel_backend="auto")
    llm = LLM(str(qwen3_ckpt), dtype="float32", max_model_len=128)
    params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    outs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in outs]
    for name in served_engine.SERVED_ROWS:
        row = served_engine.ServedRow(name, qwen3_ckpt, requests, args)
        try:
            assert row.cpu_seconds() is not None and row.cpu_seconds() > 0
            batched = row.run("batched", return_token_ids=True)
            assert batched.token_ids == expected and batched.seconds > 0
            assert batched.output_tokens == sum(r.output_len for r in requests)
            single = row.run("batch1", return_token_ids=True)
            assert single.token_ids == expected[:8]
        finally:
            row.close()
        assert row.proc.poll() is not None


def test_served_ratios_and_selection(tp: ModuleType) -> None:
    engines = {
        "moe-engine": {"batched": {"output_tokens_per_s": 1000.0}},
        "moe-engine-grpc": {"batched": {"output_tokens_per_s": 950.0}},
        "moe-engine-grpc-stream": {"batched": {"output_tokens_per_s": None, "error": "x"}},
    }
    tp.add_served_ratios(engines, ["batched"])
    assert engines["moe-engine-grpc"]["batched"]["ratio_vs_offline"] == 0.95
    assert "ratio_vs_offline" not in engines["moe-engine-grpc-stream"]["batched"]
    args = tp.parse_args(["--engines", "moe-engine,moe-engine-grpc"])
    assert args.served and args.quantization == "none"
    assert tp.row_selected("moe-engine-grpc", args)
    assert tp.row_selected("moe-engine-grpc-stream", args)  # a row selects its variants
    args = tp.parse_args(["--engines", "moe-engine-grpc-stream"])
    assert args.served and not tp.row_selected("moe-engine-grpc", args)
    assert tp.parse_args(["--table"]).served and not tp.parse_args([]).served
