"""`moe_align_block_size` as one Triton kernel (one program, one launch).

vLLM and SGLang align token-expert pairs with one CUDA kernel for moderate expert counts
(`moe_align_block_size_kernel`: per-expert counts in shared memory, a prefix sum over the padded
counts, then a scatter of the pair indices); this kernel does the same work in one Triton
program, in four passes over registers-sized chunks:

1. counts per expert (a one-hot ``[BLOCK_PAIRS, NUM_EXPERTS_PAD]`` compare summed over pairs);
2. each pair's slot: its expert's padded start, plus the pairs of that expert in earlier chunks,
   plus those earlier in its own chunk (an exclusive cumulative sum of the one-hot along the
   pairs), so the order within an expert is the pairs' order (stable, deterministic);
3. the padding slots (inside each expert's padded group after its pairs, and after the padded
   total) get the sentinel ``num_pairs``;
4. each M-block's expert (the first expert whose padded end lies past the block's start), or -1
   past the padded total.

Passes 2 and 3 write disjoint slots, so no barrier is needed between them. The launcher
allocates with ``torch.empty`` only, sizes everything from shapes and reads nothing back, so a
CUDA graph can capture it. The plain torch version is
:func:`kernels.moe.reference.moe_align_block_size_reference`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: Elements of one ``[BLOCK_PAIRS, NUM_EXPERTS_PAD]`` one-hot tile (registers of one program):
#: with `NUM_WARPS` 8, compiled for sm_90 (ptxas of Triton 3.9) no expert count from 8 to 512
#: spills (4096 spilled at 16 experts, and at 64 with 4 warps).
TILE_ELEMENTS = 2048
NUM_WARPS = 8
#: Pairs (tokens x top_k) up to which `kernels.moe.fused_moe.moe_align_block_size` runs this
#: kernel: every CUDA-graph decode batch (512 tokens at top-8). One program walks the pairs in
#: chunks of 16-256 (fewer the more experts), so its time grows with the pairs; past this,
#: prefill-sized calls (never captured; their GEMMs dwarf ~40 launches) take the torch
#: version, whose argsort is parallel. A multi-program version would take them back.
MAX_KERNEL_PAIRS = 4096
MAX_BLOCK_PAIRS = 256


@triton.jit
def moe_align_block_size_kernel(
    topk_ids_ptr, sorted_token_ids_ptr, expert_ids_ptr, num_tokens_post_padded_ptr,
    num_pairs, num_experts, max_padded,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_PAIRS: tl.constexpr, NUM_EXPERTS_PAD: tl.constexpr,
):  # fmt: skip
    """One program: see the module docstring for the four passes."""
    experts = tl.arange(0, NUM_EXPERTS_PAD)
    real = experts < num_experts
    lanes = tl.arange(0, BLOCK_PAIRS)

    counts = tl.zeros([NUM_EXPERTS_PAD], dtype=tl.int32)
    for start in range(0, num_pairs, BLOCK_PAIRS):
        p = start + lanes
        ids = tl.load(topk_ids_ptr + p, mask=p < num_pairs, other=-1)
        hit = ((ids[:, None] == experts[None, :]) & real[None, :]).to(tl.int32)
        counts += tl.sum(hit, axis=0)
    padded = (counts + BLOCK_SIZE_M - 1) // BLOCK_SIZE_M * BLOCK_SIZE_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)

    next_slot = starts  # per expert, where its next pair goes
    for start in range(0, num_pairs, BLOCK_PAIRS):
        p = start + lanes
        ids = tl.load(topk_ids_ptr + p, mask=p < num_pairs, other=-1)
        hit = ((ids[:, None] == experts[None, :]) & real[None, :]).to(tl.int32)
        earlier = tl.cumsum(hit, axis=0) - hit  # same-expert pairs before it in this chunk
        dest = tl.sum(hit * (earlier + next_slot[None, :]), axis=1)
        tl.store(sorted_token_ids_ptr + dest, p.to(tl.int32), mask=tl.sum(hit, axis=1) > 0)
        next_slot += tl.sum(hit, axis=0)

    for start in range(0, max_padded, BLOCK_PAIRS):
        q = start + lanes
        owner = ((ends[None, :] <= q[:, None]) & real[None, :]).to(tl.int32)
        expert = tl.sum(owner, axis=1)  # the first expert whose padded end is past q
        mine = (experts[None, :] == expert[:, None]).to(tl.int32)
        first = tl.sum(mine * starts[None, :], axis=1)
        used = tl.sum(mine * counts[None, :], axis=1)
        pad = (q >= total) | (q - first >= used)
        tl.store(sorted_token_ids_ptr + q, num_pairs, mask=(q < max_padded) & pad)

    for start in range(0, max_padded // BLOCK_SIZE_M, BLOCK_PAIRS):
        b = start + lanes
        block_start = b * BLOCK_SIZE_M
        owner = ((ends[None, :] <= block_start[:, None]) & real[None, :]).to(tl.int32)
        expert = tl.where(block_start < total, tl.sum(owner, axis=1), -1)
        tl.store(expert_ids_ptr + b, expert, mask=b < max_padded // BLOCK_SIZE_M)
    tl.store(num_tokens_post_padded_ptr, total)


def block_pairs(num_experts: int) -> int:
    """Pairs per chunk for `num_experts` experts: a one-hot tile of at most `TILE_ELEMENTS`."""
    experts_pad = triton.next_power_of_2(num_experts)
    return max(16, min(MAX_BLOCK_PAIRS, TILE_ELEMENTS // experts_pad))


def invoke_moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, max_padded: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch :func:`moe_align_block_size_kernel` (arguments checked by the caller,
    `kernels.moe.fused_moe.moe_align_block_size`, whose contract this is).

    Args:
        topk_ids: ``[num_tokens, top_k]`` integer expert ids (int32; any integer dtype is read
            as is); ids outside ``[0, num_experts)`` are dropped.
        block_size: ``BLOCK_SIZE_M``, a power of two >= 16.
        num_experts: ``E``, experts of this rank.
        max_padded: ``max_num_tokens_padded(num_pairs, block_size, num_experts)``, a multiple
            of ``block_size``.

    Returns:
        ``sorted_token_ids [max_padded]``, ``expert_ids [max_padded // block_size]``,
        ``num_tokens_post_padded [1]``, all int32 on ``topk_ids``' device.
    """
    device = topk_ids.device
    flat = topk_ids.reshape(-1).contiguous()
    sorted_token_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_padded // block_size, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    moe_align_block_size_kernel[(1,)](
        flat, sorted_token_ids, expert_ids, total, flat.numel(), num_experts, max_padded,
        BLOCK_SIZE_M=block_size, BLOCK_PAIRS=block_pairs(num_experts),
        NUM_EXPERTS_PAD=triton.next_power_of_2(num_experts), num_warps=NUM_WARPS,
    )  # fmt: skip
    return sorted_token_ids, expert_ids, total
