"""Routing skew end to end: a fixture whose router favours four experts, all on rank 0, served
with --ep-size 2 and --expert-trace; `moe-skew report` names those experts as hottest, `plot`
draws the PNG, `plan` replicates them; serving again with the planned placement gives the same
greedy tokens and a lower measured rank imbalance, close to the predicted one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures import hf_greedy, make_tiny_checkpoint
from safetensors.torch import load_file, save_file

from moe_engine.cli.skew import main as skew_main
from moe_engine.engine.client import EngineClient
from moe_engine.sampling_params import SamplingParams
from moe_engine.skew.trace import read_trace
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

HOT = [0, 1, 2, 3]  # contiguous ep 2 puts them all on rank 0
PROMPTS = [[5 + i, 40 + 3 * i, 100 + i, 7, 300 - i, 9 + i] * 3 for i in range(6)]
MAX_NEW = 6


def _biased_checkpoint(root: Path) -> Path:
    """The tiny Qwen3-MoE with each MoE router given two opposite rows per pair of hot experts:
    for every token one of experts 0/1 and one of 2/3 has a large positive logit, so top-2
    routing sends every token to one of each pair."""
    src = make_tiny_checkpoint("qwen3_moe", root, seed=5)
    dst = root / "qwen3-biased-router"
    if (dst / "config.json").is_file():
        return dst
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    for name, w in tensors.items():
        if name.endswith("mlp.gate.weight"):
            a, b = torch.randn(2, w.shape[1], generator=g)
            w = w.clone()
            w[0], w[1], w[2], w[3] = 40 * a, -40 * a, 40 * b, -40 * b
            tensors[name] = w
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


async def _serve(ckpt: Path, trace: Path, placement: Path | None) -> list[list[int]]:
    config = EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=128),
        cache=CacheConfig(num_blocks_override=32),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        parallel=ParallelConfig(
            ep_size=2,
            collective_timeout_s=30,
            expert_placement=str(placement) if placement else None,
        ),
        expert_trace=str(trace),
    )
    client = EngineClient()
    await client.start(config, startup_timeout_s=300)
    try:
        import asyncio

        async def one(i: int) -> list[int]:
            params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
            ids: list[int] = []
            async for out in client.generate(f"r{i}", PROMPTS[i], params):
                ids.extend(out.new_token_ids)
            return ids

        return list(await asyncio.gather(*(one(i) for i in range(len(PROMPTS)))))
    finally:
        await client.shutdown()


def _rank_imbalance(trace_path: Path) -> np.ndarray:
    """Measured max/mean of the ranks' expert load per MoE layer."""
    load = read_trace(trace_path).rank_tokens.sum(axis=0).astype(np.float64)  # [L, R]
    return load.max(axis=1) / load.mean(axis=1)


@pytest.mark.slow
def test_trace_report_plan_and_replan(tiny_ckpt_root: Path, tmp_path: Path, capsys) -> None:
    import asyncio

    ckpt = _biased_checkpoint(tiny_ckpt_root)
    expected = [hf_greedy(ckpt, [p], MAX_NEW)[0] for p in PROMPTS]
    trace1 = tmp_path / "before.npz"
    got = asyncio.run(_serve(ckpt, trace1, None))
    assert got == expected

    trace = read_trace(trace1)
    assert trace.counts.sum() == 2 * trace.num_tokens.sum() * 2  # 2 MoE layers x top-2
    assert skew_main(["report", str(trace1), "--top", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for layer in report["layers"]:
        hottest = sorted(e["expert"] for e in layer["hottest"])
        assert hottest == HOT, layer
    png = tmp_path / "load.png"
    assert skew_main(["plot", str(trace1), "-o", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    placement = tmp_path / "placement.json"
    assert (
        skew_main(
            [
                "plan", str(trace1), "--ep-size", "2", "--num-redundant-experts", "2",
                "-o", str(placement), "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    layers = plan["replay"]["layers"]
    predicted = np.array([r["imbalance_after"] for r in layers])
    measured_before = _rank_imbalance(trace1)
    # before: the contiguous placement, no replicas: measurement and replay agree exactly
    assert np.allclose(measured_before, [r["imbalance_before"] for r in layers], atol=1e-9)

    trace2 = tmp_path / "after.npz"
    assert asyncio.run(_serve(ckpt, trace2, placement)) == expected
    measured_after = _rank_imbalance(trace2)
    assert (measured_after < measured_before).all(), (measured_before, measured_after)
    # replicas split their expert's pairs within +-1 per source rank and step
    assert np.allclose(measured_after, predicted, atol=0.05), (measured_after, predicted)
