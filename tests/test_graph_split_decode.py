"""Decode graphs sized to a real max_model_len take the split-KV decode (flash-decoding) and its
merge inside the model, end to end.

A captured decode graph reads block tables ``ceil(max_model_len / block_size)`` blocks wide
(moe_engine/runner/cuda_graphs.py), and `num_kv_splits` picks the split count from that width,
so on a GPU nearly every replayed decode step runs `merge_kv_splits_kernel`; the other graph
tests use max_model_len 32 (one split). Here the tiny gpt-oss (sliding window 8 and sinks on
alternate layers, full attention between) runs with max_model_len 1024: 64-block tables, 2
splits per replayed step (`num_kv_splits(programs=2-4, 1024 keys)`), through the real graph
machinery with the `EagerReplayCapture` stand-in and the Triton kernels under the interpreter,
one request at a time (batch 1, the graphs' most-split size). Oracle: transformers in float32,
greedy ids and every step's logits (relative error < 1e-4; a merge that dropped the sinks gave
0.44 at the first decode step while the greedy ids stayed equal).
"""

from __future__ import annotations

import pytest
import torch
from fixtures import hf_greedy, hf_last_logits

from moe_engine import SamplingParams
from moe_engine.core.build import build_engine_core
from moe_engine.runner.cuda_graphs import EagerReplayCapture
from moe_engine.startup.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)

PROMPT_LENS = [5, 12]
MAX_TOKENS = 4
MAX_MODEL_LEN = 1024  # the tiny checkpoints' max_position_embeddings
RTOL = 1e-4  # float32 logits against transformers (tests/test_gpt_oss.py's bound)


@pytest.mark.slow
def test_graph_sized_tables_split_decode_matches_transformers(gpt_oss_ckpt, monkeypatch) -> None:
    from kernels.attention import triton_attention

    splits: list[int] = []
    num_kv_splits = triton_attention.num_kv_splits

    def recorded(programs: int, max_keys: int) -> int:
        splits.append(num_kv_splits(programs, max_keys))
        return splits[-1]

    monkeypatch.setattr(triton_attention, "num_kv_splits", recorded)
    config = EngineConfig(
        model=ModelConfig(model=str(gpt_oss_ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(num_blocks_override=2 * MAX_MODEL_LEN // 16 + 8),
        scheduler=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16),
        kernel_backend="triton",
        device=DeviceConfig("cpu"),
    )
    engine = build_engine_core(config, graph_capture=EagerReplayCapture())
    graphs = engine.runner.decode_graphs
    assert graphs is not None and graphs.width == MAX_MODEL_LEN // 16
    logits: list[torch.Tensor] = []
    compute = engine.model.compute_logits
    engine.model.compute_logits = lambda h: logits.append(compute(h)) or logits[-1]
    g = torch.Generator().manual_seed(8)
    splits.clear()  # count the serving steps' launches, not the capture's
    for i, n in enumerate(PROMPT_LENS):  # one request at a time: batch 1, each step one row
        prompt = torch.randint(3, 512, (n,), generator=g).tolist()
        logits.clear()
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        ids: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                ids.extend(out.new_token_ids)
        assert ids == hf_greedy(gpt_oss_ckpt, [prompt], MAX_TOKENS)[0]
        rows = [x for x in logits if x.shape[0]]
        assert len(rows) == MAX_TOKENS
        for j, row in enumerate(rows):  # token j was sampled from the logits at position n+j-1
            want = hf_last_logits(gpt_oss_ckpt, prompt + ids[:j])
            rel = float((row[0] - want).norm() / want.norm())
            assert rel < RTOL, (i, j, rel)
    assert sum(graphs.num_replays.values()) >= len(PROMPT_LENS) * (MAX_TOKENS - 1)
    assert splits and set(splits) == {2}, splits  # every decode launch split, and merged
