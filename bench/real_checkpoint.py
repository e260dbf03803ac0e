"""Random-weight checkpoints of real MoE releases' shapes, for `bench/real_scale.py`.

Made from a shipped config.json under tests/data/configs (`gpt-oss-20b.json`,
`qwen3-30b-a3b.json`, `deepseek-v2-lite.json`), optionally cut to `layers` decoder layers and a
smaller `vocab`:

  - gpt-oss: stored as OpenAI's release stores it: the experts in MXFP4
    (`mlp.experts.gate_up_proj_blocks` uint8 [E, 2I, H/32, 16] and `_scales` uint8 [E, 2I, H/32],
    `down_proj_blocks` [E, H, I/32, 16] / `_scales` [E, H, I/32]; gate/up rows interleaved,
    which random rows do not care about), expert biases, attention (q/k/v/o with biases, sinks),
    router, norms, embedding and LM head in bfloat16;
  - Qwen3-MoE: everything bfloat16, one tensor per expert projection
    (`mlp.experts.{e}.{gate,up,down}_proj.weight`) as the Hugging Face release;
  - DeepSeek-V2: everything bfloat16, MLA projections, a dense first layer, routed and shared
    experts one tensor per projection, as the release (bench/gpu_e2e.py uses it).

Values are what an initialised model holds, so activations stay finite at any depth: every
matrix and bias ~ N(0, initializer_range = 0.02), gpt-oss's sinks ~ N(0, 1), norms 1. MXFP4
blocks are uniform random bytes (each 4-bit code uniform over the 16 FP4 values, RMS 2.93) and
the E8M0 scale bytes uniform in 119..121 (2^-8..2^-6), so an expert weight has an RMS of about
2.93 * 2^-7 = 0.023, like the bf16 matrices.

Files, like a release's: `model-0000i-of-0000n.safetensors` shards of at most `shard_bytes`
(tensors assigned in model order: embedding, layer 0, 1, ..., norm, LM head; name order within a
shard), `model.safetensors.index.json` ({"metadata": {"total_size"}, "weight_map"}) and
`config.json`. Each shard is written tensor by tensor, each tensor in chunks of at most
CHUNK_ELEMS values drawn from a generator seeded by (seed, tensor name, chunk), so memory stays
at one chunk (~256 MB) whatever the model's size, and the values do not depend on sharding.
A checkpoint lives in `workdir/<config stem>-L<layers>-V<vocab>-<12 hex of the config hash>`,
made in a temporary folder and renamed, so a rerun reuses it and never sees half a checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

CONFIGS = Path(__file__).resolve().parent.parent / "tests" / "data" / "configs"
#: Bump when the way values are drawn changes (it is part of the cache key).
MAKER_VERSION = 1
CHUNK_ELEMS = 1 << 26
DEFAULT_SHARD_BYTES = int(4.5 * 2**30)
INIT_STD = 0.02
MXFP4_SCALE_BYTES = (119, 121)
SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.uint8: "U8", torch.float32: "F32"}


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: name, shape, dtype and how its values are drawn.

    init: `normal` (N(0, std)), `ones`, `bytes` (uniform uint8 0..255) or `scales` (uniform
    uint8 in MXFP4_SCALE_BYTES).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    init: str
    std: float = INIT_STD

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def shipped_config(stem: str, layers: int | None = None, vocab: int | None = None) -> dict:
    """tests/data/configs/`stem`.json cut to `layers` decoder layers (and `layer_types`) and a
    vocabulary of `vocab` ids (token ids in the config that fall outside are moved to its end).

    Raises:
        FileNotFoundError: no such shipped config.
        ValueError: layers or vocab not positive or larger than the shipped ones.
    """
    config = json.loads((CONFIGS / f"{stem}.json").read_text())
    if layers is not None:
        if not 0 < layers <= config["num_hidden_layers"]:
            raise ValueError(f"layers must be in 1..{config['num_hidden_layers']}, got {layers}")
        config["num_hidden_layers"] = layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:layers]
        if "max_window_layers" in config:
            config["max_window_layers"] = min(config["max_window_layers"], layers)
    if vocab is not None:
        if not 256 < vocab <= config["vocab_size"]:
            raise ValueError(f"vocab must be in 257..{config['vocab_size']}, got {vocab}")
        config["vocab_size"] = vocab
        for key, fallback in (("bos_token_id", 1), ("eos_token_id", 2), ("pad_token_id", 0)):
            if isinstance(config.get(key), int) and config[key] >= vocab:
                config[key] = vocab - 3 + fallback
    return config


def tensor_specs(config: dict) -> list[TensorSpec]:
    """Every tensor of `config`'s checkpoint in model order (embedding, layers, norm, head).

    Raises:
        ValueError: a model_type other than gpt_oss, qwen3_moe and deepseek_v2.
    """
    h, v, bf = config["hidden_size"], config["vocab_size"], torch.bfloat16
    std = config.get("initializer_range", INIT_STD)
    layer = {"gpt_oss": _gpt_oss_layer, "qwen3_moe": _qwen3_moe_layer,
             "deepseek_v2": _deepseek_v2_layer}.get(config["model_type"])
    if layer is None:
        raise ValueError(f"no random checkpoint maker for model_type {config['model_type']!r}")
    specs = [TensorSpec("model.embed_tokens.weight", (v, h), bf, "normal", std)]
    for i in range(config["num_hidden_layers"]):
        specs += sorted(layer(config, f"model.layers.{i}.", std), key=lambda s: s.name)
    specs += [TensorSpec("model.norm.weight", (h,), bf, "ones"),
              TensorSpec("lm_head.weight", (v, h), bf, "normal", std)]
    return specs


def _attention(config: dict, p: str, std: float, bias: bool) -> list[TensorSpec]:
    h, d = config["hidden_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    out = []
    for name, shape in (("q_proj", (q, h)), ("k_proj", (kv, h)), ("v_proj", (kv, h)),
                        ("o_proj", (h, q))):
        out.append(TensorSpec(f"{p}self_attn.{name}.weight", shape, torch.bfloat16, "normal", std))
        if bias:
            out.append(TensorSpec(f"{p}self_attn.{name}.bias", shape[:1], torch.bfloat16,
                                  "normal", std))
    out += [TensorSpec(f"{p}{n}.weight", (h,), torch.bfloat16, "ones")
            for n in ("input_layernorm", "post_attention_layernorm")]
    return out


def _gpt_oss_layer(config: dict, p: str, std: float) -> list[TensorSpec]:
    h, i, e = config["hidden_size"], config["intermediate_size"], config["num_local_experts"]
    bf, u8, x = torch.bfloat16, torch.uint8, f"{p}mlp.experts."
    return [
        *_attention(config, p, std, bias=True),
        TensorSpec(f"{p}self_attn.sinks", (config["num_attention_heads"],), bf, "normal", 1.0),
        TensorSpec(f"{p}mlp.router.weight", (e, h), bf, "normal", std),
        TensorSpec(f"{p}mlp.router.bias", (e,), bf, "normal", std),
        TensorSpec(f"{x}gate_up_proj_blocks", (e, 2 * i, h // 32, 16), u8, "bytes"),
        TensorSpec(f"{x}gate_up_proj_scales", (e, 2 * i, h // 32), u8, "scales"),
        TensorSpec(f"{x}gate_up_proj_bias", (e, 2 * i), bf, "normal", std),
        TensorSpec(f"{x}down_proj_blocks", (e, h, i // 32, 16), u8, "bytes"),
        TensorSpec(f"{x}down_proj_scales", (e, h, i // 32), u8, "scales"),
        TensorSpec(f"{x}down_proj_bias", (e, h), bf, "normal", std),
    ]


def _qwen3_moe_layer(config: dict, p: str, std: float) -> list[TensorSpec]:
    h, i, e = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]
    bf, d = torch.bfloat16, config["head_dim"]
    out = [*_attention(config, p, std, bias=config.get("attention_bias", False)),
           TensorSpec(f"{p}self_attn.q_norm.weight", (d,), bf, "ones"),
           TensorSpec(f"{p}self_attn.k_norm.weight", (d,), bf, "ones"),
           TensorSpec(f"{p}mlp.gate.weight", (e, h), bf, "normal", std)]
    for j in range(e):
        out += [TensorSpec(f"{p}mlp.experts.{j}.gate_proj.weight", (i, h), bf, "normal", std),
                TensorSpec(f"{p}mlp.experts.{j}.up_proj.weight", (i, h), bf, "normal", std),
                TensorSpec(f"{p}mlp.experts.{j}.down_proj.weight", (h, i), bf, "normal", std)]
    return out


def _mlp(p: str, h: int, i: int, std: float) -> list[TensorSpec]:
    """One SwiGLU MLP's gate/up [i, h] and down [h, i] projections under prefix `p`."""
    return [TensorSpec(f"{p}gate_proj.weight", (i, h), torch.bfloat16, "normal", std),
            TensorSpec(f"{p}up_proj.weight", (i, h), torch.bfloat16, "normal", std),
            TensorSpec(f"{p}down_proj.weight", (h, i), torch.bfloat16, "normal", std)]


