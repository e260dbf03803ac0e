"""Weight updates without a restart, on the offline engine (issue 20): from disk and from a
trainer process's gloo group (`tests/weight_trainer.py`), whole and partial, float and 4-bit;
checked before any weight changes; atomic when the trainer dies mid-transfer; the prefix
cache never serves the old weights' K/V.

The oracle: after an update to a perturbed checkpoint, greedy ids equal transformers on that
checkpoint (float32), and 4-bit experts equal a fresh engine started on it.
"""

from __future__ import annotations

import multiprocessing
import shutil
from pathlib import Path

import pytest
import torch
from fixtures import hf_greedy, perturbed_checkpoint
from grpc_helpers import free_port
from safetensors.torch import save_file
from weight_trainer import broadcast_checkpoint, checkpoint_tensors

from moe_engine import LLM, SamplingParams
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.weight_update.buckets import bucket_layout
from moe_engine.weight_update.targets import meta_of

PROMPTS = [[5, 6, 7, 8], [100, 3, 9], list(range(20, 53))]
N = 8
GREEDY = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)


def _greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _weights(llm: LLM) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in llm.engine.model.named_parameters()}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weight_update")


@pytest.fixture(scope="module")
def new_ckpt(qwen3_ckpt, root) -> Path:
    return perturbed_checkpoint(qwen3_ckpt, root)


@pytest.fixture(scope="module")
def llm(qwen3_ckpt) -> LLM:
    return LLM(str(qwen3_ckpt), max_model_len=128, enable_prefix_caching=True)


def _restore(llm: LLM, ckpt: Path) -> None:
    llm.update_weights_from_disk(str(ckpt), "default")


def test_from_disk_serves_the_new_weights_and_version(llm, qwen3_ckpt, new_ckpt) -> None:
    assert llm.weight_version == "default"
    assert _greedy(llm) == hf_greedy(qwen3_ckpt, PROMPTS, N)
    free = llm.engine.kv.pool.num_free_blocks
    reply = llm.update_weights_from_disk(str(new_ckpt), "step-1")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    # the same prompts again: the prefix cache was flushed, so no old K/V is found
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(new_ckpt, PROMPTS, N)
    assert {o.weight_version for o in outs} == {"step-1"}
    assert llm.weight_version == "step-1" and llm.engine.model_info().weight_version == "step-1"
    assert reply.num_tensors == len(checkpoint_tensors(str(new_ckpt))) and reply.num_bytes > 0
    assert llm.engine.kv.pool.num_free_blocks == free
    _restore(llm, qwen3_ckpt)
    assert _greedy(llm) == hf_greedy(qwen3_ckpt, PROMPTS, N)


def test_a_partial_update_changes_only_its_tensors(llm, qwen3_ckpt, root) -> None:
    """Some tensors from disk (attention q of layer 0, layer 2's fused experts, the final
    norm): the engine equals transformers on a checkpoint where only those changed."""
    changed = ("layers.0.self_attn.q_proj", "layers.2.mlp.experts", "model.norm")
    target = perturbed_checkpoint(qwen3_ckpt, root, seed=2, only=changed)
    part = root / "partial"
    part.mkdir(exist_ok=True)
    tensors = {n: t for n, t in checkpoint_tensors(str(target)).items()
               if any(c in n for c in changed)}
    assert 3 <= len(tensors) < len(checkpoint_tensors(str(target))) // 2
    save_file(tensors, str(part / "model.safetensors"))
    reply = llm.update_weights_from_disk(str(part), "partial")
    assert reply.num_tensors == len(tensors)
    assert _greedy(llm) == hf_greedy(target, PROMPTS, N)
    _restore(llm, qwen3_ckpt)


def _bad_folder(root: Path, name: str, tensors: dict, config_from: Path | None = None) -> Path:
    path = root / name
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    if config_from is not None:
        shutil.copy(config_from / "config.json", path / "config.json")
    return path


@pytest.mark.parametrize("case", ["shape", "name", "dtype", "architecture", "path", "version",
                                  "stacked", "layer", "truncated", "nan"])
