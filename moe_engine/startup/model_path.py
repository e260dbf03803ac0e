"""Where a checkpoint is: a local directory, or a Hugging Face hub id already in the local cache.

Nothing is ever downloaded. A hub id such as ``Qwen/Qwen3-30B-A3B`` is looked up in the hub
cache that `huggingface_hub` fills (``hf download Qwen/Qwen3-30B-A3B``), in its documented
layout (https://huggingface.co/docs/huggingface_hub/guides/manage-cache)::

    $HF_HUB_CACHE/models--Qwen--Qwen3-30B-A3B/
        refs/main                       the commit hash the "main" branch points at
        snapshots/<hash>/config.json    symlinks into ../../blobs/
        blobs/<sha256>                  the file contents

and the snapshot directory is loaded as it is (through its symlinks).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

logger = logging.getLogger(__name__)

#: A hub repository id: "org/name" (letters, digits, "-", "_", "."), as the hub allows them.
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")


def hub_cache_dir() -> Path:
    """The hub cache `huggingface_hub` uses, read from the environment now: $HF_HUB_CACHE, else
    $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
    ~/.cache/huggingface/hub (the order of `huggingface_hub.constants`)."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.environ[name]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def looks_like_hub_id(model: str) -> bool:
    """True for "org/name" with no path syntax (no leading "/", "./", "~", no ".." part)."""
    return bool(_HUB_ID.fullmatch(model)) and ".." not in model.split("/")


def hub_repo_dir(repo_id: str) -> Path:
    """The cache folder of model repository `repo_id`: models--{org}--{name}."""
    return hub_cache_dir() / ("models--" + repo_id.replace("/", "--"))


def hub_snapshot(repo_id: str) -> Path | None:
    """The local snapshot of `repo_id` in the hub cache, or None when there is none.

    The snapshot is the one refs/main names; without refs/main (a download of another
    revision), the only snapshot there is.

    Raises:
        FileNotFoundError: several snapshots and no refs/main to choose among them (the
            message lists them).
    """
    repo = hub_repo_dir(repo_id)
    snapshots = repo / "snapshots"
    ref = repo / "refs" / "main"
    if ref.is_file():
        snapshot = snapshots / ref.read_text().strip()
        return snapshot if snapshot.is_dir() else None
    found = sorted(p for p in snapshots.glob("*") if p.is_dir()) if snapshots.is_dir() else []
    if len(found) > 1:
        raise FileNotFoundError(
            f"model {repo_id!r}: the hub cache holds {len(found)} snapshots "
            f"({', '.join(p.name for p in found)}) and no refs/main; pass --model "
            f"{snapshots}/<hash> for the one to serve"
        )
    return found[0] if found else None


def resolve_model_dir(model: str) -> str:
    """The local checkpoint directory `model` names.

    Args:
        model: a directory (config.json + *.safetensors; "~" is expanded), or a hub id
            "org/name" whose snapshot is in the local hub cache (`hub_snapshot`).

    Returns:
        The directory, as a string (a hub id becomes its snapshot directory).

    Raises:
        FileNotFoundError: the path does not exist (for a hub id: nothing is downloaded, and
            the message says how to get the snapshot and where it would be), or it is a file.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        return str(path)
    if path.exists():
        raise FileNotFoundError(
            f"model: {model!r} is a file; give the checkpoint directory (config.json + "
            f"*.safetensors) or 'demo'"
        )
    if looks_like_hub_id(model):
        snapshot = hub_snapshot(model)
        if snapshot is not None:
            logger.info("model %s: the local hub cache snapshot %s", model, snapshot)
            return str(snapshot)
        raise FileNotFoundError(
            f"model: {model!r} is not a local directory and looks like a Hugging Face hub id, "
            f"but it is not in the local hub cache ({hub_cache_dir()}); moe-engine never "
            f"downloads anything. Download it first (`hf download {model}`), then pass the id "
            f"again or the snapshot directory: "
            f"--model {hub_repo_dir(model)}/snapshots/<hash>"
        )
    raise FileNotFoundError(
        f"model: {model!r} does not exist; give a checkpoint directory (config.json + "
        f"*.safetensors) or 'demo'"
    )
