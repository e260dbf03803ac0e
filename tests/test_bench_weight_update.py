"""bench/weight_update.py at toy size: the perturbed copy, the phase wrappers, the 1T
arithmetic, and one `--quick` run on the tiny Qwen3-MoE checkpoint (every row: from disk in
bf16 and int4, and from a spawned trainer process over gloo in buckets of 64 KiB), whose
updated engines must give the greedy output of a fresh start on the perturbed copy."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest
from bench_loader import load_bench


@pytest.fixture(scope="module")
def wu() -> ModuleType:
    return load_bench("weight_update")


def test_perturbed_copy(wu: ModuleType, qwen3_ckpt: Path, tmp_path: Path) -> None:
    out = wu.ensure_perturbed(qwen3_ckpt, tmp_path)
    assert out == tmp_path / f"{qwen3_ckpt.name}-perturbed-s1"
    assert (out / "config.json").read_text() == (qwen3_ckpt / "config.json").read_text()
    old, new = wu.checkpoint_tensors(qwen3_ckpt), wu.checkpoint_tensors(out)
    assert list(old) == list(new) == sorted(old)
    for name, t in old.items():
        assert new[name].dtype == t.dtype and new[name].shape == t.shape
        diff = (new[name] - t).abs()
        assert 0 < diff.max() < 0.1 and 0.004 < diff.float().mean() < 0.012, name
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert wu.ensure_perturbed(qwen3_ckpt, tmp_path) == out  # reused
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    facts = wu.checkpoint_facts(out)
    assert facts["tensors"] == len(old)
    assert facts["params"] == sum(t.numel() for t in old.values())
    assert facts["bytes"] == 4 * facts["params"]  # float32


def test_phase_wrappers_are_restored(wu: ModuleType) -> None:
    from moe_engine.weight_update import staging
    from moe_engine.weight_update.control import RolloutControl
    from moe_engine.weight_update.disk import DiskUpdate

    originals = (DiskUpdate.tensors, RolloutControl._receive, staging.StagedWeights.add,
                 staging.StagedWeights.commit, staging.rebind)
    phases = wu.UpdatePhases().install()
    assert staging.rebind is not originals[-1]
    phases.uninstall()
    assert (DiskUpdate.tensors, RolloutControl._receive, staging.StagedWeights.add,
            staging.StagedWeights.commit, staging.rebind) == originals


def test_arithmetic(wu: ModuleType) -> None:
    a = wu.arithmetic([{"row": "r", "gb_s": 0.5}, {"row": "d", "gb_s": 2.0,
                                                  "trainer": {"gb_s": 4.0}}])
    assert a["bytes"] == 2 * 10**12
    assert [(m["rate"], m["seconds"]) for m in a["measured"]] == [
        ("r (engine)", 4000.0), ("d (engine)", 1000.0), ("d (trainer send)", 500.0)]
    assert [(x["gbit_s"], x["seconds"]) for x in a["links"]] == [
        (25, 640.0), (100, 160.0), (400, 40.0)]


def test_quick_run_on_tiny_checkpoint(wu: ModuleType, qwen3_ckpt: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "r.json"
    rc = wu.main(["--quick", "--model", str(qwen3_ckpt), "--cache-dir", str(tmp_path / "cache"),
                  "--bucket-mib", "0.0625", "--json", "--json-out", str(out)])
    res = json.loads(capsys.readouterr().out)
    assert rc == 0 and json.loads(out.read_text()) == res
    assert res["command"].startswith("python bench/weight_update.py --quick")
    assert res["equal"] is True and res["page_cache"] == "warm"
    assert len(res["load_average"]["start"]) == len(res["load_average"]["end"]) == 3
    assert [r["row"] for r in res["rows"]] == ["disk-bf16", "disk-int4", "distributed-bf16"]
    n = len(wu.checkpoint_tensors(qwen3_ckpt))
    for r in res["rows"]:
        assert r["equal"] is True and r["changed"] is True, r["row"]
        assert r["gb_s"] > 0 and r["seconds"] > 0 and len(r["runs_s"]) == 1
        assert r["num_tensors"] == n and r["num_bytes"] == res["checkpoint"]["bytes"]
        assert r["phases"]["stage"] > 0 and r["phases"]["commit"] > 0
        assert r["phases"]["rebind"] > 0
        assert r["phases"]["read" if r["source"] == "disk" else "receive"] > 0
    assert res["rows"][1]["phases"]["requantize"] > 0
    assert res["rows"][0]["phases"]["requantize"] == 0
    t = res["rows"][2]["trainer"]
    assert t["gb_s"] > 0 and t["bytes"] == res["checkpoint"]["bytes"] and t["buckets"] > 3
    assert res["group"]["form_s"] > 0 and res["group"]["buckets"] == t["buckets"]
    assert [x["gbit_s"] for x in res["arithmetic"]["links"]] == [25, 100, 400]
    assert len(res["arithmetic"]["measured"]) == 4
    wu.print_report(res)
    printed = capsys.readouterr().out
    for text in ("command: python bench/weight_update.py --quick", "| row | experts | seconds",
                 "outputs equal a fresh start: yes", "page cache warm", "stated link 400 Gb/s",
                 "not divided by the number of ranks"):
        assert text in printed
