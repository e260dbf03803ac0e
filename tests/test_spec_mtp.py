"""MTP drafts (`--speculative-method mtp`) on a tiny DeepSeek-V3 checkpoint with a random MTP
layer (written as the released checkpoints ship it: `model.layers.{num_hidden_layers}.*`,
which transformers drops on load).

- Every step's drafts equal a plain-transformers reference of the MTP module (the MTP layer as a
  one-layer DeepseekV3 model over eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]), chained on its own
  outputs), after steps that accepted drafts and steps that rejected them: the MTP layer's KV
  catch-up and chain are right.
- Greedy output equals transformers' for K = 1..3, with chunked prefill, prefix caching and
  preemption; KV blocks come back.
- Startup refuses MTP where it cannot run, naming why.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import hf_greedy, tiny_config
from safetensors.torch import load_file, save_file

from moe_engine.core.build import build_engine_core
from moe_engine.core.engine_core import EngineCore
from moe_engine.errors import StartupError
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)
from moe_engine.startup.spec_config import SpeculativeConfig

MAX_TOKENS = 16
NUM_LAYERS = 3  # the tiny DeepSeek-V3's (tests/fixtures.py)


def _mtp_tensors(kind: str = "deepseek_v3", seed: int = 7) -> dict[str, torch.Tensor]:
    """A random MTP layer under its checkpoint names (`model.layers.3.*`): the decoder block of
    a 4-layer model of the same config (layer 3 is an MoE layer), enorm / hnorm /
    shared_head.norm drawn around 1, eh_proj [H, 2H]."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    big = AutoModelForCausalLM.from_config(tiny_config(kind, num_hidden_layers=4))
    prefix = f"model.layers.{NUM_LAYERS}."
    out = {k: v.detach().clone() for k, v in big.state_dict().items() if k.startswith(prefix)}
    for name in out:
        if name.endswith("e_score_correction_bias"):
            out[name] = torch.randn_like(out[name]) * 0.5
    hidden = big.config.hidden_size
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        out[f"{prefix}{norm}.weight"] = 1 + 0.1 * torch.randn(hidden)
    out[f"{prefix}eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.2
    return out


@pytest.fixture(scope="module")
def mtp_ckpt(deepseek_v3_ckpt: Path, tmp_path_factory) -> Path:
    """The tiny DeepSeek-V3 plus an MTP layer and its copies of the embedding and LM head
    (as DeepSeek ships them), config.json num_nextn_predict_layers 1."""
    return _with_mtp_layer(deepseek_v3_ckpt, "deepseek_v3", tmp_path_factory.mktemp("mtp"))


def _with_mtp_layer(ckpt: Path, kind: str, root: Path) -> Path:
    path = root / f"{kind}-mtp"
    shutil.copytree(ckpt, path)
    weights = load_file(path / "model.safetensors")
    extra = _mtp_tensors(kind)
    prefix = f"model.layers.{NUM_LAYERS}."
    extra[f"{prefix}embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    extra[f"{prefix}shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({**weights, **extra}, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return path


class ReferenceMTP:
    """The MTP module in plain transformers: the main model's final hidden states, then the
    MTP layer as a one-layer DeepseekV3 model (its final norm = shared_head.norm) fed
    eh_proj([enorm(Emb(next)); hnorm(h)]) as inputs_embeds."""

    def __init__(self, ckpt: Path) -> None:
        from transformers import AutoModelForCausalLM

        self.main = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        one = tiny_config("deepseek_v3", num_hidden_layers=1, first_k_dense_replace=0)
        self.mtp = AutoModelForCausalLM.from_config(one).eval()
        w = load_file(ckpt / "model.safetensors")
        prefix = f"model.layers.{NUM_LAYERS}."
        state = {f"model.layers.0.{k[len(prefix):]}": v for k, v in w.items()
                 if k.startswith(prefix)}  # fmt: skip
        state["model.norm.weight"] = state.pop("model.layers.0.shared_head.norm.weight")
        state["lm_head.weight"] = w["lm_head.weight"]
        state["model.embed_tokens.weight"] = w["model.embed_tokens.weight"]
        self.enorm_w = state.pop("model.layers.0.enorm.weight")
        self.hnorm_w = state.pop("model.layers.0.hnorm.weight")
        self.eh_proj = state.pop("model.layers.0.eh_proj.weight")
        for k in ("embed_tokens.weight", "shared_head.head.weight"):
            state.pop(f"model.layers.0.{k}")
        missing, unexpected = self.mtp.load_state_dict(state, strict=False)
        assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
        self.eps = one.rms_norm_eps
        self.embed = w["model.embed_tokens.weight"]
        self._out: list[torch.Tensor] = []
        self.mtp.model.layers[0].register_forward_hook(
            lambda mod, args, out: self._out.append(out[0] if isinstance(out, tuple) else out)
        )

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> list[int]:
        """The k drafts after `tokens` (the last one just sampled): catch-up over positions
        0..n-2, then k - 1 chained positions."""
        ids = torch.tensor([tokens[:-1]])
        h = self.main.model(ids).last_hidden_state[0]  # final (normed) hidden states
        nxt = list(tokens[1:])
        out: list[int] = []
        for _ in range(k):
            x = torch.cat([self._norm(self.embed[nxt], self.enorm_w),
                           self._norm(h, self.hnorm_w)], dim=-1) @ self.eh_proj.T  # fmt: skip
            self._out.clear()
            logits = self.mtp(inputs_embeds=x[None]).logits[0]
            d = int(logits[-1].argmax())
            out.append(d)
            h = torch.cat([h, self._out[0][0][-1:]])  # the MTP output feeds the next draft
            nxt.append(d)
        return out


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 19, 33, 12)]


def _engine(ckpt: Path, k: int, *, budget: int = 16, num_blocks: int = 64,
            caching: bool = False, method: str = "mtp", ep_size: int = 1,
            max_model_len: int = 128) -> EngineCore:
    return build_engine_core(EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=max_model_len),
        cache=CacheConfig(block_size=4, num_blocks_override=num_blocks,
                          enable_prefix_caching=caching),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget),
        parallel=ParallelConfig(ep_size=ep_size),
        speculative=SpeculativeConfig(method, k, disable_by_batch_size=0),
    ))  # fmt: skip


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)