def test_a_bad_update_changes_nothing(llm, qwen3_ckpt, new_ckpt, gpt_oss_ckpt, root, case
                                      ) -> None:
    good = checkpoint_tensors(str(new_ckpt))
    before, weights = _greedy(llm), _weights(llm)
    q = "model.layers.0.self_attn.q_proj.weight"
    if case == "shape":  # every other tensor is fine and comes first: none may land
        path = _bad_folder(root, "bad-shape", {**good, q: good[q][:-1]})
        want = ("model.layers.0.self_attn.q_proj.weight", "shape")
    elif case == "name":
        extra = {"model.layers.0.not_a_weight": good[q].clone()}
        path = _bad_folder(root, "bad-name", {**good, **extra})
        want = ("not_a_weight", "no place")
    elif case == "dtype":
        path = _bad_folder(root, "bad-dtype", {**good, q: good[q].to(torch.int32)})
        want = (q, "int32")
    elif case == "architecture":
        path = _bad_folder(root, "bad-arch", good, config_from=gpt_oss_ckpt)
        want = ("GptOssForCausalLM", "Qwen3MoeForCausalLM")
    elif case == "path":
        path, want = root / "missing", ("missing", "not a folder")
    elif case == "stacked":  # a q_proj name the model has no parameter for
        extra = {"model.layers.0.self_attn.q_proj.bias": good[q][:, 0].clone()}
        path = _bad_folder(root, "bad-stacked", {**good, **extra})
        want = ("q_proj.bias", "no place")
    elif case == "layer":  # beyond the last layer (the checkpoint declares no MTP layer)
        extra = {"model.layers.99.self_attn.q_proj.weight": good[q].clone()}
        path = _bad_folder(root, "bad-layer", {**good, **extra})
        want = ("layers.99", "the model has 3 layers")
    elif case == "truncated":  # still being written
        path = _bad_folder(root, "bad-truncated", good)
        data = (path / "model.safetensors").read_bytes()
        (path / "model.safetensors").write_bytes(data[: len(data) // 2])
        want = ("model.safetensors", "cannot be read as safetensors")
    elif case == "nan":
        nan = good[q].clone()
        nan[3, 5] = float("nan")
        path = _bad_folder(root, "bad-nan", {**good, q: nan})
        want = (q, "Inf or NaN")
    else:
        path, want = new_ckpt, ("weight_version", "empty")
    with pytest.raises(RequestError) as info:
        llm.update_weights_from_disk(str(path), "" if case == "version" else "bad")
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert all(w in info.value.message for w in want), info.value.message
    assert "nothing changed" in info.value.message
    assert llm.weight_version == "default"
    after = _weights(llm)
    assert all(torch.equal(after[n], weights[n]) for n in weights)
    assert _greedy(llm) == before


@pytest.mark.parametrize("method", ["int4", "mxfp4"])
def test_4bit_experts_are_requantized(qwen3_ckpt, new_ckpt, method) -> None:
    """The update quantizes the new experts as a start on them would: equal to a fresh
    engine on the new checkpoint (its own 4-bit codes), and different from before."""
    kw = dict(max_model_len=128, quantization=method, quant_group_size=32)
    llm = LLM(str(qwen3_ckpt), **kw)
    before = _greedy(llm)
    llm.update_weights_from_disk(str(new_ckpt), "q")
    fresh = _greedy(LLM(str(new_ckpt), **kw))
    assert _greedy(llm) == fresh != before


def _trainer(port: int, path: Path, bucket_bytes: int, **kw) -> multiprocessing.Process:
    proc = multiprocessing.get_context("spawn").Process(
        target=broadcast_checkpoint, args=(port, 2, str(path), bucket_bytes), kwargs=kw,
        daemon=True,
    )
    proc.start()
    return proc


def test_from_a_trainer_process_over_gloo(llm, qwen3_ckpt, new_ckpt) -> None:
    """A trainer process broadcasts the perturbed weights in small buckets; the engine
    serves them, version changed; a second update over the same group restores them."""
    for ckpt, version in ((new_ckpt, "rl-1"), (qwen3_ckpt, "rl-2")):
        port = free_port()
        trainer = _trainer(port, ckpt, bucket_bytes=64 * 1024)
        llm.init_weight_update_group("127.0.0.1", port, rank_offset=1, world_size=2,
                                     timeout_s=60)
        metas = [meta_of(n, t) for n, t in checkpoint_tensors(str(ckpt)).items()]
        assert len(bucket_layout(metas, 64 * 1024)) > 3
        reply = llm.update_weights_from_distributed(metas, version, bucket_bytes=64 * 1024)
        trainer.join(30)
        assert trainer.exitcode == 0 and reply.num_tensors == len(metas)
        llm.destroy_weight_update_group()
        assert llm.weight_version == version
        assert _greedy(llm) == hf_greedy(ckpt, PROMPTS, N)
    _restore(llm, qwen3_ckpt)


def test_a_trainer_that_dies_mid_transfer_changes_nothing(llm, new_ckpt) -> None:
    before, weights = _greedy(llm), _weights(llm)
    port = free_port()
    trainer = _trainer(port, new_ckpt, bucket_bytes=64 * 1024, die_after_buckets=2)
    llm.init_weight_update_group("127.0.0.1", port, 1, 2, timeout_s=30)
    metas = [meta_of(n, t) for n, t in checkpoint_tensors(str(new_ckpt)).items()]
    with pytest.raises(RequestError) as info:
        llm.update_weights_from_distributed(metas, "never", bucket_bytes=64 * 1024)
    trainer.join(30)
    assert trainer.exitcode == 3
    assert info.value.code == ErrorCode.UNAVAILABLE
    assert "after 2 of" in info.value.message and "nothing changed" in info.value.message
    assert llm.weight_version == "default" and not llm.engine.rollout.groups
    after = _weights(llm)
    assert all(torch.equal(after[n], weights[n]) for n in weights)
    assert _greedy(llm) == before


def test_a_refused_list_sends_nothing(llm, new_ckpt) -> None:
    """A wrong shape in the trainer's list: the engine refuses at the handshake, the trainer
    sends no bucket and exits cleanly, the group stays usable."""
    tensors = checkpoint_tensors(str(new_ckpt))
    bad = "model.layers.1.mlp.up_proj.weight"  # the dense layer
    port = free_port()
    trainer = _trainer(port, new_ckpt, 1 << 20, overrides={bad: tensors[bad][:3]})
    llm.init_weight_update_group("127.0.0.1", port, 1, 2)
    metas = [meta_of(n, t) for n, t in {**tensors, bad: tensors[bad][:3]}.items()]
    with pytest.raises(RequestError, match="up_proj.weight.*shape"):
        llm.update_weights_from_distributed(metas, "never", bucket_bytes=1 << 20)
    trainer.join(30)
    assert trainer.exitcode == 0 and "weight_update" in llm.engine.rollout.groups
    llm.destroy_weight_update_group()
    assert llm.weight_version == "default"


@pytest.mark.parametrize("ckpt_name", ["gpt_oss_ckpt", "deepseek_v3_ckpt", "mixtral_ckpt"])
def test_other_architectures_from_disk(ckpt_name, request, root) -> None:
    """gpt-oss (fused [E, in, out] experts with interleaved gate/up and biases, sinks),
    DeepSeek-V3 (MLA: the absorbed decode weights are split again; float32 router and
    correction bias; shared experts), Mixtral (w1/w3/w2 per expert): equal transformers on
    the new weights."""
    ckpt = request.getfixturevalue(ckpt_name)
    new = perturbed_checkpoint(ckpt, root)
    llm = LLM(str(ckpt), max_model_len=128)
    assert _greedy(llm) == hf_greedy(ckpt, PROMPTS, N)
    llm.update_weights_from_disk(str(new), "v1")
    assert _greedy(llm) == hf_greedy(new, PROMPTS, N)


def test_bfloat16_native_kernels_are_repacked(qwen3_ckpt, new_ckpt) -> None:
    """bf16: the native packed linears, fused experts and one-call decode layers hold packed
    copies of the weights; after an update the engine equals a fresh bf16 engine on the new
    checkpoint (the update rounds float32 tensors to bf16 as loading does)."""
    kw = dict(max_model_len=128, dtype="bfloat16")
    llm = LLM(str(qwen3_ckpt), **kw)
    before = _greedy(llm)
    llm.update_weights_from_disk(str(new_ckpt), "bf16")
    assert _greedy(llm) == _greedy(LLM(str(new_ckpt), **kw)) != before


def test_mxfp4_blocks_are_taken_packed(gpt_oss_ckpt, gpt_oss_mxfp4_ckpt, root) -> None:
    """A gpt-oss engine serving its checkpoint's MXFP4 experts takes an update's
    `*_blocks` / `*_scales` as stored: equal to a fresh start on the new MXFP4 checkpoint."""
    from fixtures import make_mxfp4_experts_checkpoint

    new = make_mxfp4_experts_checkpoint(perturbed_checkpoint(gpt_oss_ckpt, root), root)
    llm = LLM(str(gpt_oss_mxfp4_ckpt), max_model_len=128)
    before = _greedy(llm)
    reply = llm.update_weights_from_disk(str(new), "mx")
    assert reply.num_tensors == len(checkpoint_tensors(str(new)))
    assert _greedy(llm) == _greedy(LLM(str(new), max_model_len=128)) != before


def test_a_partial_update_of_int4_experts(qwen3_ckpt, root) -> None:
    """Some experts of one layer from disk into int4 experts: only their rows are quantized
    again; equal to a fresh int4 engine on a checkpoint where only those experts changed."""
    changed = ("layers.2.mlp.experts.1.", "layers.2.mlp.experts.6.")
    target = perturbed_checkpoint(qwen3_ckpt, root, seed=3, only=changed)
    part = root / "partial-int4"
    part.mkdir(exist_ok=True)
    tensors = {n: t for n, t in checkpoint_tensors(str(target)).items()
               if any(c in n for c in changed)}
    assert len(tensors) == 6, sorted(tensors)
    save_file(tensors, str(part / "model.safetensors"))
    kw = dict(max_model_len=128, quantization="int4", quant_group_size=32)
    llm = LLM(str(qwen3_ckpt), **kw)
    llm.update_weights_from_disk(str(part), "partial-int4")
    fresh = LLM(str(target), **kw)
    assert _greedy(llm) == _greedy(fresh)
    # the codes themselves: bit-identical to quantizing the new checkpoint at startup
    for (_, mine), (_, theirs) in zip(llm.engine.model.moe_layers(),
                                      fresh.engine.model.moe_layers(), strict=True):
        a, b = mine.quantized.canonical(), theirs.quantized.canonical()
        assert all(torch.equal(getattr(a, f), getattr(b, f))
                   for f in ("w13_packed", "w13_scales", "w2_packed", "w2_scales"))


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_the_in_place_commit_of_device_models(qwen3_ckpt, new_ckpt, quantization) -> None:
    """The commit a GPU model uses (values copied into the serving tensors, which keep their
    addresses), run on this CPU: the same outputs as a fresh start on the new weights."""
    kw = dict(max_model_len=128, quantization=quantization, quant_group_size=32)
    llm = LLM(str(qwen3_ckpt), **kw)
    llm.engine.rollout.in_place = True
    q = llm.engine.model.model.layers[0].self_attn.qkv_proj.weight
    address = q.data_ptr()
    llm.update_weights_from_disk(str(new_ckpt), "in-place")
    assert q.data_ptr() == address
    assert _greedy(llm) == _greedy(LLM(str(new_ckpt), **kw))


def test_a_trainer_sending_nan_is_refused_after_the_transfer(llm, new_ckpt) -> None:
    """A diverged step (a NaN in one tensor of an early bucket): the engine still receives
    every bucket (the trainer is not left hanging), then refuses naming the tensor; the
    group stays usable and nothing changed."""
    tensors = checkpoint_tensors(str(new_ckpt))
    name = next(iter(tensors))  # sorted: the first bucket
    nan = tensors[name].clone()
    nan.view(-1)[0] = float("nan")
    before = _greedy(llm)
    port = free_port()
    trainer = _trainer(port, new_ckpt, 64 * 1024, overrides={name: nan})
    llm.init_weight_update_group("127.0.0.1", port, 1, 2)
    metas = [meta_of(n, t) for n, t in tensors.items()]
    with pytest.raises(RequestError, match="Inf or NaN"):
        llm.update_weights_from_distributed(metas, "never", bucket_bytes=64 * 1024)
    trainer.join(30)
    assert trainer.exitcode == 0 and "weight_update" in llm.engine.rollout.groups
    llm.destroy_weight_update_group()
    assert llm.weight_version == "default" and _greedy(llm) == before
