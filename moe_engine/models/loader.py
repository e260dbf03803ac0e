"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into a model.

Safetensors only (never pickle); single file, sharded with `model.safetensors.index.json`, or
any `*.safetensors` in the directory.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Collection, Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from moe_engine.errors import StartupError
from moe_engine.models import MoeCausalLM
from moe_engine.models.layers.moe import FusedMoE
from moe_engine.models.materialize import check_materialized
from quant.compressed_tensors import CompressedTensorsConfig, assemble_pack_quantized
from quant.fp8 import Fp8BlockConfig, dequantize_fp8_weights, is_float8

logger = logging.getLogger(__name__)


#: Weight files that are pickles (torch.save): never loaded, as unpickling runs code.
PICKLE_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")
_INDEX = "model.safetensors.index.json"


def safetensors_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's weight files, in a stable order: those `model.safetensors.index.json`
    names, else every `*.safetensors` in the directory (symlinks, as in a hub cache snapshot,
    are followed).

    Raises:
        StartupError: no weights were found (the message lists what was looked for, and any
            pickle weight files that are there but never loaded), the index is not valid JSON
            or lacks "weight_map", or it names a file that is not there.
    """
    root = Path(model_dir)
    index = root / _INDEX
    if index.is_file():
        return _indexed_files(index)
    files = sorted(p for p in root.glob("*.safetensors") if p.is_file())
    if files:
        return files
    pickles = sorted(p.name for p in root.iterdir() if p.suffix in PICKLE_WEIGHT_SUFFIXES)
    found = (
        f"; found {', '.join(pickles[:4])}{' ...' if len(pickles) > 4 else ''}, which are "
        f"pickle files and never loaded (unpickling can run code): convert the checkpoint to "
        f"safetensors"
        if pickles
        else ""
    )
    raise StartupError(
        f"model: no weights found in {str(root)!r}: looked for {_INDEX} and *.safetensors "
        f"files{found}"
    )


def _indexed_files(index: Path) -> list[Path]:
    """The files an index's "weight_map" names, each checked to exist.

    Raises:
        StartupError: the index is not valid JSON, has no "weight_map" object, or names a
            missing file.
    """
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except json.JSONDecodeError as e:
        raise StartupError(
            f"{index}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
        ) from None
    except (KeyError, TypeError, AttributeError):
        raise StartupError(f'{index}: expected an object with a "weight_map" object') from None
    missing = [n for n in names if not (index.parent / n).is_file()]
    if missing:
        raise StartupError(
            f"{index} names {len(missing)} weight file(s) that are not there, e.g. "
            f"{missing[:4]} (an incomplete download?)"
        )
    return [index.parent / n for n in names]


def iterate_weights(
    model_dir: str | Path,
    dtype: torch.dtype | None,
    progress: bool = True,
    wants: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) for every tensor `wants(name)` accepts (default: all), floating
    ones cast to `dtype` (None: as stored); tensors it refuses are never read from disk.

    Raises:
        ValueError: with a `dtype`, a float8 tensor (see `cast_floating`).
    """
    files = safetensors_files(model_dir)
    stored = _stored_tensors(files, progress, wants)
    return stored if dtype is None else cast_floating(stored, dtype)


