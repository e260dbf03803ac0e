"""bench/plan_configs.py: the startup plan's figures for the published configs; a config the
engine cannot read is listed as not resolved, with the reason."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench" / "plan_configs.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_plan_configs", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_deepseek_v3_kimi_k2_and_glm45_figures(capsys, tmp_path):
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    configs = [str(_bench().CONFIGS / n) for n in ("deepseek-v3.json", "kimi-k2-instruct.json")]
    _bench().main(["--json", "--configs", *configs, str(unknown)])
    res = json.loads(capsys.readouterr().out)
    v3, kimi, bad = res["configs"]
    assert v3["kv_bytes_per_token"] == kimi["kv_bytes_per_token"] == 61 * 576 * 2
    assert "(MLA latent 576 x 61 layers)" in v3["kv_line"]
    assert v3["weight_bytes_experts"] == 58 * 256 * 3 * 7168 * 2048 * 2  # 3 dense layers
    assert kimi["weight_bytes_experts"] == 60 * 384 * 3 * 7168 * 2048 * 2  # 1 dense layer
    assert bad["config"] == "unknown.json" and "not supported" in bad["unresolved"]
    _bench().main(["--json", "--configs", str(_bench().CONFIGS / "glm-4.5.json")])
    (glm,) = json.loads(capsys.readouterr().out)["configs"]
    assert glm["kv_bytes_per_token"] == 92 * 2 * 8 * 128 * 2  # GQA: K and V
    _bench().main(["--configs", str(unknown)])
    assert "not resolved: unknown.json" in capsys.readouterr().out
