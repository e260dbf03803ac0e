"""The native decode layer (kernels/decode_layer/native.py, csrc/decode_layer.cpp) against the
module path it replaces: bfloat16 Qwen3-MoE, Mixtral and gpt-oss (sinks, sliding-window and
full layers, YaRN, biases everywhere, top-k-then-softmax routing, the clamped SwiGLU; bfloat16,
int4 and MXFP4 experts) served both ways give bit-identical greedy tokens and
log-probabilities (batch 1 and batched decode steps, the dense layer staying on the module
path), the same expert-load counts and, layer by layer, the same residual stream and KV cache;
the kernel refuses inputs it cannot run."""

from __future__ import annotations

import logging

import pytest
import torch

from kernels.decode_layer.native import (
    TOPK_SOFTMAX_MAX_K,
    DecodeLayerKernel,
    decode_step_args,
    router_topk_softmax,
)
from kernels.dense.amx import amx_unavailable_reason
from moe_engine import LLM
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.routing import topk_softmax
from moe_engine.sampling_params import SamplingParams

needs_amx = pytest.mark.skipif(amx_unavailable_reason() is not None,
                               reason=f"AMX kernels unavailable: {amx_unavailable_reason()}")

PROMPTS = [[3, 17, 5, 9, 11, 2, 40], [8, 8, 1], [60, 12, 33, 7, 7, 19, 4, 25, 90, 13, 6]]


def _serve(ckpt, backend: str, quantization: str, monkeypatch
           ) -> tuple[list, list, torch.Tensor, int]:
    calls = []

    def counted(self, *args, _run=DecodeLayerKernel.run):
        calls.append(args[0].shape[0])
        return _run(self, *args)

    monkeypatch.setattr(DecodeLayerKernel, "run", counted)
    method, _, layers = quantization.partition("+")  # "int4+all": --quantized-layers all
    llm = LLM(model=str(ckpt), dtype="bfloat16", max_model_len=128, kernel_backend=backend,
              quantization=method, quant_group_size=32, quantized_layers=layers or "experts")
    sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in PROMPTS[:1]]  # batch 1
    outs += llm.generate(PROMPTS, sp, use_tqdm=False)  # batched decode steps
    ids = [o.outputs[0].token_ids for o in outs]
    logprobs = [o.outputs[0].logprobs for o in outs]
    counts = llm.engine.expert_load.counts.clone()
    return ids, logprobs, counts, len(calls)


@needs_amx
@pytest.mark.parametrize("arch,quantization,moe_layers", [
    ("qwen3", "none", 2), ("qwen3", "int4", 2), ("qwen3", "int4+all", 2),
    ("qwen3", "mxfp4+all", 2), ("mixtral", "none", 2),
    ("gpt_oss", "none", 4), ("gpt_oss", "int4+all", 4), ("gpt_oss_mxfp4", "none", 4),
    ("gpt_oss_mxfp4", "mxfp4+all", 4),
])
def test_native_decode_layer_is_bit_identical_to_the_module_path(request, arch, quantization,
                                                                 moe_layers, monkeypatch):
    """Qwen3-MoE (q/k norms, a dense layer between its MoE layers) with bfloat16 experts (the
    AMX kernel) and int4 ones (the native 4-bit kernel), and with its QKV and output
    projections 4-bit too (--quantized-layers all: csrc/linear_q4_cpu.cpp); Mixtral (no q/k
    norm); gpt-oss (window 8: the 11-token prompt decodes past it) with bfloat16 experts,
    int4 ones and 4-bit projections, its MXFP4 checkpoint as stored and with MXFP4
    projections."""
    ckpt = request.getfixturevalue(f"{arch}_ckpt")
    want_ids, want_lp, want_counts, module_calls = _serve(ckpt, "decode_layer=torch",
                                                          quantization, monkeypatch)
    got_ids, got_lp, got_counts, native_calls = _serve(ckpt, "auto", quantization, monkeypatch)
    assert module_calls == 0
    # every MoE layer, 7 decode steps per request: batch 1, then batched
    assert native_calls >= moe_layers * 7 * 2
    assert got_ids == want_ids
    assert got_lp == want_lp
    assert torch.equal(got_counts, want_counts) and got_counts.sum() > 0


