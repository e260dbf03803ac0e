"""Host memory on a CPU (`moe_engine.startup.host_memory`, issue 41): the startup plan counts
what the engine will hold (weights as held, activations of one step, KV cache), sizes the KV
cache from --cpu-memory-utilization, refuses before loading what does not fit, and the
measured peak resident set of a served gpt-oss-20b-shaped checkpoint stays within 10% of the
plan's total."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from fixtures import make_mxfp4_experts_checkpoint, tiny_config

from kernels.native.library import native_unavailable_reason
from moe_engine.errors import StartupError
from moe_engine.models import model_shape
from moe_engine.startup.host_memory import HostMemory, HostSizing, activation_peak_bytes
from moe_engine.startup.plan import make_plan

MiB, GiB = 1 << 20, 1 << 30
REPO = Path(__file__).resolve().parents[1]
BENCH_CFG = json.loads((REPO / "tests" / "data" / "configs" / "qwen3-30b-a3b.json").read_text())


def _plan(host: HostMemory, **kw):
    args = dict(block_size=16, max_model_len=4096, kv_cache_memory=None, max_num_seqs=64,
                max_num_batched_tokens=2048, host=host) | kw
    return make_plan(model_shape(BENCH_CFG), torch.bfloat16, **args)


def test_activation_peak_by_hand() -> None:
    """Qwen3-30B-A3B: H 2048, 32 q / 4 kv heads of 128, top-8 of 128 experts of 768, vocab
    151936. Attention: 2 x (32 + 8) x 128 + 32 x 128 + 2048 = 16,384 floats per token; MoE:
    8 x 3 x 768 + 2 x 2048 = 22,528: the larger plus the residual stream's 3 x 2048 = 28,672
    floats per token, and 3 x 64 x 151936 logits floats."""
    shape = model_shape(BENCH_CFG)
    want = 4 * (2048 * 28_672 + 3 * 64 * 151_936)
    assert activation_peak_bytes(shape, 2048, 64, 128) == want
    # fewer local experts than top_k (expert parallelism over many ranks) bound the pairs
    assert activation_peak_bytes(shape, 2048, 64, 2) < want


def test_kv_budget_is_the_fraction_after_everything_else() -> None:
    host = HostMemory(total=128 * GiB, available=124 * GiB)
    plan = _plan(host, max_num_seqs=1024)
    sizing = plan.host
    assert sizing is not None and sizing.share == int(0.8 * 128 * GiB) - 4 * GiB
    assert sizing.weights == plan.held_bytes
    assert plan.kv_cache_memory <= sizing.kv_budget < plan.kv_cache_memory + plan.kv_bytes_per_block
    assert plan.kv_cache_source == "cpu_memory_utilization 0.8"
    assert "host memory: 128.00 GiB total x cpu_memory_utilization 0.8" in plan.describe()
    # a higher fraction buys more blocks; two ranks on the host split it
    assert _plan(host, cpu_memory_utilization=0.9, max_num_seqs=1024).num_blocks > plan.num_blocks
    two = _plan(host, ranks_on_host=2, ep_size=2, expert_bits_per_weight=4.25)
    assert two.host.share == sizing.share // 2
    # capped at what max_num_seqs requests can hold
    small = _plan(host, max_num_seqs=1, max_model_len=1024)
    assert small.kv_cache_source == "max_num_seqs x max_model_len"


def test_what_does_not_fit_is_refused_before_loading_with_the_fix() -> None:
    """bf16 Qwen3-30B-A3B (57 GiB of weights) on a 24 GiB machine: refused, naming the bytes
    and the flags; 4-bit experts fit; an explicit --kv-cache-memory beyond what is left is
    refused too, naming the most that fits."""
    host = HostMemory(total=24 * GiB, available=23 * GiB)
    with pytest.raises(StartupError) as err:
        _plan(host)
    text = str(err.value)
    assert "does not fit in host memory" in text and "weights held" in text
    assert "--quantization int4" in text and "cpu_memory_utilization 0.8" in text
    four_bit = _plan(HostMemory(total=32 * GiB, available=31 * GiB),
                     expert_bits_per_weight=4.25)
    assert four_bit.num_blocks > 0
    left = four_bit.host.kv_budget
    with pytest.raises(StartupError, match=f"--kv-cache-memory {left} or less"):
        _plan(HostMemory(total=32 * GiB, available=31 * GiB), expert_bits_per_weight=4.25,
              kv_cache_memory=left + GiB)
    ok = _plan(HostMemory(total=32 * GiB, available=31 * GiB), expert_bits_per_weight=4.25,
               kv_cache_memory=left // 2)
    assert ok.kv_cache_source == "--kv-cache-memory"


def test_a_fraction_that_would_fit_is_suggested() -> None:
    sizing = HostSizing(HostMemory(total=100 * GiB, available=100 * GiB), 0.5, 1,
                        weights=60 * GiB, activations=GiB, num_tokens=2048)
    assert sizing.kv_budget < 0
    from moe_engine.startup.plan import check_host_fits

    with pytest.raises(StartupError, match="--cpu-memory-utilization 0.62"):
        check_host_fits(sizing, GiB, "one request")


PROBE = textwrap.dedent("""
    import json, sys
    from moe_engine import LLM, SamplingParams

    def hwm():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM"):
                return int(line.split()[1]) * 1024

    llm = LLM(model=sys.argv[1], max_model_len=4096, max_num_seqs=16,
              max_num_batched_tokens=1024)
    loading = hwm()
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here: serving
        f.write("5")
    prompt = [(i * 7919) % 8000 + 5 for i in range(1024)]
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    plan = llm.engine.plan
    print(json.dumps({"planned": plan.planned_peak_bytes, "peak": hwm(), "loading": loading,
                      "kv": plan.kv_cache_memory, "weights": plan.held_bytes,
                      "activations": plan.host.activations}))
