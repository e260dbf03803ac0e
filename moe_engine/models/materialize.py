"""Build a model on the meta device, then give it storage on the target device piece by piece.

`build_model` constructs every module under `torch.device("meta")` (no parameter storage at
all, whatever the model's size), shards the experts there, then `materialize` allocates the
parameters on the engine's device uninitialised, and `load_model` streams the checkpoint into
them one tensor at a time (`loader.iterate_weights`, each tensor moved to the device as it is
read). The routed experts' float stacks w13/w2 stay on meta until their first checkpoint
tensor arrives (`materialize_float_experts`): a checkpoint that stores them 4-bit (int4,
MXFP4) never allocates the float copy, and with `--quantization` a layer's float experts are
quantized as soon as they are complete (`build.quantize_complete_layer`), so the device
holds at most one layer of them at a time. Host memory during a load is about one tensor and
the memory map's window (`loader.REMAP_BYTES`), not the model: the way accelerate's
`init_empty_weights` + `load_checkpoint_and_dispatch` and transformers' `device_map` loading
avoid the host copy.

Buffers that are computed rather than loaded (the rotary cos/sin caches) are made on meta like
everything else; `materialize` asks their module to compute them again on the device
(`materialize_buffers(device)`), and refuses a module that has such a buffer but no way to
compute it, so no computed buffer is ever left as uninitialised memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from moe_engine.errors import StartupError
from moe_engine.models.layers.moe import FusedMoE

META = torch.device("meta")

#: The float expert stacks allocated when their first checkpoint tensor arrives.
LAZY_EXPERT_STACKS = ("w13", "w2")


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Modules built inside get meta tensors (shapes and dtypes, no storage) for every
    parameter and buffer made without an explicit device; torch.nn.init's initialisers do
    nothing on them."""
    with META:
        yield


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and persistent buffer of `model` uninitialised storage on
    `device` (the loader fills them), except the routed experts' float stacks
    (`LAZY_EXPERT_STACKS`, allocated by `materialize_float_experts` when loaded), and compute
    the non-persistent buffers again on `device` through their module's
    `materialize_buffers(device)`. Tied parameters (lm_head and embed_tokens) stay one tensor.

    Raises:
        StartupError: a module holds a computed (non-persistent) buffer on meta and has no
            `materialize_buffers` to compute it.
    """
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        lazy = LAZY_EXPERT_STACKS if isinstance(module, FusedMoE) else ()
        for name, param in module._parameters.items():
            if param is None or not param.is_meta or name in lazy:
                continue
            if id(param) not in made:
                empty = _empty(param, device)
                made[id(param)] = nn.Parameter(empty, requires_grad=param.requires_grad)
            module._parameters[name] = made[id(param)]
        computed = False
        for name, buf in module._buffers.items():
            if buf is None or not buf.is_meta:
                continue
            if name in module._non_persistent_buffers_set:
                computed = True
            else:
                module._buffers[name] = _empty(buf, device)
        if computed:
            _compute_buffers(module, device)


def _empty(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised contiguous tensor of `like`'s shape and dtype on `device` (not
    `empty_like`, whose meta overload imports torch's Python meta kernels: ~35 MB resident)."""
    return torch.empty(like.shape, dtype=like.dtype, device=device)


def _compute_buffers(module: nn.Module, device: torch.device) -> None:
    """Let `module` compute its non-persistent buffers on `device`.

    Raises:
        StartupError: it cannot (no `materialize_buffers`), or some stay on meta.
    """
    compute = getattr(module, "materialize_buffers", None)
    if compute is not None:
        compute(device)
    left = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
    if left:
        raise StartupError(
            f"{type(module).__name__} was built on the meta device and its computed buffers "
            f"{left} cannot be made on {device}: give it materialize_buffers(device)"
        )


def materialize_float_experts(moe: FusedMoE, device: torch.device) -> None:
    """Allocate `moe`'s float expert stacks w13 [E_local, 2I, H] and w2 [E_local, H, I]
    (uninitialised) on `device` if they are still on meta; no-op otherwise."""
    for name in LAZY_EXPERT_STACKS:
        param = getattr(moe, name, None)
        if param is not None and param.is_meta:
            setattr(moe, name, nn.Parameter(_empty(param, device), requires_grad=False))


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of the parameters and buffers of `model` still on the meta device (after loading
    there should be none: the float experts of a 4-bit layer are dropped, not left)."""
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return sorted({name for name, t in named if t.is_meta})


def check_materialized(model: nn.Module, model_dir: str) -> None:
    """Refuse a loaded model with any tensor left on meta (never filled by the checkpoint).

    Raises:
        StartupError: naming up to 8 of them.
    """
    left = meta_tensors(model)
    if left:
        raise StartupError(
            f"checkpoint {model_dir!r} left {len(left)} tensor(s) of the model without values, "
            f"e.g. {left[:8]}"
        )