@needs_amx
@pytest.mark.parametrize("ckpt_name,quantization", [
    ("qwen3_ckpt", "none"), ("qwen3_ckpt", "int4"), ("gpt_oss_ckpt", "none"),
])
def test_draft_verification_runs_on_the_native_layer_bit_identically(request, ckpt_name,
                                                                     quantization, monkeypatch):
    """With n-gram drafts a step verifies 1 + k tokens per request; each token runs as its own
    decode row (`ModelRunner._verify_host_inputs`: of the native layer, or beside a prefill
    chunk of the module path's decode batch), so the tokens and log-probabilities equal those
    of decoding one token per step, bit for bit, at batch 1 and batched (gpt-oss: the rows of
    one request on both sides of its 8-token window's edge)."""
    prompts = [[3, 17, 5, 9] * 4, [8, 8, 1, 8, 8, 1, 8], [60, 12, 33, 7, 60, 12, 33]]
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    results, run = [], DecodeLayerKernel.run
    for method in (None, "ngram"):
        rows: list[int] = []

        def counted(self, *args, _run=run, rows=rows):
            rows.append(args[0].shape[0])
            return _run(self, *args)

        monkeypatch.setattr(DecodeLayerKernel, "run", counted)
        llm = LLM(model=str(request.getfixturevalue(ckpt_name)), dtype="bfloat16",
                  max_model_len=128, quantization=quantization, quant_group_size=32,
                  speculative_method=method,
                  num_speculative_tokens=3 if method else None, max_num_batched_tokens=24,
                  speculative_disable_by_batch_size=0)
        outs = [llm.generate([p], sp, use_tqdm=False)[0] for p in prompts]  # batch 1
        # batched, with a 24-token budget: the later prompts' prefill chunks share steps with
        # the first ones' verifications (those rows then take the module path's decode batch)
        outs += llm.generate(prompts + [[7, 11] * 20], sp, use_tqdm=False)
        results.append(([o.outputs[0].token_ids for o in outs],
                         [o.outputs[0].logprobs for o in outs], rows))
    (want_ids, want_lp, plain_rows), (got_ids, got_lp, spec_rows) = results
    assert set(plain_rows) <= set(range(1, 5))  # decodes only: at most the 4 requests
    assert max(spec_rows) > 1  # verification steps took the native layer
    assert len(spec_rows) < len(plain_rows)  # and saved steps
    assert got_ids == want_ids
    assert got_lp == want_lp


@needs_amx
def test_only_moe_layers_of_the_bfloat16_model_take_it(qwen3_ckpt, caplog):
    caplog.set_level(logging.INFO, logger="moe_engine.models.kernel_binding")
    llm = LLM(model=str(qwen3_ckpt), dtype="bfloat16", max_model_len=64)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, DecoderLayer)]
    assert [layer.decode_kernel is not None for layer in layers] == [True, False, True]
    assert ("decode steps: 2 of 3 decoder layers run as one native call each" in caplog.text
            and "module path: not an Attention + FusedMoE layer" in caplog.text)
    llm32 = LLM(model=str(qwen3_ckpt), max_model_len=64)  # float32: the module path
    assert all(m.decode_kernel is None for m in llm32.engine.model.modules()
               if isinstance(m, DecoderLayer))