""")


@pytest.fixture(scope="module")
def gpt_oss_20b_cut(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """gpt-oss-20b's layer shapes (H 2880, 64 q / 8 kv heads of 64, experts of 2880, MXFP4,
    a sliding and a full layer, biases and sinks) cut to 2 layers, 4 experts, a 8192-token
    vocabulary: 0.25 GiB of weights."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("gpt_oss_20b_cut")
    config = tiny_config(
        "gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, num_local_experts=4, num_hidden_layers=2,
        vocab_size=8192, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(root / "gpt-oss-20b-cut")
    return make_mxfp4_experts_checkpoint(root / "gpt-oss-20b-cut", root)


@pytest.mark.skipif(native_unavailable_reason() is not None,
                    reason="the native CPU library does not build here")
def test_measured_peak_is_within_ten_percent_of_the_plan(gpt_oss_20b_cut: Path) -> None:
    """A fresh process serves a 1024-token prompt (the largest step): its peak resident set
    while serving (VmHWM: weights, packed copies, KV cache, activations, the interpreter) is
    within 10% of the plan's total, and loading never went above that total by more than
    10% plus the largest tensor."""
    out = subprocess.run([sys.executable, "-c", PROBE, str(gpt_oss_20b_cut)],
                         capture_output=True, text=True, timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["kv"] >= 64 * MiB and got["activations"] >= 100 * MiB
    assert abs(got["peak"] - got["planned"]) <= 0.1 * got["planned"], got
    largest = 8192 * 2880 * 2  # the embedding / LM head, bfloat16
    assert got["loading"] <= 1.1 * got["planned"] + largest, got


def _agree(rank: int, world_size: int) -> tuple[int, str]:
    from moe_engine.core.build import agree_on_blocks
    from moe_engine.startup.rank_context import RankContext

    host = HostMemory(total=128 * GiB, available=(124 - 8 * rank) * GiB)  # rank 1 sees less
    plan = _plan(host, max_num_seqs=1024, expert_bits_per_weight=4.25, ep_size=2)
    agreed = agree_on_blocks(plan, RankContext(rank, world_size, [], None))
    return agreed.num_blocks, agreed.kv_cache_source


def test_expert_parallel_ranks_agree_on_the_fewest_blocks() -> None:
    """Each rank sizes its pool from the memory it sees; the lockstep schedulers need one
    number of blocks: every rank takes the smallest."""
    from dist_utils import run_ranks

    (b0, s0), (b1, s1) = run_ranks(_agree, 2)
    alone = _plan(HostMemory(total=128 * GiB, available=116 * GiB), max_num_seqs=1024,
                  expert_bits_per_weight=4.25, ep_size=2)
    assert b0 == b1 == alone.num_blocks
    assert s0.endswith("the fewest of the 2 ranks") and s1 == "cpu_memory_utilization 0.8"


def test_the_models_length_shrinks_to_what_fits_without_max_model_len() -> None:
    """Without --max-model-len a model whose own context does not fit (gpt-oss-20b's 131072
    tokens on a 24 GiB machine) is served at the longest length that does, said in the plan;
    an explicit --max-model-len that does not fit is still refused."""
    shape = model_shape(BENCH_CFG)
    own = shape.max_position_embeddings  # 40960 tokens: 3.75 GiB of KV for one request
    args = dict(block_size=16, kv_cache_memory=None, max_num_seqs=64,
                max_num_batched_tokens=2048, expert_bits_per_weight=4.25)
    roomy = make_plan(shape, torch.bfloat16, max_model_len=own,
                      host=HostMemory(total=96 * GiB, available=96 * GiB), **args)
    # a machine that leaves exactly 2 GiB for the KV cache at F = 1
    total = roomy.host.weights + roomy.host.activations + 2 * GiB
    host = HostMemory(total=total, available=total)
    args |= dict(host=host, cpu_memory_utilization=1.0)
    with pytest.raises(StartupError, match=f"one request of max_model_len {own}"):
        make_plan(shape, torch.bfloat16, max_model_len=own, **args)
    plan = make_plan(shape, torch.bfloat16, max_model_len=own, shrink_to_fit=True, **args)
    assert 2048 <= plan.max_model_len < own and plan.max_model_len % 256 == 0
    assert plan.blocks_per_request() <= plan.num_blocks
    assert plan.blocks_per_request(plan.max_model_len + 256) > plan.num_blocks
    assert plan.max_model_len_note.startswith(f"max_model_len {plan.max_model_len}: the model's")
    assert plan.max_model_len_note in plan.describe()
    plan.check()
    fits = make_plan(shape, torch.bfloat16, max_model_len=4096, shrink_to_fit=True, **args)
    assert fits.max_model_len == 4096 and not fits.max_model_len_note


def test_a_containers_memory_limit_bounds_the_host(tmp_path: Path) -> None:
    """Under `docker --memory 4g` the plan sizes against 4 GiB, not the machine's memory:
    cgroup v2 (memory.max / memory.current) and v1 (memory/memory.limit_in_bytes)."""
    from moe_engine.startup.host_memory import cgroup_limit, read_host_memory

    assert cgroup_limit(tmp_path) is None  # no controller
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("123\n")
    assert cgroup_limit(tmp_path) is None  # no limit
    (tmp_path / "memory.max").write_text(f"{4 * GiB}\n")
    (tmp_path / "memory.current").write_text(f"{GiB}\n")
    assert cgroup_limit(tmp_path) == (4 * GiB, GiB)
    host = read_host_memory(tmp_path)
    assert host.total == 4 * GiB and host.available <= 3 * GiB
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GiB // 2}\n")
    assert cgroup_limit(v1) == (2 * GiB, GiB // 2)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{(1 << 63) - 4096}\n")
    assert cgroup_limit(v1) is None  # v1's "unlimited"
