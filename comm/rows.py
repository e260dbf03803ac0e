"""The packed row an all-to-all dispatch moves: ids, weights and the hidden bytes in one row.

Each row is [k int32 local ids | k float32 weights | hidden bytes | padding to 16 bytes], so
ids and weights need no collective of their own, and the payload is plain bytes whatever the
hidden dtype (gloo has no all-to-all for some dtypes, e.g. int16).
"""

from __future__ import annotations

import torch

#: Payload rows are padded to a multiple of this many bytes, so every field can be viewed in
#: its own dtype in place.
ROW_ALIGN_BYTES = 16


def row_layout(top_k: int, hidden_bytes: int) -> tuple[int, int]:
    """(offset of the hidden bytes, row bytes) of one packed row for `top_k` ids and weights
    and `hidden_bytes` bytes of activations."""
    offset = 8 * top_k
    row_bytes = -(-(offset + hidden_bytes) // ROW_ALIGN_BYTES) * ROW_ALIGN_BYTES
    return offset, row_bytes


def pack_rows(hidden: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """hidden [S, H] (any dtype) + ids [S, k] int32 + weights [S, k] float32 ->
    [S, row_bytes] uint8 on hidden's device."""
    rows, top_k = ids.shape
    hidden_bytes = hidden.shape[1] * hidden.element_size()
    offset, row_bytes = row_layout(top_k, hidden_bytes)
    payload = torch.empty(rows, row_bytes, dtype=torch.uint8, device=hidden.device)
    payload[:, : 4 * top_k].view(torch.int32).copy_(ids)
    payload[:, 4 * top_k : offset].view(torch.float32).copy_(weights)
    payload[:, offset : offset + hidden_bytes].view(hidden.dtype).copy_(hidden)
    payload[:, offset + hidden_bytes :].zero_()
    return payload


def unpack_rows(
    payload: torch.Tensor, top_k: int, hidden_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `pack_rows`: contiguous hidden [N, H] dtype, ids [N, k] int32, weights
    [N, k] float32."""
    hidden_bytes = hidden_size * torch.empty(0, dtype=dtype).element_size()
    offset = 8 * top_k
    ids = payload[:, : 4 * top_k].view(torch.int32).contiguous()
    weights = payload[:, 4 * top_k : offset].view(torch.float32).contiguous()
    hidden = payload[:, offset : offset + hidden_bytes].view(dtype).contiguous()
    return hidden, ids, weights