@needs_amx
def test_the_kernel_refuses_inputs_it_cannot_run(qwen3_ckpt):
    llm = LLM(model=str(qwen3_ckpt), dtype="bfloat16", max_model_len=64)
    layer = next(m for m in llm.engine.model.modules()
                 if isinstance(m, DecoderLayer) and m.decode_kernel is not None)
    kernel, kv = layer.decode_kernel, llm.engine.runner.kv_caches[0]

    def run(h, positions, kv_cache, slot_mapping, block_tables, seq_lens):
        step = decode_step_args(positions, slot_mapping, block_tables, seq_lens)
        kernel.run(h.clone(), step, kv_cache, torch.empty(step.rows, kernel.top_k),
                   torch.empty(step.rows, kernel.top_k, dtype=torch.int32))
    h = torch.zeros(2, kernel.qkv.in_features, dtype=torch.bfloat16)
    ok = dict(positions=torch.zeros(2, dtype=torch.int64), kv_cache=kv,
              slot_mapping=torch.zeros(2, dtype=torch.int64),
              block_tables=torch.zeros(2, 4, dtype=torch.int64),
              seq_lens=torch.ones(2, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="decode layer: h torch.float32"):
        run(h.float(), **ok)
    with pytest.raises(RuntimeError, match=r"slot_mapping must be contiguous int64 \[2\]"):
        run(h, **{**ok, "slot_mapping": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(RuntimeError, match=r"decode layer: h .* \(2, 64\)"):  # 3 rows wanted
        run(h, **{**ok, **{n: torch.zeros(3, dtype=torch.int64) for n in ("positions",
                                                                          "slot_mapping")},
                  "block_tables": torch.zeros(3, 4, dtype=torch.int64),
                  "seq_lens": torch.ones(3, dtype=torch.int64)})
    with pytest.raises(RuntimeError, match=r"decode layer: h .* \(3, 64\)"):
        run(torch.zeros(3, 64, dtype=torch.bfloat16), **ok)
    with pytest.raises(RuntimeError, match="block_tables must be contiguous"):
        run(h, **{**ok, "block_tables": torch.zeros(3, 4, dtype=torch.int64)})
    with pytest.raises(RuntimeError, match="native kernel: decode layer"):
        run(h, **{**ok, "seq_lens": torch.full((2,), 10_000, dtype=torch.int64)})


def test_the_decodes_only_batch_is_the_general_one():
    """`build_decode_batch` (a decodes-only step's metadata from plain ints) builds the tensors
    `build_attention_batch` builds for the same step."""
    from moe_engine.models.layers.attention import build_attention_batch, build_decode_batch

    starts = [0, 5, 31, 16, 47]
    tables = torch.tensor([[7, 0, 0, 0], [3, 0, 0, 0], [4, 9, 0, 0], [1, 2, 0, 0],
                           [5, 6, 8, 11]])
    want = build_attention_batch(0, torch.ones(5, dtype=torch.int64), torch.tensor(starts),
                                 tables, 16)
    got = build_decode_batch(starts, tables, 16)
    for name in ("token_start", "token_end", "max_q", "num_keys"):
        assert getattr(got, name) == getattr(want, name), name
    for name in ("tok_b", "tok_q", "block_ids", "q_pos", "block_tables", "seq_lens",
                 "query_start_loc"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def _serve_comparing_layers(ckpt, quantization: str, monkeypatch,
                            prompts: list[list[int]] | None = None) -> list[tuple]:
    """Serve `ckpt` in bfloat16 with every native decode step checked against the module path
    on the same input: each layer that takes the native call first runs its modules on a copy
    of h (writing this step's keys and values), the cache is put back, then the native call
    runs. `prompts` run batched after the first alone (default: `PROMPTS` and a 29-token
    one). Returns, per native call, (layer window or 0, rows, residual streams equal, caches
    equal)."""
    seen: list[tuple] = []
    forward, forward_residual = DecoderLayer.forward, DecoderLayer.forward_residual

    def compared(self, h, residual, positions, meta, kv_cache, step=None):
        args = None
        if self.decode_kernel is not None and step is not None:
            args = step.args(self.self_attn.attn.kv_group)
        if args is None:
            return forward_residual(self, h, residual, positions, meta, kv_cache, step)
        stream = h if residual is None else h + residual
        before = [c.clone() for c in kv_cache]
        want = forward(self, stream.clone(), positions, meta, kv_cache, None)
        want_cache = [c.clone() for c in kv_cache]
        for c, b in zip(kv_cache, before, strict=True):
            c.copy_(b)
        got, rest = forward_residual(self, h, residual, positions, meta, kv_cache, step)
        assert rest is None  # the native call leaves the whole stream in h
        seen.append((self.self_attn.attn.sliding_window or 0, h.shape[0],
                     torch.equal(got, want),
                     all(torch.equal(c, w) for c, w in zip(kv_cache, want_cache, strict=True))))
        return got, rest

    monkeypatch.setattr(DecoderLayer, "forward_residual", compared)
    method, _, layers = quantization.partition("+")
    llm = LLM(model=str(ckpt), dtype="bfloat16", max_model_len=256, quantization=method,
              quant_group_size=32, quantized_layers=layers or "experts", block_size=16)
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    long_prompt = [(7 * i) % 500 + 3 for i in range(29)]  # 29 + 12 tokens: three blocks
    prompts = prompts or [*PROMPTS, long_prompt]
    llm.generate(prompts[:1], sp, use_tqdm=False)  # batch 1
    llm.generate(prompts, sp, use_tqdm=False)  # batched, of different lengths
    return seen


@needs_amx
@pytest.mark.parametrize("ckpt_name,quantization", [
    ("gpt_oss_ckpt", "none"), ("gpt_oss_ckpt", "int4"), ("gpt_oss_mxfp4_ckpt", "none"),
])
def test_gpt_oss_layers_give_the_module_paths_residual_stream(request, ckpt_name, quantization,
                                                             monkeypatch):
    """Every native gpt-oss layer call (sliding-window layers of window 8 and full ones, batch
    1 and 4 requests of 7 to 41 tokens, past the window and across blocks) leaves the
    residual stream and the KV cache bit-identical to the module path's on the same input."""
    seen = _serve_comparing_layers(request.getfixturevalue(ckpt_name), quantization,
                                   monkeypatch)
    assert {w for w, *_ in seen} == {0, 8}  # both kinds of layer ran natively
    assert {1, 4} <= {rows for _, rows, *_ in seen}
    assert all(same_h and same_cache for *_, same_h, same_cache in seen), [
        s for s in seen if not all(s[2:])]


@pytest.fixture(scope="module")
def gpt_oss_20b_layers_ckpt(tiny_ckpt_root):
    """gpt-oss-20b's layer shapes (hidden 2880, 64 query / 8 KV heads of 64, experts of width
    2880, top-4, window 128), 2 layers (sliding, full), 8 experts in MXFP4, a 1024-token
    vocabulary; sinks and biases drawn (transformers makes them zero)."""
    from fixtures import make_mxfp4_experts_checkpoint, tiny_config
    from transformers import AutoModelForCausalLM

    path = tiny_ckpt_root / "gpt-oss-20b-layers"
    if not (path / "config.json").is_file():
        config = tiny_config(
            "gpt_oss", hidden_size=2880, intermediate_size=2880, num_attention_heads=64,
            num_key_value_heads=8, head_dim=64, num_local_experts=8, num_experts_per_tok=4,
            sliding_window=128, num_hidden_layers=2, vocab_size=1024, initializer_range=0.02,
            layer_types=["sliding_attention", "full_attention"])
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(("bias", ".sinks")):
                    p.normal_(0.0, 0.5)
        model.save_pretrained(path, safe_serialization=True)
    return make_mxfp4_experts_checkpoint(path, tiny_ckpt_root)


@pytest.mark.slow
@needs_amx
def test_gpt_oss_20b_shaped_layers_give_the_module_paths_residual_stream(
        gpt_oss_20b_layers_ckpt, monkeypatch):
    """At gpt-oss-20b's layer shapes (about 1.7 GiB of RSS, a minute), requests of 5, 60 and
    140 tokens (past the 128-token window) decode with every native layer call bit-identical
    to the module path."""
    prompts = [[(13 * i + j) % 1000 + 3 for i in range(n)] for j, n in enumerate((5, 140, 60))]
    seen = _serve_comparing_layers(gpt_oss_20b_layers_ckpt, "none", monkeypatch, prompts)
    assert {w for w, *_ in seen} == {0, 128}
    assert {1, 3} <= {rows for _, rows, *_ in seen}
    assert all(same_h and same_cache for *_, same_h, same_cache in seen)

@needs_amx
@pytest.mark.parametrize("ckpt_name", ["gpt_oss_ckpt", "gpt_oss_mxfp4_ckpt"])
def test_every_gpt_oss_layer_takes_the_native_call(request, ckpt_name, caplog):
    caplog.set_level(logging.INFO, logger="moe_engine.models.kernel_binding")
    llm = LLM(model=str(request.getfixturevalue(ckpt_name)), dtype="bfloat16", max_model_len=64)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, DecoderLayer)]
    assert [layer.decode_misfit for layer in layers] == [None] * 4
    assert "decode steps: 4 of 4 decoder layers run as one native call each" in caplog.text
    kernels = [layer.decode_kernel for layer in layers]
    assert [k.window for k in kernels] == [8, 0, 8, 0]
    assert all(k.sinks is not None and k.topk_softmax and k.norm_in_float32
               and k.activation.clamped and k.b13 is not None for k in kernels)


@needs_amx
@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (32, 4), (128, 4), (16, 7)])
def test_topk_softmax_routing_is_torchs_bit_for_bit(num_experts, top_k):
    """`moe_router_topk_softmax` against `routing.topk_softmax` (torch's topk, then softmax in
    bfloat16) on bfloat16 logits, also rounded to a few levels so that most rows hold ties
    (torch's selection order is what the kernel repeats)."""
    g = torch.Generator().manual_seed(num_experts * 10 + top_k)
    for levels in (None, 2, 8):
        logits = torch.randn(3000, num_experts, generator=g)
        if levels is not None:
            logits = (logits * levels).round() / levels
        logits = logits.bfloat16()
        want_w, want_ids = topk_softmax(logits, top_k)
        got_w, got_ids = router_topk_softmax(logits, top_k)
        assert torch.equal(got_ids, want_ids)
        assert torch.equal(got_w, want_w)


