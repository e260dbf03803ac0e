"""What a compiled Triton kernel needs on the GPU, read without one.

- shared memory per block (bytes): Triton's ``metadata.shared`` (what the launch requests);
- registers per thread and the stack frame (bytes) from ``cuobjdump -res-usage`` on the cubin
  (REG, STACK; ptxas puts spilled registers in the stack frame: Triton kernels have no local
  arrays, so a frame > 0 is spilling), and the spill stores / loads as the ``STL`` / ``LDL``
  instructions of the SASS (``cuobjdump -sass``);
- global loads by width from the PTX: ``ld.global[.v2|.v4].<type>`` counted per bytes per
  instruction (1, 2, 4, 8, 16) and ``cp.async`` (the pipelined global -> shared copies) per
  copy size. Counts are static (instructions in the code, the K loop body once), so they tell
  whether the weight loads are vectorised (``v4`` / ``cp16``: 16 B) or bytes (``b8``), not how
  many run.

cuobjdump ships with Triton (``triton/backends/nvidia/bin``).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

_LD_GLOBAL = re.compile(r"\bld\.global((?:\.[\w:]+)*)")
_CP_ASYNC = re.compile(
    r"\bcp\.async\.c[ag]\.shared\.global(?:\.[\w:]+)*"  # the copy,
    r"\s*\[[^]]*\],\s*\[[^]]*\],\s*(0x[0-9a-fA-F]+|\d+)"  # [dst], [src], bytes
)
_TYPE_BITS = {"8": 8, "16": 16, "32": 32, "64": 64, "128": 128}
_RES_USAGE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.exists():
        raise FileNotFoundError(f"cuobjdump not found at {path} (it ships with Triton's wheel)")
    return str(path)


def global_loads(ptx: str) -> dict[str, int]:
    """Static counts of global loads in ``ptx``: ``"ld<bytes>"`` for ``ld.global`` of that many
    bytes per instruction and ``"cp<bytes>"`` for ``cp.async`` copies of that size."""
    counts: Counter[str] = Counter()
    for match in _LD_GLOBAL.finditer(ptx):
        parts = match.group(1).split(".")
        vector = next((int(p[1:]) for p in parts if p in ("v2", "v4", "v8")), 1)
        types = (p[1:] for p in parts if p[:1] in "bufs")  # .b8 .u16 .f32 .s64 ...
        bits = next((_TYPE_BITS[t] for t in types if t in _TYPE_BITS), 0)
        counts[f"ld{vector * bits // 8}"] += 1
    for match in _CP_ASYNC.finditer(ptx):
        counts[f"cp{int(match.group(1), 0)}"] += 1
    return dict(sorted(counts.items(), key=lambda kv: (kv[0][:2], int(kv[0][2:]))))


def cubin_usage(cubin: bytes) -> dict[str, int]:
    """``{"regs", "stack", "local", "spill_stores", "spill_loads"}`` of the cubin's one kernel.

    Raises:
        RuntimeError: cuobjdump failed or printed no resource line.
    """
    fd, path = tempfile.mkstemp(suffix=".cubin")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        run = subprocess.run([_cuobjdump(), "-res-usage", "-sass", path], capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    finally:
        os.unlink(path)
    match = _RES_USAGE.search(run.stdout)
    if run.returncode != 0 or match is None:
        raise RuntimeError(f"cuobjdump failed ({run.returncode}): {run.stderr.strip()[:300]}")
    regs, stack, _, local = (int(x) for x in match.groups())
    return {
        "regs": regs, "stack": stack, "local": local,
        "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\s", run.stdout)),
        "spill_loads": len(re.findall(r"\bLDL(?:\.\w+)*\s", run.stdout)),
    }  # fmt: skip


def format_loads(loads: dict[str, int]) -> str:
    """``"ld16:12 ld1:512 cp16:8"``: the widest first."""
    items = sorted(loads.items(), key=lambda kv: (kv[0][:2] != "ld", -int(kv[0][2:])))
    return " ".join(f"{k}:{v}" for k, v in items) or "-"
