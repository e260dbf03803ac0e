"""An update read from a checkpoint folder (`UpdateWeights(source="disk")`).

The folder holds safetensors files (one, sharded with an index, or any `*.safetensors`, as at
startup: `loader.safetensors_files`), all of the model's tensors or some of them, and
optionally a config.json, which must name the served architecture. Names, dtypes and shapes
come from the files' headers, so the whole update is checked before any tensor is read.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from moe_engine.errors import StartupError
from moe_engine.models.loader import safetensors_files
from moe_engine.weight_update.messages import TensorMeta
from moe_engine.weight_update.targets import WeightUpdateError

#: safetensors header dtypes -> the names `TensorMeta` uses.
_DTYPES = {
    "F32": "float32", "BF16": "bfloat16", "F16": "float16", "U8": "uint8", "I8": "int8",
    "I32": "int32", "I64": "int64", "BOOL": "bool", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F64": "float64",
}


class DiskUpdate:
    """The tensors of one folder, by name.

    Args:
        path: the folder.
        architecture: the served model's architecture (config.json's must match, if present).

    Raises:
        WeightUpdateError ("path"): not a folder, no safetensors files, a config.json of
            another architecture or that does not parse.
    """

    def __init__(self, path: str, architecture: str) -> None:
        root = Path(path)
        if not root.is_dir():
            where = "" if root.is_absolute() else (
                f" (a relative path is taken from the server's working directory, {os.getcwd()})")
            raise WeightUpdateError("path", f"path: {path!r} is not a folder{where}")
        _check_architecture(root, architecture)
        try:
            self.files = safetensors_files(root)
        except StartupError as exc:
            raise WeightUpdateError("path", str(exc)) from None
        self.file_of: dict[str, Path] = {}
        self.metas: list[TensorMeta] = []
        for file in self.files:
            with _reading(file), safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    piece = f.get_slice(name)
                    dtype = _DTYPES.get(piece.get_dtype(), piece.get_dtype().lower())
                    self.metas.append(TensorMeta(name, dtype, list(piece.get_shape())))
                    self.file_of[name] = file

    def tensors(self, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for each name in `wanted`, file by file (nothing else is read).

        Raises:
            WeightUpdateError ("path"): a file that cannot be read (truncated, changed).
        """
        for file in self.files:
            with _reading(file), safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118
                    if name in wanted:
                        yield name, f.get_tensor(name)


@contextlib.contextmanager
def _reading(file: Path) -> Iterator[None]:
    """A safetensors error (a truncated file, one still being written, not safetensors at
    all) as the update's refusal, naming the file."""
    try:
        yield
    except WeightUpdateError:
        raise
    except Exception as exc:  # noqa: BLE001 - SafetensorError, OSError, ...
        raise WeightUpdateError(
            "path", f"path: {file} cannot be read as safetensors ({type(exc).__name__}: "
            f"{str(exc)[:200]}); is it still being written?",
        ) from None


def _check_architecture(root: Path, architecture: str) -> None:
    config = root / "config.json"
    if not config.is_file():
        return
    try:
        archs = json.loads(config.read_text(encoding="utf-8")).get("architectures") or []
    except (json.JSONDecodeError, AttributeError) as exc:
        raise WeightUpdateError("path", f"path: {config} does not parse: {exc}") from None
    if archs and architecture not in archs:
        raise WeightUpdateError(
            "path", f"path: {config} is a {archs[0]} checkpoint; the engine serves "
            f"{architecture} (an update keeps the architecture and its shapes)",
        )