@needs_amx
def test_topk_softmax_routing_refuses_what_it_does_not_repeat():
    logits = torch.zeros(2, 8, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="native kernel: router_topk_softmax"):
        router_topk_softmax(logits, TOPK_SOFTMAX_MAX_K + 1)
    with pytest.raises(RuntimeError, match="native kernel: router_topk_softmax"):
        router_topk_softmax(torch.zeros(2, 128, dtype=torch.bfloat16), 2)  # 2 * 64 <= E
    with pytest.raises(RuntimeError, match="logits must be bfloat16"):
        router_topk_softmax(logits.float(), 2)


@pytest.mark.parametrize("num_experts,top_k,fits", [
    (32, 4, True), (128, 4, True), (128, 2, False), (16, 8, False),
])
def test_top_k_then_softmax_fits_where_the_kernel_repeats_torch(num_experts, top_k, fits):
    """A gpt-oss MoE block takes the native layer only where `moe_router_topk_softmax` is
    torch's selection and softmax (top_k <= 7, top_k * 64 > E); elsewhere the layer says why."""
    from moe_engine.models.layers.moe import FusedMoE
    from moe_engine.models.layers.native_decode import _routing_fits

    mlp = FusedMoE(num_experts, top_k, 64, 32, False, torch.bfloat16, routing="topk_softmax")
    assert _routing_fits(mlp) is fits