def _run(engine: EngineCore, prompts, on_step=None) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    ids: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids[out.request_id] += out.new_token_ids
        if on_step is not None:
            on_step()
    return [ids[f"r{i}"] for i in range(len(prompts))]


@pytest.fixture(scope="module")
def want(mtp_ckpt) -> list[list[int]]:
    return hf_greedy(mtp_ckpt, _prompts(), MAX_TOKENS)


@pytest.fixture(scope="module")
def reference(mtp_ckpt) -> ReferenceMTP:
    return ReferenceMTP(mtp_ckpt)


@pytest.mark.parametrize("k", [1, 3])
def test_drafts_equal_the_reference_mtp_after_accepts_and_rejects(mtp_ckpt, want, reference, k):
    """Each step's MTP drafts equal the reference's for the sequence so far; on every other
    step the drafts are replaced by the known continuation (so they are accepted, the last
    one corrupted every fourth step) to drive the catch-up through accepted drafts."""
    engine = _engine(mtp_ckpt, k)
    free = engine.kv.num_free_blocks
    prompts, checked, step = _prompts(), [0], [0]
    known = {tuple(p): w for p, w in zip(prompts, want, strict=True)}

    def on_step() -> None:
        step[0] += 1
        for req in engine.scheduler.running:
            if not req.spec_token_ids:
                continue
            room = MAX_TOKENS - req.num_output_tokens - 1
            limit = k if req.draft_limit is None else req.draft_limit  # the adaptive length
            assert req.spec_token_ids == reference.drafts(req.all_token_ids, k)[:min(room, limit)]
            checked[0] += 1
            if step[0] % 2 == 0:
                done = req.num_output_tokens
                oracle = known[tuple(req.prompt_token_ids)][done : done + len(req.spec_token_ids)]
                if step[0] % 4 == 0:
                    oracle[-1] = (oracle[-1] + 1) % 500
                req.spec_token_ids = oracle

    assert _run(engine, prompts, on_step) == want
    stats = engine.drafter.stats
    assert checked[0] >= 10
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.kv.num_free_blocks == free


@pytest.mark.parametrize("k", [1, 2, 3])
def test_greedy_equals_transformers(mtp_ckpt, want, k):
    engine = _engine(mtp_ckpt, k, budget=12)  # prompts up to 33 tokens: chunked prefill
    assert _run(engine, _prompts()) == want
    assert engine.drafter.stats.num_draft_tokens > 0


def test_glm4_moe_greedy_equals_transformers(glm4_moe_ckpt, tmp_path):
    """GLM-4.5's MTP layer (same layout, GQA attention with q/k norm and partial rotary)."""
    ckpt = _with_mtp_layer(glm4_moe_ckpt, "glm4_moe", tmp_path)
    engine = _engine(ckpt, 2)
    free = engine.kv.num_free_blocks
    assert _run(engine, _prompts()) == hf_greedy(glm4_moe_ckpt, _prompts(), MAX_TOKENS)
    assert engine.drafter.stats.num_draft_tokens > 0
    assert engine.kv.num_free_blocks == free


def test_prefix_caching_and_preemption(mtp_ckpt, want):
    engine = _engine(mtp_ckpt, 3, num_blocks=22, caching=True, budget=32, max_model_len=64)
    free = engine.kv.num_free_blocks
    assert _run(engine, _prompts()) == want
    assert _run(engine, _prompts()) == want
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv.prefix_cache_hits > 0
    assert engine.kv.num_free_blocks == free


def test_startup_refuses_mtp_where_it_cannot_run(
    mtp_ckpt, deepseek_v3_ckpt, qwen3_ckpt, tmp_path
):
    # transformers' config says 1 MTP layer, but save_pretrained never writes it
    with pytest.raises(StartupError, match=r"no model\.layers\.3\.\* tensors"):
        _engine(deepseek_v3_ckpt, 2)
    zero = tmp_path / "zero"
    shutil.copytree(mtp_ckpt, zero)
    cfg = json.loads((zero / "config.json").read_text())
    (zero / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(StartupError, match="num_nextn_predict_layers is 0"):
        _engine(zero, 2)
    with pytest.raises(StartupError, match="Qwen3MoeForCausalLM has no multi-token"):
        _engine(qwen3_ckpt, 2)
    with pytest.raises(StartupError, match="ep_size 2"):
        _engine(mtp_ckpt, 2, ep_size=2)


def test_missing_mtp_weights_are_named(mtp_ckpt, tmp_path):
    path = tmp_path / "no-mtp-weights"
    shutil.copytree(mtp_ckpt, path)
    w = load_file(path / "model.safetensors")
    del w[f"model.layers.{NUM_LAYERS}.eh_proj.weight"]
    save_file(w, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(StartupError, match=rf"model\.layers\.{NUM_LAYERS}\.eh_proj\.weight"):
        _engine(path, 2)