def _deepseek_v2_layer(config: dict, p: str, std: float) -> list[TensorSpec]:
    """DeepSeek-V2's layer as the release stores it: MLA without a q LoRA when
    `q_lora_rank` is null (q_proj), the latent projection and its norm, kv_b_proj, o_proj; a
    dense MLP for the first `first_k_dense_replace` layers, else the router, the routed experts
    (one tensor per projection) and the shared experts (one MLP of n_shared x moe_I)."""
    h, heads, bf = config["hidden_size"], config["num_attention_heads"], torch.bfloat16
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    rank, a = config["kv_lora_rank"], f"{p}self_attn."
    out = [TensorSpec(f"{a}kv_a_proj_with_mqa.weight", (rank + rope, h), bf, "normal", std),
           TensorSpec(f"{a}kv_a_layernorm.weight", (rank,), bf, "ones"),
           TensorSpec(f"{a}kv_b_proj.weight", (heads * (nope + v), rank), bf, "normal", std),
           TensorSpec(f"{a}o_proj.weight", (h, heads * v), bf, "normal", std),
           *[TensorSpec(f"{p}{n}.weight", (h,), bf, "ones")
             for n in ("input_layernorm", "post_attention_layernorm")]]
    q_rank = config.get("q_lora_rank")
    if q_rank:
        out += [TensorSpec(f"{a}q_a_proj.weight", (q_rank, h), bf, "normal", std),
                TensorSpec(f"{a}q_a_layernorm.weight", (q_rank,), bf, "ones"),
                TensorSpec(f"{a}q_b_proj.weight", (heads * (nope + rope), q_rank), bf,
                           "normal", std)]
    else:
        out.append(TensorSpec(f"{a}q_proj.weight", (heads * (nope + rope), h), bf, "normal", std))
    if int(p.split(".")[2]) < config.get("first_k_dense_replace", 0):
        return out + _mlp(f"{p}mlp.", h, config["intermediate_size"], std)
    e, i = config["n_routed_experts"], config["moe_intermediate_size"]
    out += [TensorSpec(f"{p}mlp.gate.weight", (e, h), bf, "normal", std),
            *_mlp(f"{p}mlp.shared_experts.", h, config["n_shared_experts"] * i, std)]
    for j in range(e):
        out += _mlp(f"{p}mlp.experts.{j}.", h, i, std)
    return out


