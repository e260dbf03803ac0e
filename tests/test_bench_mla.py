"""bench/mla.py at a tiny shape: absorbed and expanded decode agree, and the KV-bytes columns
are the latent's and an expanded cache's arithmetic."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "mla.py"


def test_bench_mla_tiny(capsys):
    spec = importlib.util.spec_from_file_location("bench_mla", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    module.main(["--contexts", "40", "--batches", "1", "3", "--layers", "2", "--hidden", "64",
                 "--heads", "2", "--q-lora-rank", "32", "--kv-lora-rank", "32", "--rope", "8",
                 "--nope", "16", "--v", "16", "--reps", "1", "--json"])
    res = json.loads(capsys.readouterr().out)
    assert res["kv_bytes_per_token"] == {"latent": 2 * 40 * 4, "expanded": 2 * 2 * 40 * 4}
    assert res["deepseek_v3_bf16_kv_bytes_per_token"]["latent"] == 70_272
    assert [(r["context"], r["batch"]) for r in res["rows"]] == [(40, 1), (40, 3)]
    for r in res["rows"]:
        assert r["max_rel_diff"] < 1e-5 and r["absorbed_ms"] > 0 and r["expanded_ms"] > 0
        assert r["latent_kv_bytes"] == 320 * 40 * r["batch"]
