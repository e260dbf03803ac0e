"""The engine against `transformers`: greedy token ids equal, last-position logits close.

Runs through the offline `LLM` API with a small token budget (chunked prefill) and a KV pool
small enough to force preemption; the gRPC path is covered in test_grpc_oracle.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from fixtures import greedy_generate, hf_greedy, hf_last_logits

from kernels.dense.amx import amx_unavailable_reason
from moe_engine import LLM, SamplingParams

PROMPT_LENS = [1, 2, 7, 16, 17, 40, 129, 300]
MAX_NEW = 10


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize(
    "ckpt_name", ["qwen3_ckpt", "qwen3_nonorm_ckpt", "qwen3_sharded_ckpt", "mixtral_ckpt"]
)
def test_greedy_matches_transformers_with_chunking_and_preemption(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    prompts = _prompts(512, seed=len(ckpt_name))
    expected = hf_greedy(ckpt, prompts, MAX_NEW)
    # 32-token budget chunks every prompt over 32 tokens; 22 blocks of 16 tokens cannot hold
    # all 8 requests (about 550 prompt tokens + 80 generated), so some are preempted.
    llm = LLM(model=str(ckpt), max_num_batched_tokens=32, num_blocks_override=22, max_model_len=320)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = llm.engine.get_stats()
    assert stats.num_preemptions > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("ckpt_name", ["qwen3_ckpt", "mixtral_ckpt"])
def test_last_position_logits_within_tolerance(ckpt_name, request):
    ckpt = request.getfixturevalue(ckpt_name)
    llm = LLM(model=str(ckpt), max_num_batched_tokens=48, max_model_len=512, num_blocks_override=64)
    captured: list[torch.Tensor] = []
    compute = llm.engine.model.compute_logits
    llm.engine.model.compute_logits = lambda h: captured.append(compute(h)) or captured[-1]
    for prompt in _prompts(512, seed=3)[3:6]:
        captured.clear()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        ours, ref = captured[0][0], hf_last_logits(ckpt, prompt)
        rel = (ours - ref).norm() / ref.norm()
        assert rel < 1e-4, f"relative error {rel:.2e} for a prompt of {len(prompt)} tokens"


def test_bfloat16_runs_and_mostly_agrees(qwen3_ckpt):
    """bf16 cannot match float32 exactly; the first greedy token should agree for most prompts."""
    prompts = _prompts(512, seed=11)
    expected = hf_greedy(qwen3_ckpt, prompts, 1)
    llm = LLM(model=str(qwen3_ckpt), dtype="bfloat16", max_model_len=512, num_blocks_override=64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0))
    agree = sum(o.outputs[0].token_ids == e for o, e in zip(outs, expected, strict=True))
    assert agree >= len(prompts) - 2


@pytest.mark.parametrize(
    "dropped",
    ["model.layers.0.mlp.experts.3.up_proj.weight", "model.layers.1.self_attn.k_proj.weight"],
)
def test_a_checkpoint_missing_one_tensor_refuses_to_load(qwen3_ckpt, tmp_path, dropped):
    import shutil

    from safetensors.torch import load_file, save_file

    from moe_engine.errors import StartupError

    broken = tmp_path / "broken"
    shutil.copytree(qwen3_ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    # the checkpoint's own name of what is missing (not the engine's merged qkv_proj piece)
    with pytest.raises(StartupError, match=r"lacks 1 weight\(s\), e.g. \['" + re.escape(dropped)):
        LLM(model=str(broken), max_model_len=64)


def test_fused_expert_layout_loads_the_same_model(qwen3_ckpt, tmp_path):
    """transformers 5 can save experts stacked (`experts.gate_up_proj` [E, 2I, H] and
    `experts.down_proj` [E, H, I]); that layout gives the same tokens as the per-expert one."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    fused = tmp_path / "fused"
    shutil.copytree(qwen3_ckpt, fused)
    tensors = load_file(fused / "model.safetensors")
    per_expert = re.compile(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)_proj\.weight")
    groups: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name in list(tensors):
        if m := per_expert.match(name):
            groups.setdefault(m[1], {}).setdefault(m[3], {})[int(m[2])] = tensors.pop(name)
    for prefix, parts in groups.items():
        n = len(parts["gate"])
        gate_up = [torch.cat([parts["gate"][e], parts["up"][e]]) for e in range(n)]
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{prefix}.down_proj"] = torch.stack([parts["down"][e] for e in range(n)])
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    prompts = _prompts(512, seed=5)[:4]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(model=str(qwen3_ckpt), max_model_len=320).generate(prompts, sp)
    got = LLM(model=str(fused), max_model_len=320).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


@pytest.mark.skipif(amx_unavailable_reason() is not None,
                    reason=f"AMX kernels unavailable: {amx_unavailable_reason()}")
def test_bfloat16_on_amx_agrees_with_transformers_as_the_avx2_path_does(qwen3_ckpt, monkeypatch):
    """Where the CPU has AMX-BF16 (or AVX512-BF16) a bfloat16 model's linears and experts run
    the AMX kernels (kernels/dense/amx.py; on tiles, or on VDPBF16PS, each checked here). bfloat16
    is not token-exact with transformers on either path (each rounds at other points:
    transformers after every op, the engine's kernels once per GEMM; transformers' own float32
    and bfloat16 runs differ too), so the check is comparative: with the AMX kernels (which must
    run, prefill and decode) at least as many prompts' 10 greedy tokens equal transformers' in
    bfloat16 as on the AVX2 kernels, and the first token of all but one."""
    from transformers import AutoModelForCausalLM

    from kernels.dense import amx as cpu_amx
    from kernels.moe.amx import AmxExperts

    prompts = _prompts(512, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(str(qwen3_ckpt), dtype=torch.bfloat16).eval()
    expected = greedy_generate(hf, prompts, MAX_NEW)
    calls = {"linear": 0, "moe": 0}
    for cls, key in ((cpu_amx.AmxLinear, "linear"), (AmxExperts, "moe")):
        def counted(self, *args, _call=cls.__call__, _key=key):
            calls[_key] += 1
            return _call(self, *args)
        monkeypatch.setattr(cls, "__call__", counted)

    def agreement(amx: str) -> tuple[int, int]:
        monkeypatch.setenv("MOE_ENGINE_AMX", amx)
        monkeypatch.setattr(cpu_amx, "_decided", [])  # decide again, under this setting
        llm = LLM(model=str(qwen3_ckpt), dtype="bfloat16", max_num_batched_tokens=32,
                  max_model_len=512, num_blocks_override=64)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0,
                                                    ignore_eos=True))
        got = [o.outputs[0].token_ids for o in outs]
        return (sum(g == e for g, e in zip(got, expected, strict=True)),
                sum(g[0] == e[0] for g, e in zip(got, expected, strict=True)))

    avx2, _ = agreement("0")
    assert calls == {"linear": 0, "moe": 0}
    amx, first = agreement("1")
    assert calls["linear"] > 0 and calls["moe"] > 0
    assert amx >= avx2 and first >= len(prompts) - 1, (amx, avx2, first)
    if cpu_amx.uses_tiles() and cpu_amx.dot_available():  # and the AVX512-BF16 backend
        dot, first = agreement(cpu_amx.DOT)
        assert not cpu_amx.uses_tiles()
        assert dot >= avx2 and first >= len(prompts) - 1, (dot, avx2, first)
