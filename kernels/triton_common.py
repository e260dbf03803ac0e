"""What the Triton kernels of every op share: whether Triton runs under its interpreter, and
the bfloat16 cast that rounds there as compiled code rounds.

Triton 3.9's interpreter (``TRITON_INTERPRET=1``: the tests on a CPU) casts float32 to bfloat16
by truncation where compiled Triton rounds to nearest even, so a kernel launched under the
interpreter passes ``ROUND_BF16`` and `round_to` rounds first. Imported by the kernel modules
only (never by ``kernels/__init__.py``), so a CPU engine never imports Triton.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl


def interpreting() -> bool:
    """Whether Triton runs under its interpreter (``TRITON_INTERPRET=1``: tests on a CPU)."""
    knobs = getattr(triton, "knobs", None)  # newer Triton; older ones read the variable
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def round_to(x, dtype: tl.constexpr, ROUND_BF16: tl.constexpr):
    """``x.to(dtype)``; with ``ROUND_BF16`` (interpreter only, bfloat16 ``dtype``) float32
    rounded to nearest even bfloat16 first (finite x): the interpreter truncates where compiled
    Triton rounds."""
    if ROUND_BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)
