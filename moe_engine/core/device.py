"""The engine's device at startup: `--device` resolved once, and on CUDA the KV cache sized
by --gpu-memory-utilization after one profile forward (`moe_engine.startup.memory`).

EngineCore calls these between building the model and allocating the KV cache (after the
kernels are bound, before the expert-load recorder and phase timer attach, so the profile
forward is counted nowhere).
"""

from __future__ import annotations

import logging

import torch

from kernels.registry import resolve_device
from moe_engine.errors import StartupError
from moe_engine.kv_cache import KVCacheGroup, make_kv_cache_groups
from moe_engine.models.build import BuiltModel
from moe_engine.runner.model_runner import ModelRunner
from moe_engine.runner.sampler import Sampler
from moe_engine.startup.config import EngineConfig
from moe_engine.startup.memory import (
    cuda_device_memory,
    graph_pool_estimate,
    kv_plan_after_profile,
    profile_activation_peak,
)
from moe_engine.startup.plan import Plan

logger = logging.getLogger(__name__)


def engine_device(config: EngineConfig) -> torch.device:
    """The engine's device, resolved once (`--device`; `kernels.registry.resolve_device`):
    "cpu", or the current CUDA device (a rank sets its own with torch.cuda.set_device).

    Raises:
        StartupError: an unknown device, or cuda without a CUDA device (one line).
    """
    try:
        name = resolve_device(config.device.device)
    except ValueError as exc:
        raise StartupError(str(exc)) from exc
    if name == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def kv_groups_of(built: BuiltModel, block_size: int) -> list[KVCacheGroup]:
    """The KV-cache groups of a built model (its layers by attention kind, equal-sized)."""
    spec = built.spec
    return make_kv_cache_groups(
        built.attention_groups,
        block_size=block_size,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        dtype=built.dtype,
        kv_lora_rank=spec.kv_lora_rank,
        qk_rope_head_dim=spec.qk_rope_head_dim,
        index_head_dim=spec.index_head_dim,
    )


def plan_kv_on_device(
    config: EngineConfig,
    built: BuiltModel,
    kv_groups: list[KVCacheGroup],
    device: torch.device,
    graph_batch: int | None = None,
    graphs_off: str = "no CUDA graphs",
) -> Plan:
    """The plan with KV blocks sized by --gpu-memory-utilization: weights as allocated, the
    activation peak of one profile forward at max_num_batched_tokens (on a runner whose cache
    is the null block only, dropped afterwards), the decode graphs' pool (`memory.
    graph_pool_estimate`: the peak of a decode forward of `graph_batch` requests over
    max_model_len keys, when graphs will be captured), then the device's memory.

    Args:
        graph_batch: the largest decode batch to capture (`cuda_graphs.capture_sizes`); None
            when graphs are off, for the reason `graphs_off` (printed in the plan).

    Raises:
        StartupError: one max_model_len request does not fit (`memory.size_kv_cache`).
    """
    weight_bytes = torch.cuda.memory_allocated(device)
    probe = ModelRunner(
        built.model, 0, config.cache.block_size, built.dtype, Sampler(), kv_groups, device
    )
    sched = config.scheduler

    def run() -> None:
        probe.profile_run(sched.max_num_batched_tokens, sched.max_num_seqs, built.max_model_len)

    def decode() -> None:
        probe.dummy_run([1] * graph_batch, built.max_model_len, graph_batch)

    pool, note = None, f"off: {graphs_off}"
    if graph_batch is not None:
        pool = lambda: graph_pool_estimate(profile_activation_peak(decode, device))  # noqa: E731
        note = f"estimated: a decode step of {graph_batch} requests"
    plan = kv_plan_after_profile(
        built.plan,
        utilization=config.device.gpu_memory_utilization,
        max_model_len=built.max_model_len,
        weight_bytes=weight_bytes,
        profile=lambda: profile_activation_peak(run, device),
        memory=lambda: cuda_device_memory(device),
        graph_pool=pool,
        graph_note=note,
    )
    logger.info("startup plan (KV cache sized on %s):\n%s", device, plan.describe())
    return plan
