"""build_engine_core: build, load and wire one rank's engine core from its configuration.

Startup order (DESIGN.md section 10): the architecture from config.json, the kernel backends
(kernels/registry.py; the native CPU kernels built once, then cached), config arithmetic
(`plan.py`, fails fast with numbers), then weights with a progress bar, then the KV cache.
Each phase is told to the `progress` callback, which the core process forwards to the front end
as StartupProgress (what health and UNAVAILABLE messages say while it starts). The parts are
handed to `EngineCore`, which only runs them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from moe_engine.core.device import engine_device, kv_groups_of, plan_kv_on_device
from moe_engine.core.engine_core import EngineCore
from moe_engine.core.tokenizer import load_tokenizer
from moe_engine.errors import StartupError
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.kv_cache import KVCacheManager
from moe_engine.kv_cache.state import StateSlotPool
from moe_engine.models import resolve_quant_config
from moe_engine.models.build import BuiltModel, build_model, ops_used, sizes_kv_on_device
from moe_engine.phase_timer import PhaseTimer
from moe_engine.runner.cuda_graphs import (
    CudaGraphCapture,
    GraphCapture,
    capture_sizes,
    graphs_off_reason,
)
from moe_engine.runner.model_runner import ModelRunner
from moe_engine.runner.routed_experts import RoutingReplay
from moe_engine.runner.sampler import Sampler
from moe_engine.runner.spec_decode.drafter import Drafter
from moe_engine.runner.warmup import (
    dummy_steps,
    mla_decode_splits,
    paged_decode_splits,
    warm_up,
    warm_up_skip_reason,
)
from moe_engine.scheduler import Scheduler
from moe_engine.skew.trace import PeriodicTraceWriter
from moe_engine.startup.checks import check_routing_replay
from moe_engine.startup.config import EngineConfig
from moe_engine.startup.env import default_threads
from moe_engine.startup.memory import cuda_device_memory
from moe_engine.startup.plan import Plan
from moe_engine.startup.progress import StartupProgressFn
from moe_engine.startup.rank_context import RankContext
from moe_engine.structured_output import StructuredOutputManager
from quant.compressed_tensors import parse_quantization_config
from quant.fp8 import parse_fp8_config

logger = logging.getLogger(__name__)


def build_engine_core(
    config: EngineConfig,
    rank_context: RankContext | None = None,
    *,
    progress: StartupProgressFn | None = None,
    graph_capture: GraphCapture | None = None,
) -> EngineCore:
    """Build one rank's engine core: model, KV cache, scheduler, runner, graphs, drafter.

    Args:
        config: the engine configuration.
        rank_context: set on the ranks of an expert-parallel group (ep_size > 1): the model
            keeps only this rank's experts, and every `step` runs a forward pass (a zero-token
            one when nothing is scheduled) so that all ranks stay in lockstep.
        progress: told each startup phase (phase, detail, seconds left or None); any thread
            may call it (the kernel build reports from its own).
        graph_capture: how decode graphs are captured (`moe_engine.runner.cuda_graphs`); None:
            the real `CudaGraphCapture`. Tests pass `EagerReplayCapture` to run the graph path
            on a CPU. Whether graphs apply is decided once here and logged ("CUDA graphs: ...").

    Raises:
        StartupError: unsupported architecture, a KV cache too small for one max_model_len
            request, missing weights (messages give the numbers and the flags that fix them).
    """
    progress = progress or _no_progress
    config = _resolve_quant(config)
    device = engine_device(config)
    torch.set_num_threads(config.parallel.num_threads or default_threads())
    device_memory = cuda_device_memory(device) if device.type == "cuda" else None
    built = build_model(config, rank_context, progress, device, device_memory)
    spec, model_dir = built.spec, config.model.model
    kv_groups = kv_groups_of(built, config.cache.block_size)
    ep_size = rank_context.ep_size if rank_context is not None else 1
    capture = graph_capture or CudaGraphCapture()
    graphs_off = _graphs_off(config, built, kv_groups, device, ep_size, capture)
    if sizes_kv_on_device(config, device):  # before the recorder and timer attach
        progress("profiling activation memory", str(device), None)
        sched = config.scheduler
        top = capture_sizes(sched.max_num_seqs, sched.max_num_batched_tokens)[-1]
        built.plan = plan_kv_on_device(
            config, built, kv_groups, device, None if graphs_off else top, graphs_off or ""
        )
    plan = built.plan = agree_on_blocks(built.plan, rank_context)
    built.max_model_len = plan.max_model_len
    timer, expert_load, trace = _instruments(config, built, rank_context, device)
    progress("loading the tokenizer", "", None)
    tokenizer = load_tokenizer(config.model.tokenizer_path)
    progress("allocating the KV cache", f"{plan.num_blocks} blocks", None)
    eos_token_ids = eos_token_ids_of(model_dir, built.hf_config)
    kv = KVCacheManager(
        [g.spec for g in kv_groups],
        plan.num_blocks,
        enable_prefix_caching=config.cache.enable_prefix_caching,
        state_slots=StateSlotPool(plan.num_state_slots) if plan.num_state_slots else None,
    )
    scheduler = Scheduler(config.scheduler, kv, config.speculative.num_lookahead_tokens)
    sampler = Sampler(config.model.seed, config.scheduler.max_num_seqs)
    structured_output = StructuredOutputManager(tokenizer, spec.vocab_size, eos_token_ids)
    runner = _runner(config, built, kv_groups, sampler, device, timer, capture, graphs_off,
                     progress)
    if config.scheduler.stream_interval > 1:
        logger.info("stream interval: a request's tokens are sent every %d tokens (the first "
                    "at once, the rest with the final output)", config.scheduler.stream_interval)
    drafter = _drafter(config)
    return EngineCore(
        config, built, rank_context=rank_context, device=device, timer=timer,
        expert_load=expert_load, trace=trace, tokenizer=tokenizer, eos_token_ids=eos_token_ids,
        kv=kv, scheduler=scheduler, sampler=sampler, structured_output=structured_output,
        runner=runner, graph_capture=capture, drafter=drafter,
    )


def agree_on_blocks(plan: Plan, rank_context: RankContext | None) -> Plan:
    """Under expert parallelism every rank runs the same scheduler on its own KV pool, so all
    pools must have the same number of blocks and the same max_model_len: each rank sized its
    pool (and, without --max-model-len, the length) from the memory it saw (`host_memory`,
    which other ranks' loading changes), and all take the smallest of each (an all-reduce MIN
    over the default process group, which the lockstep ranks share). The plan as it is with
    one rank, or when every rank planned the same."""
    if rank_context is None or rank_context.ep_size == 1 or not dist.is_initialized():
        return plan
    sizes = torch.tensor([plan.num_blocks, plan.max_model_len], dtype=torch.int64)
    dist.all_reduce(sizes, op=dist.ReduceOp.MIN)
    fewest, shortest = (int(v) for v in sizes.tolist())
    if (fewest, shortest) == (plan.num_blocks, plan.max_model_len):
        return plan
    logger.info("KV blocks: %d, max_model_len %d: the smallest any rank can hold (this rank "
                "planned %d, %d)", fewest, shortest, plan.num_blocks, plan.max_model_len)
    return replace(
        plan, num_blocks=fewest, max_model_len=shortest,
        max_concurrent_tokens=fewest * plan.block_size,
        kv_cache_memory=fewest * plan.kv_bytes_per_block,
        kv_cache_source=f"{plan.kv_cache_source}, the fewest of the {rank_context.ep_size} ranks",
    )


def _instruments(
    config: EngineConfig, built: BuiltModel, rank_context: RankContext | None,
    device: torch.device,
) -> tuple[PhaseTimer, ExpertLoadRecorder, PeriodicTraceWriter | None]:
    """The phase timer and the expert-load recorder, attached to the model, and this rank's
    own expert trace writer (None under expert parallelism or without --expert-trace)."""
    spec, model_dir = built.spec, config.model.model
    ep_size = rank_context.ep_size if rank_context is not None else 1
    timer = PhaseTimer()
    built.model.attach_timer(timer)
    # group-limited routing (GLM-4.5, DeepSeek): the trace and reports show per-group load
    n_group = getattr(spec, "n_group", None)
    expert_load = ExpertLoadRecorder(
        sorted(spec.moe_layers), spec.num_experts, ep_size,
        n_group=n_group if n_group and n_group > 1 else None,
        device=device,
    )
    # One rank writes its own trace; under EP rank 0's loop writes the summed one.
    trace = None
    if config.expert_trace and rank_context is None:
        trace = PeriodicTraceWriter(
            config.expert_trace,
            sorted(spec.moe_layers),
            spec.num_experts,
            meta=dict(model=model_dir, top_k=spec.top_k, **expert_load.layout_meta()),
        )
    for index, moe in built.model.moe_layers():
        moe.attach_recorder(expert_load, index)
    return timer, expert_load, trace


def _graphs_off(
    config: EngineConfig, built: BuiltModel, kv_groups: list, device: torch.device,
    ep_size: int, capture: GraphCapture,
) -> str | None:
    """Why decode steps run without graphs (`graphs_off_reason`), None when they are
    captured: decided before the KV cache is sized, which leaves room for their pool."""
    return graphs_off_reason(
        device, enforce_eager=config.device.enforce_eager, kernels=built.kernels,
        kv_kinds=[g.spec.kind for g in kv_groups]
        + (["linear_attention"] if built.plan.num_state_slots else []),
        quant_method=config.quant.method,
        ep_size=ep_size, capture_devices=capture.device_types,
    )  # fmt: skip


def _runner(
    config: EngineConfig, built: BuiltModel, kv_groups: list, sampler: Sampler,
    device: torch.device, timer: PhaseTimer, capture: GraphCapture, graphs_off: str | None,
    progress: StartupProgressFn,
) -> ModelRunner:
    """The model runner over the KV cache groups, its step inputs reserved, its Triton
    kernels compiled (`_warm_up_kernels`) and its decode graphs captured unless `graphs_off`
    says why not (logged).

    Raises:
        StartupError: a graph capture failed.
    """
    plan = built.plan
    runner = ModelRunner(
        built.model,
        plan.num_blocks,
        config.cache.block_size,
        built.dtype,
        sampler,
        kv_groups=kv_groups,
        device=device,
        scratch_block=graphs_off is None,
        num_speculative_tokens=config.speculative.num_speculative_tokens,
        disable_drafts_at=config.speculative.disable_by_batch_size,
        num_state_slots=plan.num_state_slots,
    )
    sched = config.scheduler
    runner.reserve_inputs(sched.max_num_batched_tokens, sched.max_num_seqs, built.max_model_len)
    if config.enable_return_routed_experts:  # before graphs: they write its device buffer
        runner.routing_replay = _routing_replay(config, built, kv_groups, runner)
    _warm_up_kernels(config, built, runner, device, progress)
    timer.reset()
    _capture_graphs(config, runner, timer, built.max_model_len, graphs_off, capture, progress)
    if runner.decode_graphs is not None and plan.graph_pool_bytes:
        _check_graph_pool(runner.decode_graphs.memory_bytes, plan.graph_pool_bytes)
    return runner


def _routing_replay(
    config: EngineConfig, built: BuiltModel, kv_groups: list, runner: ModelRunner
) -> RoutingReplay:
    """The routing-replay capture and store (`runner.routed_experts`), logged with its bytes.

    Raises:
        StartupError: a model without MoE layers or without a KV-cache group that keeps every
            block of a request, or a decode instance of a prefill/decode split (its prompts
            ran on the prefill instance, so it could not return their routing).
    """
    check_routing_replay(config)  # moe-serve checked it before loading; LLM and tests here
    sched, block_size = config.scheduler, config.cache.block_size
    physical = built.plan.num_blocks + 1 + (runner.scratch_block is not None)
    capacity = max(sched.max_num_batched_tokens,
                   sched.max_num_seqs * (1 + config.speculative.num_speculative_tokens))
    try:
        replay = RoutingReplay(built.model, [g.spec for g in kv_groups], physical * block_size,
                               block_size, capacity, runner.device)
    except ValueError as e:
        raise StartupError(str(e)) from e
    logger.info("%s", replay.describe())
    return replay


def _check_graph_pool(took: int, estimate: int) -> None:
    """Log the decode graphs' memory against the plan's estimate (`memory.
    graph_pool_estimate`); warn when they took more than the KV budget left room for."""
    if took <= estimate:
        logger.info("CUDA graphs took %.0f MiB of the %.0f MiB the plan left for them",
                    took / 2**20, estimate / 2**20)
        return
    logger.warning(
        "CUDA graphs took %.0f MiB, %.0f MiB more than the plan's estimate: the engine uses "
        "that much beyond --gpu-memory-utilization (lower it, or pass --enforce-eager)",
        took / 2**20, (took - estimate) / 2**20,
    )  # fmt: skip


def _warm_up_kernels(
    config: EngineConfig, built: BuiltModel, runner: ModelRunner, device: torch.device,
    progress: StartupProgressFn,
) -> None:
    """Compile every Triton kernel variant a step can launch before the first request
    (`runner.warmup`): dummy forwards on the null KV block, after the profile run and before
    graph capture; skipped (logged at debug) off CUDA, without Triton ops or under Triton's
    interpreter."""
    spec, sched = built.spec, config.scheduler
    mla = bool(spec.kv_lora_rank)
    skip = warm_up_skip_reason(device, built.kernels, ops_used(config, mla))
    if skip is not None:
        logger.debug("Triton warm-up: off (%s)", skip)
        return
    decode_op = "mla_decode" if mla else "attention_decode"
    splits_of = None
    if built.kernels.compiled_on_launch([decode_op]):
        splits_of = mla_decode_splits(spec.num_heads) if mla else paged_decode_splits(
            spec.num_kv_heads
        )
    steps = dummy_steps(
        max_num_batched_tokens=sched.max_num_batched_tokens, max_num_seqs=sched.max_num_seqs,
        max_model_len=built.max_model_len, block_size=config.cache.block_size,
        splits_of=splits_of,
    )  # fmt: skip
    progress("compiling Triton kernels", f"{len(steps)} dummy steps", None)
    warm_up(
        lambda s: runner.dummy_run(s.q_lens, s.context_len, min(sched.max_num_seqs, len(s.q_lens))),
        steps,
    )


def eos_token_ids_of(model_dir: str, hf_config) -> frozenset[int]:
    """EOS ids from generation_config.json (preferred) or config.json; int or list accepted."""
    ids: set[int] = set()
    gen = Path(model_dir) / "generation_config.json"
    sources = [getattr(hf_config, "eos_token_id", None)]
    if gen.is_file():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return frozenset(ids)


def _resolve_quant(config: EngineConfig) -> EngineConfig:
    """`config` with its QuantConfig resolved against config.json (`resolve_quant_config`);
    an unsupported quantization_config is refused here, before the kernels are prepared.

    Raises:
        StartupError: an unsupported quantization_config, or flags that conflict with it.
    """
    try:
        hf_config = config.model.hf_config()
    except FileNotFoundError:
        return config  # AutoConfig reports the missing checkpoint
    try:
        quant = resolve_quant_config(config.quant, hf_config, config.model.torch_dtype())
        parse_quantization_config(hf_config) or parse_fp8_config(hf_config)
    except ValueError as e:
        raise StartupError(str(e)) from e
    return replace(config, quant=quant)


def _capture_graphs(
    config: EngineConfig,
    runner: ModelRunner,
    timer: PhaseTimer,
    max_model_len: int,
    off_reason: str | None,
    capture: GraphCapture,
    progress: StartupProgressFn,
) -> None:
    """Capture the decode graphs when they apply; log the decision in one line either way.
    The phase timer forgets the capture's forwards.

    Raises:
        StartupError: a capture failed (naming the batch size and --enforce-eager).
    """
    if off_reason is not None:
        logger.info("CUDA graphs: off (%s)", off_reason)
        return
    sched = config.scheduler
    sizes = capture_sizes(sched.max_num_seqs, sched.max_num_batched_tokens)
    progress("capturing CUDA graphs", f"decode batch sizes {sizes}", None)
    try:
        graphs = runner.capture_decode_graphs(sizes, max_model_len, capture)
    except RuntimeError as exc:
        raise StartupError(
            f"CUDA graph capture failed at {exc}; pass --enforce-eager to run every step "
            "eagerly"
        ) from exc
    timer.reset()
    logger.info("%s", graphs.describe())


def _drafter(config: EngineConfig) -> Drafter | None:
    """The speculative decoding drafter (logged), None when it is off."""
    spec = config.speculative
    if not spec.enabled:
        return None
    logger.info(
        "speculative decoding: %s, %d draft tokens per request and step%s%s",
        spec.method, spec.num_speculative_tokens,
        f" (n-grams {spec.ngram_min}..{spec.ngram_max})" if spec.method == "ngram" else "",
        f", off at {spec.disable_by_batch_size}+ running requests"
        if spec.disable_by_batch_size else "",
    )  # fmt: skip
    return Drafter(spec)


def _no_progress(phase: str, detail: str = "", eta_s: float | None = None) -> None:
    """The progress callback of a core nobody watches start (the offline API)."""
