"""A stand-in trainer process for the weight-update tests: rank 0 of a weight-update group
that broadcasts a checkpoint's tensors in buckets (the protocol of `moe_engine.rl`, without
the gRPC calls, so that the offline `LLM` can be the engine)."""

from __future__ import annotations

import os

from safetensors.torch import load_file

from moe_engine.weight_update.buckets import bucket_layout, pack
from moe_engine.weight_update.group import WeightGroup
from moe_engine.weight_update.targets import meta_of


def checkpoint_tensors(path: str) -> dict:
    """Every tensor of `path`/model.safetensors, in sorted name order."""
    tensors = load_file(os.path.join(path, "model.safetensors"))
    return dict(sorted(tensors.items()))


def broadcast_checkpoint(port: int, world_size: int, path: str, bucket_bytes: int,
                         die_after_buckets: int | None = None, overrides: dict | None = None
                         ) -> None:
    """Join as rank 0, wait for the engine's verdict, broadcast every bucket; with
    `die_after_buckets`, exit abruptly (status 3) after that many buckets; `overrides` replace
    tensors (by name) before sending."""
    tensors = {**checkpoint_tensors(path), **(overrides or {})}
    metas = [meta_of(n, t) for n, t in tensors.items()]
    group = WeightGroup("127.0.0.1", port, 0, world_size, "gloo", "weight_update", 30.0)
    if not group.agree(False):
        return
    values = list(tensors.values())
    for k, bucket in enumerate(bucket_layout(metas, bucket_bytes)):
        if die_after_buckets is not None and k == die_after_buckets:
            os._exit(3)
        group.broadcast(pack(bucket, values))