def _stored_tensors(
    files: list[Path], progress: bool, wants: Callable[[str], bool] | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of `files` that `wants` accepts, read one at a time; the progress bar counts
    the files' bytes: each tensor's as it is read, the rest of a file (its header, the tensors
    `wants` skips) when the file is done.

    safetensors reads through a memory map, whose touched pages count in this process's
    resident set until the map is closed: a file is reopened after every `REMAP_BYTES` read,
    so a multi-GiB shard adds at most that much to the peak (page-cache pages, but the OOM
    killer's count and VmHWM include them)."""
    sizes = [path.stat().st_size for path in files]
    with tqdm(total=sum(sizes), desc="Loading weights", unit="B", unit_scale=True,
              unit_divisor=1024, disable=not progress) as bar:
        for path, size in zip(files, sizes, strict=True):
            done = 0
            for name, tensor in _file_tensors(path, wants):
                read = tensor.numel() * tensor.element_size()
                bar.update(read)
                done += read
                yield name, tensor
            bar.update(size - done)


#: Bytes read through one memory map of a safetensors file before it is closed and reopened.
REMAP_BYTES = 64 << 20


def _file_tensors(path: Path, wants: Callable[[str], bool] | None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file that `wants` accepts, in the file's order, with the
    map reopened every `REMAP_BYTES` (see `_stored_tensors`)."""
    with safe_open(str(path), framework="pt") as f:
        names = [n for n in f.keys() if wants is None or wants(n)]  # noqa: SIM118
    start = 0
    while start < len(names):
        mapped = 0
        with safe_open(str(path), framework="pt") as f:
            while start < len(names) and mapped < REMAP_BYTES:
                tensor = f.get_tensor(names[start])
                mapped += tensor.numel() * tensor.element_size()
                yield names[start], tensor
                start += 1


def cast_floating(
    weights: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    keep_float32: Collection[str] = frozenset(),
) -> Iterator[tuple[str, torch.Tensor]]:
    """Cast every floating tensor of a weight stream to `dtype` (others pass through); those
    named in `keep_float32` to float32 (`MoeCausalLM.float32_weight_names`).

    Raises:
        ValueError: a float8 tensor: its values mean nothing without their block scales
            (`quant.fp8`), so it is never cast blindly; the message names the tensor.
    """
    for name, tensor in weights:
        if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            if is_float8(tensor):
                raise ValueError(
                    f"checkpoint tensor {name!r} is {tensor.dtype}: FP8 weights are loaded "
                    f"only with their weight_scale_inv, under config.json quantization_config "
                    f"quant_method 'fp8'"
                )
            tensor = tensor.to(torch.float32 if name in keep_float32 else dtype)
        yield name, tensor


#: torch.nn.init's random initialisers, which `nn.Linear` and `nn.Embedding` call when built.
_RANDOM_INITS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
                 "xavier_uniform_", "xavier_normal_", "orthogonal_")


@contextlib.contextmanager
def no_random_init() -> Iterator[None]:
    """Build modules without drawing their initial values: inside, torch.nn.init's random
    initialisers leave a tensor as allocated (`nn.Linear` and `nn.Embedding` draw theirs in
    `reset_parameters`).

    For a model `load_model` then fills: it refuses a checkpoint that lacks any parameter, so
    no drawn value would survive, and drawing them is most of the construction time at real
    size (gpt-oss-20b's 201088 x 2880 embeddings and LM head: ~16 s of a 2-core machine,
    bench/NOTES.md section 29). Restores the initialisers on exit, also on an exception;
    not for use while another thread builds modules that keep their initial values.
    (transformers' `no_init_weights` does the same, but imports `transformers.modeling_utils`,
    which costs the engine 190 MB of resident memory.)
    """
    saved = {name: getattr(torch.nn.init, name) for name in _RANDOM_INITS}
    try:
        for name in saved:
            setattr(torch.nn.init, name, _leave_as_allocated)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _leave_as_allocated(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


def to_device(
    weights: Iterable[tuple[str, torch.Tensor]], device: torch.device | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each tensor of a weight stream moved to `device` as it comes (None, or the device it
    is on: as it is, no copy), so that every later step (FP8 dequantization, casts, 4-bit
    assembly, the copy into the parameter) runs there and the host holds one tensor."""
    for name, tensor in weights:
        if device is not None and isinstance(tensor, torch.Tensor):
            tensor = tensor.to(device)
        yield name, tensor


def load_model(
    model: MoeCausalLM,
    model_dir: str | Path,
    dtype: torch.dtype,
    checkpoint_quant: CompressedTensorsConfig | Fp8BlockConfig | None = None,
    *,
    device: torch.device | None = None,
    on_experts_loaded: Callable[[FusedMoE], None] | None = None,
) -> None:
    """Fill every parameter of `model` from the checkpoint, one tensor at a time.

    For a model built on the meta device (`models.materialize`): its parameters already
    have (uninitialised) storage on `device`, except the float expert stacks, allocated when
    their first tensor arrives; afterwards no tensor may be left on meta.

    Args:
        checkpoint_quant: config.json's quantization config when the checkpoint stores
            Linears quantized. Compressed-tensors: their tensors are assembled into int4
            weights (`quant.compressed_tensors.assemble_pack_quantized`); scales are cast to
            `dtype` like every floating tensor (as vLLM loads them in the model dtype). FP8
            block-quantized: every float8 weight is paired with its scale_inv before any cast
            and dequantized to `dtype` (`quant.fp8.dequantize_fp8_weights`).
        device: where each tensor goes as it is read (None: left where it is read, the CPU).
        on_experts_loaded: called with each MoE block once all its local float experts are
            in (`WeightLoader`), e.g. to quantize them before the next layer's arrive.

    Raises:
        StartupError: a parameter the checkpoint does not provide (named), a tensor that does
            not fit, or a tensor of the model left without values (`check_materialized`).
    """
    try:
        weights = to_device(iterate_weights(model_dir, None, wants=model.wants_weight), device)
        if isinstance(checkpoint_quant, Fp8BlockConfig):
            weights = dequantize_fp8_weights(weights, checkpoint_quant, dtype)
        weights = cast_floating(weights, dtype, model.float32_weight_names())
        if isinstance(checkpoint_quant, CompressedTensorsConfig):
            weights = assemble_pack_quantized(weights, checkpoint_quant)
        loaded = model.load_weights(weights, on_experts_loaded=on_experts_loaded)
    except ValueError as e:
        raise StartupError(str(e)) from e
    missing = model.zero_absent_weights(sorted(model.expected_weight_names() - loaded))
    if missing:
        names = model.checkpoint_names_of(missing[:8])
        raise StartupError(
            f"checkpoint {str(model_dir)!r} lacks {len(missing)} weight(s), e.g. {names}"
        )
    check_materialized(model, str(model_dir))
    logger.info("loaded %d parameter tensors from %s", len(loaded), model_dir)
