"""What a prefill/decode split costs on the wire: KV bytes a prompt moves, and how long that
takes on a link, beside how long the prompt's prefill takes.

After its prefill a request holds, per KV-cache group, `blocks_needed(L)` blocks minus the
ones a sliding window already gave back (`KVCacheSpec.num_skipped_blocks`); the transfer moves
exactly those blocks (`kv_layout.block_copies`), each `bytes_per_block` (K and V, or the MLA
latent, of block_size tokens over the group's layers). The time on a link of B Gb/s is
bytes * 8 / (B * 1e9): the line rate, no protocol overhead, no overlap with compute, so a
lower bound. The split pays off when that is small against the prefill itself (which the
decode instance no longer runs) and against the decode step time it adds to TTFT once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from moe_engine.kv_cache.spec import KVCacheSpec

#: Link rates shown by default (Gb/s): 25 GbE, 100 Gb/s (EDR / 100 GbE), 400 Gb/s (NDR).
DEFAULT_LINKS_GBPS = (25.0, 100.0, 400.0)
DEFAULT_PROMPT_LENS = (128, 1024, 8192, 32768)


def transfer_bytes(specs: Sequence[KVCacheSpec], prompt_len: int) -> int:
    """Bytes a prompt of `prompt_len` tokens moves: its blocks kept after the prefill, per
    group (a sliding-window group only the blocks its window still reads)."""
    total = 0
    for spec in specs:
        kept = spec.blocks_needed(prompt_len) - spec.num_skipped_blocks(prompt_len)
        total += max(kept, 0) * spec.bytes_per_block
    return total


def link_seconds(num_bytes: int, gbps: float) -> float:
    """Seconds `num_bytes` take at `gbps` gigabits per second (line rate).

    Raises:
        ValueError: a rate <= 0.
    """
    if gbps <= 0:
        raise ValueError(f"link rate must be > 0 Gb/s, got {gbps}")
    return num_bytes * 8 / (gbps * 1e9)


@dataclass(frozen=True)
class TransferRow:
    """One prompt length: bytes moved, seconds per link rate, and the prefill's seconds when
    measured (None otherwise)."""

    prompt_len: int
    num_bytes: int
    link_s: dict[float, float]
    prefill_s: float | None = None


def transfer_table(specs: Sequence[KVCacheSpec], prompt_lens: Sequence[int],
                   links_gbps: Sequence[float] = DEFAULT_LINKS_GBPS,
                   prefill_s: dict[int, float] | None = None) -> list[TransferRow]:
    """One `TransferRow` per prompt length."""
    rows = []
    for n in prompt_lens:
        b = transfer_bytes(specs, n)
        rows.append(TransferRow(n, b, {g: link_seconds(b, g) for g in links_gbps},
                                (prefill_s or {}).get(n)))
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds < 10 else f"{seconds:.1f} s"


def format_table(rows: Sequence[TransferRow]) -> str:
    """A markdown table: prompt tokens, bytes, one column per link, and the prefill time (with
    the transfer's share of it at each link) where measured."""
    links = list(rows[0].link_s) if rows else []
    measured = any(r.prefill_s is not None for r in rows)
    head = ["prompt tokens", "KV moved"] + [
        f"{g:g} Gb/s" + (" (% of prefill)" if measured else "") for g in links]
    if measured:
        head.append("prefill (measured)")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r.prompt_len), f"{r.num_bytes / 2**20:.2f} MiB"]
        for g in links:
            share = f" ({100 * r.link_s[g] / r.prefill_s:.2g}%)" if r.prefill_s else ""
            cells.append(_ms(r.link_s[g]) + share)
        if measured:
            cells.append(_ms(r.prefill_s) if r.prefill_s is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
