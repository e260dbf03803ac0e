"""Choosing and binding the model's kernels: the registry's plan (kernels/registry.py) for this
engine's device and model, given to every kernel-using module once, after loading."""

from __future__ import annotations

import logging
import re

import torch
from torch import nn

from kernels.decode_layer.native import MAX_ROWS as MAX_DECODE_ROWS
from kernels.native.library import native_unavailable_reason
from kernels.plan import NATIVE_CPU, KernelPlan
from kernels.registry import KernelBackendError, ModelFacts, choose_kernels, probe_backend
from moe_engine.errors import StartupError
from moe_engine.models.layers.decoder import DecoderLayer
from moe_engine.models.layers.native_decode import attach_decode_kernel
from moe_engine.models.spec import ArchSpec
from moe_engine.startup.progress import StartupProgressFn

logger = logging.getLogger(__name__)


def model_facts(spec: ArchSpec, dtype: torch.dtype) -> ModelFacts:
    """What of the model decides which kernels can run it: head size (MLA: the latent's
    kv_lora_rank + qk_rope_head_dim, what its decode kernel attends), compute dtype, MLA, and
    the query heads per KV head (GQA)."""
    mla = bool(spec.kv_lora_rank)
    head_dim = spec.kv_lora_rank + spec.qk_rope_head_dim if mla else spec.head_dim
    gqa = spec.num_heads // spec.num_kv_heads if spec.num_kv_heads else 1
    return ModelFacts(head_dim=head_dim, dtype=str(dtype).removeprefix("torch."), mla=mla,
                      query_heads_per_kv=gqa)


def build_detail(message: str) -> str:
    """A kernel build report as the detail of the "building native CPU kernels" phase: the
    phase's own words and the elapsed seconds (the status adds both) taken out.

    "building native CPU kernels: 2/5 sources compiled, 30 s elapsed, about 9 s left"
    -> "2/5 sources compiled"
    """
    detail = message.removeprefix("building native CPU kernels").lstrip(": ")
    detail = re.sub(r"^\((\d+ sources, \d+ in parallel)\) into .*", r"\1", detail)
    detail = re.sub(r",? \d+ s elapsed", "", detail)
    return re.sub(r", about \d+ s( left)?", "", detail).strip(" ,:")


def plan_kernels(
    device: str, kernel_backend: str, facts: ModelFacts, progress: StartupProgressFn
) -> KernelPlan:
    """The registry's choice for this engine (`kernels.registry.choose_kernels`), with the
    one-time native build told to `progress` ("building native CPU kernels").

    Raises:
        StartupError: a malformed `--kernel-backend`, or one naming a backend that cannot run
            here or an op it has no kernel for (the registry's message).
    """
    def on_build(message: str, eta_s: float | None) -> None:
        progress("building native CPU kernels", build_detail(message), eta_s)

    def probe(backend: str, on: str) -> str | None:
        if backend == NATIVE_CPU and on == "cpu":
            progress("loading native CPU kernels", "", None)
            return native_unavailable_reason(progress=on_build)
        return probe_backend(backend, on)

    try:
        return choose_kernels(device, kernel_backend, facts, probe=probe)
    except KernelBackendError as exc:
        raise StartupError(str(exc)) from exc


def bind_kernels(model: nn.Module, plan: KernelPlan) -> None:
    """Give `plan` to every module of `model` that has `bind_kernels` (linears, norms,
    attention, experts, decoder layers), children before their parents (a decoder layer's
    native decode step reads how its modules were bound); call again after weights change in
    place."""
    for module in reversed(list(model.modules())):
        bind = getattr(module, "bind_kernels", None)
        if bind is not None and module is not model:
            bind(plan)
    for module in model.modules():
        if isinstance(module, DecoderLayer):
            attach_decode_kernel(module, plan)
    if plan.decode_layer() is not None:
        layers = [m for m in model.modules() if hasattr(m, "decode_kernel")]
        native = sum(m.decode_kernel is not None for m in layers)
        others = sorted({m.decode_misfit for m in layers if m.decode_kernel is None})
        logger.info(
            "decode steps: %d of %d decoder layers run as one native call each (steps of "
            "decodes only, up to %d rows; other steps and layers run module by module)%s",
            native, len(layers), MAX_DECODE_ROWS,
            "".join(f"; module path: {why}" for why in others),
        )
