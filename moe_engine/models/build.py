"""`build_model`: config.json -> architecture -> startup plan -> module -> experts sharded ->
weights loaded -> experts quantized, one rank's model ready to serve.

The order is the startup's (DESIGN.md section 10): the plan is made and checked from
config.json before any weight is read, so a configuration that cannot fit fails in seconds
with its numbers. `EngineCore` builds its scheduler, KV cache and runner on what this returns.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from kernels.plan import EXPERT_OPS, KernelPlan
from moe_engine.errors import StartupError
from moe_engine.kv_cache.spec import AttentionGroup
from moe_engine.models import resolve_architecture
from moe_engine.models.base import MoeCausalLM
from moe_engine.models.dense_quant import quantize_dense_layers
from moe_engine.models.hf_config import load_hf_config
from moe_engine.models.kernel_binding import bind_kernels, model_facts, plan_kernels
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.loader import load_model, no_random_init
from moe_engine.models.materialize import materialize, on_meta
from moe_engine.models.spec import ArchSpec
from moe_engine.startup.config import EngineConfig, read_config_json
from moe_engine.startup.env import compute_dtype
from moe_engine.startup.host_memory import HostMemory, read_host_memory, release_free_heap
from moe_engine.startup.memory import DeviceMemory, check_weights_fit
from moe_engine.startup.plan import Plan, make_plan
from moe_engine.startup.progress import StartupProgressFn
from moe_engine.startup.rank_context import RankContext
from quant.compressed_tensors import CompressedTensorsConfig, parse_quantization_config
from quant.fp8 import Fp8BlockConfig, parse_fp8_config

logger = logging.getLogger(__name__)


@dataclass
class BuiltModel:
    """One rank's loaded model and what was decided on the way.

    Attributes:
        model: the loaded model (eval mode, this rank's experts, quantized if asked).
        spec: its numbers; architecture: the config.json architecture it runs as.
        hf_config: the transformers config read from config.json.
        plan: the startup plan (weights, KV blocks), already checked.
        attention_groups: the layers by attention kind (`kv_cache_groups_for`).
        max_model_len: longest request (tokens).
        weight_dtype: the dtype asked for (--dtype); dtype: the one computed in
            (`startup.env.compute_dtype`), also the KV cache's.
        kernels: the backend of every kernel op (kernels/registry.py), bound to the modules.
    """

    model: MoeCausalLM
    spec: ArchSpec
    architecture: str
    hf_config: Any
    plan: Plan
    attention_groups: list[AttentionGroup]
    max_model_len: int
    weight_dtype: torch.dtype
    dtype: torch.dtype
    kernels: KernelPlan


def _no_progress(phase: str, detail: str = "", eta_s: float | None = None) -> None:
    """The progress callback of a build nobody watches."""


def read_architecture(model_dir: str) -> tuple[Any, str, type[MoeCausalLM], ArchSpec]:
    """config.json -> (transformers config, architecture name, model class, spec), reading no
    weight: what `build_model` starts from, and what `moe-serve` checks before it starts
    anything (`cli.serve.check_checkpoint`).

    The config.json dict is read by the architecture's `shape_fields` as written too, so a
    field transformers would fill with its default (DeepSeek's kv_lora_rank, q_lora_rank) is
    refused by name when it is missing.

    Raises:
        StartupError: an unsupported architecture or rope type, config.json unreadable;
            ValueError: a config field the architecture cannot serve (e.g. n_routed_experts
            not divisible by n_group), named.
    """
    # config.json only; a checkpoint's own Python code (auto_map) is never run.
    hf_config = load_hf_config(model_dir)
    architecture, model_cls = resolve_architecture(hf_config)
    model_cls.model_shape(read_config_json(model_dir))
    return hf_config, architecture, model_cls, model_cls.arch_spec(hf_config)


def sizes_kv_on_device(config: EngineConfig, device: torch.device) -> bool:
    """Whether the KV cache is sized by --gpu-memory-utilization after a profile run: on
    CUDA, unless --kv-cache-memory or num_blocks_override fixes it."""
    cache = config.cache
    return (
        device.type == "cuda" and cache.kv_cache_memory is None
        and cache.num_blocks_override is None
    )


def build_model(
    config: EngineConfig,
    rank_context: RankContext | None = None,
    progress: StartupProgressFn | None = None,
    device: torch.device | None = None,
    device_memory: DeviceMemory | None = None,
) -> BuiltModel:
    """Plan, build, shard, load and quantize one rank's model on `device`.

    The modules are built on the meta device and given storage on `device` directly
    (`models.materialize`); each checkpoint tensor is read, moved to `device`, converted and
    copied into its parameter, and with --quantization each layer's experts are quantized as
    soon as they are complete (`quantize_complete_layer`). The host holds about one tensor
    (plus the memory map's window) at a time, not the model; the device holds the model plus
    at most one layer of float experts.

    Args:
        config: the engine configuration, its QuantConfig already resolved against config.json
            (`quant_config.resolve_quant_config`).
        rank_context: under expert parallelism, this rank's experts and communicator.
        progress: told the phases "planning memory", "loading weights" (float experts are
            quantized layer by layer meanwhile) and (when experts are quantized at load)
            "quantizing experts" (the rest: dense layers, checks).
        device: where the weights go (default CPU; `kernels.registry.resolve_device`).
        device_memory: the CUDA device's memory before loading (`memory.cuda_device_memory`);
            when the KV cache is sized on the device (`sizes_kv_on_device`), weights that
            alone exceed --gpu-memory-utilization x total are refused before loading.

    Raises:
        StartupError: unsupported architecture, a KV cache too small for one max_model_len
            request, weights beyond the device budget, missing or mis-shaped weights, a
            quantization that does not fit.
    """
    progress = progress or _no_progress
    device = device or torch.device("cpu")
    progress("planning memory", "", None)
    model_dir = config.model.model
    hf_config, architecture, model_cls, spec = read_architecture(model_dir)
    check_linear_attention(spec, config)  # before MTP: its refusal would advise ngram
    spec = with_mtp(spec, model_cls, hf_config, config)
    max_model_len = config.model.max_model_len or spec.max_position_embeddings
    weight_dtype = config.model.torch_dtype()
    dtype = compute_dtype(weight_dtype) if device.type == "cpu" else weight_dtype
    if dtype != weight_dtype:
        logger.warning(
            "this CPU has no native bfloat16 matmul (AVX512-BF16/AMX): weights are rounded "
            "to bfloat16 and computed in float32 (MOE_ENGINE_FORCE_BF16=1 keeps bfloat16)"
        )
    attention_groups = model_cls.kv_cache_groups_for(spec)
    kernels = plan_kernels(
        device.type, config.kernel_backend, model_facts(spec, dtype), progress
    )
    plan = make_plan(
        spec,
        dtype,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        attention_groups=attention_groups,
        block_size=config.cache.block_size,
        max_model_len=max_model_len,
        kv_cache_memory=config.cache.kv_cache_memory,
        num_blocks_override=config.cache.num_blocks_override,
        ep_size=config.parallel.ep_size,
        num_local_experts=len(rank_context.local_experts) if rank_context else None,
        max_num_seqs=config.scheduler.max_num_seqs,
        expert_bits_per_weight=config.quant.bits_per_weight,
        dense_bits_per_weight=(config.quant.bits_per_weight or 4.5)
        if config.quant.layers == "all" else None,
        packed_bytes_per_weight=kernels.linear_copy_bytes(weight_dtype),
        expert_copy_bytes_per_weight=kernels.expert_copy_bytes(weight_dtype)
        if config.quant.method == "none" else 0.0,
        # on a device the KV cache is sized there (`memory`), not from the host
        host=read_host_memory() if device.type == "cpu" else HostMemory.unlimited(),
        cpu_memory_utilization=config.device.cpu_memory_utilization,
        ranks_on_host=ranks_on_host(config),
        shrink_to_fit=config.model.max_model_len is None,
    )
    max_model_len = plan.max_model_len
    if plan.max_model_len_note:
        logger.warning("%s", plan.max_model_len_note)
    if device.type != "cpu":
        plan = replace(plan, host=None)
    plan = _check_plan(plan, config, device, device_memory, max_model_len, kernels)
    model = build_on_meta(model_cls, spec, dtype, max_model_len, rank_context)
    materialize(model, device)
    progress("loading weights", model_dir, None)
    checkpoint_quant = _checkpoint_quant(config)
    if isinstance(checkpoint_quant, Fp8BlockConfig):
        b0, b1 = checkpoint_quant.weight_block_size
        logger.info(
            "FP8 block-quantized checkpoint (e4m3, %dx%d blocks, %s scales): weights are "
            "dequantized to %s while loading%s", b0, b1, checkpoint_quant.scale_fmt,
            str(weight_dtype).removeprefix("torch."),
            f", then the routed experts quantized to {config.quant.method}"
            if config.quant.method != "none" else "",
        )
    load_model(model, model_dir, weight_dtype, checkpoint_quant, device=device,
               on_experts_loaded=lambda moe: quantize_complete_layer(moe, config))
    if config.quant.method != "none":
        progress("quantizing experts", config.quant.method, None)
    quantize_experts(model, config)
    bind_kernels(model, kernels)
    if device.type == "cpu":
        release_free_heap()  # the load's and the packing's temporaries
    return BuiltModel(
        model, spec, architecture, hf_config, plan, attention_groups, max_model_len,
        weight_dtype, dtype, kernels,
    )


def build_on_meta(
    model_cls: type[MoeCausalLM],
    spec: ArchSpec,
    dtype: torch.dtype,
    max_model_len: int,
    rank_context: RankContext | None,
) -> MoeCausalLM:
    """The model's modules on the meta device (no storage; `models.materialize`), its
    experts sharded to this rank's slots (`FusedMoE.shard_experts`) there too."""
    with on_meta(), no_random_init():
        model = model_cls(spec, dtype, max_position=max_model_len).eval()
        if rank_context is not None:
            for _, moe in model.moe_layers():
                moe.shard_experts(
                    rank_context.local_experts, rank_context.communicator, rank_context.rank
                )
    return model


def quantize_complete_layer(moe: FusedMoE, config: EngineConfig) -> None:
    """Quantize one MoE block's float experts as soon as the loader has them all
    (`WeightLoader.on_experts_loaded`), when --quantization asks for it and the checkpoint
    stores them in float: the float stacks are dropped before the next layer's arrive.

    Raises:
        StartupError: a group size that does not divide the dimension it groups.
    """
    method = config.quant.method
    if method == "none" or config.quant.checkpoint_format is not None:
        return
    scale_dtype = getattr(torch, config.quant.scale_dtype or "float32")
    try:
        moe.quantize(method, config.quant.group_size, scale_dtype)
    except ValueError as e:
        raise StartupError(f"--quantization {method}: {e}") from e


def ranks_on_host(config: EngineConfig) -> int:
    """Engine ranks that share this host's memory: the expert-parallel ranks spread evenly
    over --nnodes machines (the elastic launcher starts ep_size / nnodes per node)."""
    parallel = config.parallel
    return max(1, math.ceil(parallel.ep_size / max(1, parallel.nnodes)))


def with_mtp(
    spec: ArchSpec, model_cls: type[MoeCausalLM], hf_config: Any, config: EngineConfig
) -> ArchSpec:
    """`spec` with the checkpoint's MTP layers (`num_mtp_layers`) when speculative decoding
    asks for them (`--speculative-method mtp`); else as it is.

    Raises:
        StartupError: the architecture has no MTP layers this engine builds, config.json says
            the checkpoint has none, or expert parallelism is on (not supported with MTP).
    """
    if config.speculative.method != "mtp":
        return spec
    field = model_cls.mtp_layers_field
    count = int(getattr(hf_config, field, 0) or 0) if field else 0
    if count < 1:
        why = (f"config.json {field} is {count}" if field
               else f"{spec.architecture} has no multi-token-prediction layers this engine "
               "builds")
        raise StartupError(
            f"speculative_method 'mtp': {why} (MTP drafts need the checkpoint's MTP layers, as "
            "DeepSeek-V3 and GLM-4.5 ship them); use speculative_method 'ngram'"
        )  # fmt: skip
    if not _has_layer(config.model.model, spec.num_layers):
        raise StartupError(
            f"speculative_method 'mtp': config.json {field} is {count}, but the checkpoint has "
            f"no model.layers.{spec.num_layers}.* tensors (transformers drops the MTP layers "
            "when it saves a model); use speculative_method 'ngram'"
        )
    if config.parallel.ep_size > 1:
        raise StartupError(
            f"speculative_method 'mtp' with ep_size {config.parallel.ep_size}: MTP drafts run "
            "with expert parallelism off only (ep_size 1); n-gram drafts work at any ep_size"
        )
    logger.info(
        "MTP drafts: %d MTP layer(s) from the checkpoint (%s), the first chained for up to %d "
        "drafts; their KV cache joins the first KV-cache group", count, field,
        config.speculative.num_speculative_tokens,
    )  # fmt: skip
    return replace(spec, num_mtp_layers=count)


def check_linear_attention(spec: ArchSpec, config: EngineConfig) -> None:
    """Refuse what a model with linear-attention layers cannot do: their per-request state
    covers exactly the tokens the request computed, so neither cached blocks (prefix caching)
    nor rejected drafts (speculative decoding, which would need the state before the drafts
    back) can be handled without state snapshots, which this engine does not keep.

    Raises:
        StartupError: naming the flag, the layers and the reason.
    """
    linear = spec.linear_attention_layers()
    if not linear:
        return
    which = (f"{len(linear)} of its {spec.num_layers} layers are linear attention "
             f"({spec.linear_mixer})")
    if config.cache.enable_prefix_caching:
        raise StartupError(
            f"--enable-prefix-caching: {spec.architecture}: {which}, whose per-request state "
            f"is not in the KV blocks a prefix hit would reuse; serve it without prefix caching"
        )
    if config.speculative.enabled:
        raise StartupError(
            f"--speculative-method {config.speculative.method}: {spec.architecture}: {which}, "
            f"whose state cannot be rolled back past rejected drafts; serve it without "
            f"speculative decoding"
        )


def _has_layer(model_dir: str, index: int) -> bool:
    """Whether the checkpoint holds any tensor of decoder layer `index` (names only read)."""
    from safetensors import safe_open

    from moe_engine.models.loader import safetensors_files

    prefix = f"model.layers.{index}."
    for path in safetensors_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            if any(k.startswith(prefix) for k in f.keys()):  # noqa: SIM118
                return True
    return False


def ops_used(config: EngineConfig, mla: bool) -> set[str]:
    """The kernel registry's ops this model runs: its experts' format, MLA or paged attention,
    and the dense ops every model has."""
    experts = EXPERT_OPS.get(config.quant.method, "fused_moe")
    attention = {"mla_decode"} if mla else {"attention_prefill", "attention_decode"}
    return {experts, *attention, "linear", "rms_norm", "rotary", "router_topk", "decode_layer"}


def _check_plan(
    plan: Plan,
    config: EngineConfig,
    device: torch.device,
    device_memory: DeviceMemory | None,
    max_model_len: int,
    kernels: KernelPlan,
) -> Plan:
    """Log (with the kernel backends) and check the startup plan before any weight is read.

    On a CPU (and on CUDA with --kv-cache-memory / num_blocks_override) the plan's blocks are
    final and `Plan.check` runs. When the CUDA device sizes the KV cache, only the context
    length and the weights against --gpu-memory-utilization x total are checked here; the
    blocks follow the profile run (`EngineCore`, `memory.size_kv_cache`).

    Raises:
        StartupError: from `Plan.check` / `memory.check_weights_fit`.
    """
    util = config.device.gpu_memory_utilization
    used = ops_used(config, bool(plan.shape.kv_lora_rank))
    if device.type == "cpu":
        plan = replace(plan, device_lines=(
            f"device: cpu (--gpu-memory-utilization {util:g} applies to cuda only; the KV "
            f"cache is sized by --cpu-memory-utilization or --kv-cache-memory)",
        ))
    if not sizes_kv_on_device(config, device):
        logger.info("startup plan:\n%s\n%s", plan.describe(), kernels.describe(used))
        plan.check(max_model_len)
        return plan
    plan.check_context(max_model_len)
    lines = plan.describe().splitlines()[:-1]  # the blocks line waits for the profile run
    logger.info(
        "startup plan:\n%s\nKV blocks: sized after a profile run (--gpu-memory-utilization "
        "%g on %s)\n%s", "\n".join(lines), util, device, kernels.describe(used),
    )
    if device_memory is not None:
        check_weights_fit(device_memory, util, plan.weight_bytes)
    return plan


def _checkpoint_quant(config: EngineConfig) -> CompressedTensorsConfig | Fp8BlockConfig | None:
    """config.json's compressed-tensors or FP8 block config (None when it has neither).

    Raises:
        StartupError: an unsupported quantization_config.
    """
    try:
        hf_config = config.model.hf_config()
        return parse_quantization_config(hf_config) or parse_fp8_config(hf_config)
    except ValueError as e:
        raise StartupError(str(e)) from e


def quantize_experts(model: MoeCausalLM, config: EngineConfig) -> None:
    """Quantize the routed experts to 4 bits when --quantization asks for it (or check that
    the checkpoint's 4-bit experts all arrived, `check_prequantized`), and with
    --quantized-layers all the dense projections too (`dense_quant.quantize_dense_layers`).

    Raises:
        StartupError: a group size that does not divide the dimension it groups.
    """
    method = config.quant.method
    if method == "none":
        return
    scale_dtype = getattr(torch, config.quant.scale_dtype or "float32")
    if config.quant.checkpoint_format is not None:
        check_prequantized(model, config)
        if config.quant.layers == "all":
            quantize_dense_layers(model, method, config.quant.group_size, scale_dtype)
        return
    experts = [moe for _, moe in model.moe_layers()]
    for moe in experts:  # those the loader did not quantize as they completed
        if moe.quantized is None:
            quantize_complete_layer(moe, config)
    nbytes = sum(m.quantized.nbytes for m in experts)
    logger.info("experts quantized to %s: %.1f MiB", method, nbytes / 2**20)
    if config.quant.layers == "all":
        quantize_dense_layers(model, method, config.quant.group_size, scale_dtype)


def check_prequantized(model: MoeCausalLM, config: EngineConfig) -> None:
    """Every MoE layer got its experts 4-bit from the checkpoint (int4 at the configured
    group size, or mxfp4).

    Raises:
        StartupError: a layer whose expert tensors were not all stored quantized, or a
            group size other than config.json's (names the layer and both numbers).
    """
    q = config.quant
    layers = model.moe_layers()
    for index, moe in layers:
        where = f"layer {index} ({q.checkpoint_format} checkpoint)"
        if moe.quantized is None:
            raise StartupError(
                f"{where}: config.json declares {q.method} experts, but not all of this "
                f"layer's expert tensors are stored quantized"
            )
        if moe.quantized.group_size != q.group_size:
            raise StartupError(
                f"{where}: expert group size {moe.quantized.group_size}, config.json says "
                f"{q.group_size}"
            )
    nbytes = sum(moe.quantized.nbytes for _, moe in layers)
    logger.info(
        "experts loaded %s (group %d, %s) from the checkpoint: %.1f MiB", q.method,
        q.group_size, "symmetric" if q.symmetric else "asymmetric", nbytes / 2**20,
    )
