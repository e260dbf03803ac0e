"""How the tensors of a distributed update are packed into broadcast buckets.

Both sides compute the same layout from the update's `TensorMeta` list and `bucket_bytes`, so
only raw bytes cross the group: tensors in the update's order, each at an offset aligned to
`ALIGN` bytes, a bucket closed when the next tensor would take it past `bucket_bytes` (a tensor
larger than that gets a bucket of its own). One `broadcast` of a uint8 buffer per bucket, as
SGLang's and verl's bucketed weight sync do.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from moe_engine.weight_update.messages import TensorMeta

#: Offset alignment inside a bucket (bytes): every dtype's view of the bytes is aligned.
ALIGN = 16
#: Bucket size when an update does not say (bytes): NCCL's large transfers pay; over gloo
#: (TCP) buckets of 8-32 MiB received a 229 MB update 1.6-2.3x faster than 256 MiB ones on
#: loopback (bench/README.md "Weight updates").
DEFAULT_BUCKET_BYTES = 256 * 2**20
DEFAULT_BUCKET_BYTES_GLOO = 32 * 2**20


def default_bucket_bytes(backend: str) -> int:
    """The bucket size for a group's backend ("gloo" or "nccl"), in bytes."""
    return DEFAULT_BUCKET_BYTES_GLOO if backend == "gloo" else DEFAULT_BUCKET_BYTES

_DTYPES = {
    "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
    "uint8": torch.uint8, "int64": torch.int64, "int32": torch.int32,
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a `TensorMeta.dtype` string.

    Raises:
        ValueError: a dtype the update path does not carry (names it and the accepted ones).
    """
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def nbytes_of(meta: TensorMeta) -> int:
    """Bytes of the tensor `meta` describes."""
    n = torch_dtype(meta.dtype).itemsize
    for d in meta.shape:
        n *= d
    return n


@dataclass(frozen=True)
class Bucket:
    """One broadcast: `nbytes` in all; `items` (index into the update, offset, nbytes)."""

    nbytes: int
    items: tuple[tuple[int, int, int], ...]


def bucket_layout(metas: list[TensorMeta], bucket_bytes: int) -> list[Bucket]:
    """The buckets of an update (see the module doc); bucket_bytes <= 0 means the default.

    Raises:
        ValueError: a dtype `torch_dtype` refuses.
    """
    limit = bucket_bytes if bucket_bytes > 0 else DEFAULT_BUCKET_BYTES
    buckets: list[Bucket] = []
    items: list[tuple[int, int, int]] = []
    offset = 0
    for i, meta in enumerate(metas):
        n = nbytes_of(meta)
        start = -(-offset // ALIGN) * ALIGN
        if items and start + n > limit:
            buckets.append(Bucket(offset, tuple(items)))
            items, start = [], 0
        items.append((i, start, n))
        offset = start + n
    if items:
        buckets.append(Bucket(offset, tuple(items)))
    return buckets


def pack(bucket: Bucket, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The bucket's bytes: `tensors` (indexed like the update) copied in at their offsets."""
    buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=tensors[bucket.items[0][0]].device)
    for i, offset, n in bucket.items:
        t = tensors[i].detach().contiguous()
        buf[offset : offset + n].copy_(t.reshape(-1).view(torch.uint8))
    return buf


def unpack(bucket: Bucket, buf: torch.Tensor, metas: list[TensorMeta]
           ) -> Iterator[tuple[int, torch.Tensor]]:
    """(index, tensor) for each tensor of a received bucket: views into `buf`."""
    for i, offset, n in bucket.items:
        meta = metas[i]
        yield i, buf[offset : offset + n].view(torch_dtype(meta.dtype)).view(meta.shape)