def _chunks(spec: TensorSpec, seed: int):
    """The tensor's values as flat chunks of at most CHUNK_ELEMS (dtype `spec.dtype`)."""
    total = math.prod(spec.shape)
    for k, start in enumerate(range(0, total, CHUNK_ELEMS)):
        n = min(CHUNK_ELEMS, total - start)
        if spec.init == "ones":
            yield torch.ones(n, dtype=spec.dtype)
            continue
        key = hashlib.sha256(f"{seed}/{spec.name}/{k}".encode()).digest()[:7]
        g = torch.Generator().manual_seed(int.from_bytes(key, "little"))
        if spec.init == "normal":
            yield torch.randn(n, generator=g).mul_(spec.std).to(spec.dtype)
        elif spec.init == "bytes":
            yield torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
        elif spec.init == "scales":
            lo, hi = MXFP4_SCALE_BYTES
            yield torch.randint(lo, hi + 1, (n,), generator=g, dtype=torch.uint8)
        else:
            raise ValueError(f"unknown init {spec.init!r} of {spec.name}")


def plan_shards(specs: list[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive groups of `specs`, each under `shard_bytes` unless one tensor is larger."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_shard(path: Path, specs: list[TensorSpec], seed: int) -> None:
    """One safetensors file of `specs` (name order), streamed chunk by chunk."""
    specs = sorted(specs, key=lambda s: s.name)
    header, offset = {}, 0
    for s in specs:
        header[s.name] = {"dtype": SAFETENSORS_DTYPES[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for s in specs:
            for chunk in _chunks(s, seed):
                f.write(chunk.view(torch.uint8).numpy().data)


def write_checkpoint(config: dict, dest: Path, seed: int = 0,
                     shard_bytes: int = DEFAULT_SHARD_BYTES, log=print) -> None:
    """Write `config`'s random checkpoint into the existing folder `dest`: the shards, the
    index and config.json (see the module docstring)."""
    specs = tensor_specs(config)
    shards = plan_shards(specs, shard_bytes)
    weight_map = {}
    for k, group in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        log(f"[real_checkpoint] {dest.name}: writing {name} "
            f"({sum(s.nbytes for s in group) / 2**30:.2f} GiB, {len(group)} tensors)")
        write_shard(dest / name, group, seed)
        weight_map.update({s.name: name for s in group})
    total = sum(s.nbytes for s in specs)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (dest / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"},
                                                 indent=2))


def checkpoint_dir(workdir: Path, stem: str, config: dict, seed: int) -> Path:
    """`workdir/<stem>-L<layers>-V<vocab>-<12 hex>`: the hash covers the config, the seed and
    MAKER_VERSION."""
    key = json.dumps({"config": config, "seed": seed, "maker": MAKER_VERSION}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return workdir / (f"{stem}-L{config['num_hidden_layers']}-V{config['vocab_size']}-"
                      f"{digest}")


#: Free disk `ensure_checkpoint` leaves by default: room for the GGUFs made from a real-size
#: checkpoint (bf16 and a quantized one of gpt-oss-20b: 26 GB).
KEEP_FREE_BYTES = 25 * 10**9


def ensure_checkpoint(workdir: Path, stem: str, layers: int | None = None,
                      vocab: int | None = None, seed: int = 0,
                      shard_bytes: int = DEFAULT_SHARD_BYTES, log=print,
                      keep_free: int = KEEP_FREE_BYTES) -> Path:
    """The checkpoint of `shipped_config(stem, layers, vocab)` under `workdir`, made if absent.

    Args:
        keep_free: bytes that must stay free on the disk after the checkpoint (the GGUFs
            made from it come next; tests pass less).

    Raises:
        OSError: fewer free bytes on `workdir`'s disk than the checkpoint plus `keep_free`.
    """
    config = shipped_config(stem, layers, vocab)
    final = checkpoint_dir(workdir, stem, config, seed)
    if (final / "model.safetensors.index.json").is_file():
        return final
    total = sum(s.nbytes for s in tensor_specs(config))
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free
    if free < total + keep_free:
        raise OSError(f"{workdir}: {free / 1e9:.1f} GB free, the checkpoint needs "
                      f"{total / 1e9:.1f} GB and {keep_free / 1e9:.0f} GB are kept free")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=workdir))
    try:
        write_checkpoint(config, tmp, seed, shard_bytes, log)
        tmp.chmod(0o755)  # mkdtemp made it 0700
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors.index.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
