"""4-bit quantization in row chunks (`quant.packing.row_chunks`): the same codes as in one go,
the same errors wherever the bad value sits, and temporaries bounded by the chunk, not the
weight (a real LM head, 201088 x 2880, would otherwise need several whole float32 copies)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from quant.int4 import quantize_int4
from quant.mxfp4 import quantize_mxfp4
from quant.packing import row_chunks

REPO = Path(__file__).resolve().parents[1]


def test_row_chunks_cover_every_row_once() -> None:
    for rows, width, chunk in ((10, 4, 8), (7, 100, 1), (0, 4, 8), (5, 3, 10**9)):
        parts = row_chunks(rows, width, chunk)
        covered = [r for p in parts for r in range(p.start, p.stop)]
        assert covered == list(range(rows))
        assert all(p.stop - p.start == max(1, chunk // width) for p in parts[:-1])
    with pytest.raises(ValueError, match="chunk_elements must be >= 1"):
        row_chunks(4, 4, 0)


@pytest.mark.parametrize("shape", [(37, 64), (3, 5, 96), (1, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_in_chunks_equals_one_go(shape, dtype) -> None:
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    w = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w.view(-1)[::7] = 0
    whole = quantize_mxfp4(w, chunk_elements=10**9)
    for chunk in (1, 64, 100):
        parts = quantize_mxfp4(w, chunk_elements=chunk)
        assert all(torch.equal(a, b) for a, b in zip(parts, whole, strict=True)), chunk


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_int4_in_chunks_equals_one_go(symmetric, scale_dtype) -> None:
    g = torch.Generator().manual_seed(torch.seed() % (2**31))
    w = torch.randn(4, 9, 64, generator=g) + 0.5
    whole = quantize_int4(w, 32, symmetric, scale_dtype, chunk_elements=10**9)
    for chunk in (1, 100, 640):
        parts = quantize_int4(w, 32, symmetric, scale_dtype, chunk_elements=chunk)
        for a, b in zip(parts, whole, strict=True):
            assert (a is None and b is None) or torch.equal(a, b), chunk
        assert parts[1].dtype == scale_dtype and parts[0].shape == (4, 9, 32)


def test_a_bad_value_in_a_later_chunk_is_still_refused() -> None:
    w = torch.randn(64, 64)
    w[63, 5] = float("nan")
    with pytest.raises(ValueError, match="Inf or NaN; MXFP4"):
        quantize_mxfp4(w, chunk_elements=64)
    with pytest.raises(ValueError, match="Inf or NaN; INT4"):
        quantize_int4(w, 32, chunk_elements=64)
    big = torch.full((64, 64), 1e6)
    with pytest.raises(ValueError, match="overflows torch.float16"):
        quantize_int4(big, 32, scale_dtype=torch.float16, chunk_elements=64)


_PEAK = """
import json, resource, sys, torch
from quant.int4 import quantize_int4
from quant.mxfp4 import quantize_mxfp4
w = torch.randn(8192, 4096)  # 128 MiB of float32
quantize_mxfp4(w[:64]); quantize_int4(w[:64], 32)  # warm up the allocator's small pools
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
{call}
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({{"grew_mib": (after - before) / 1024}}))
"""


@pytest.mark.parametrize("call", ["quantize_mxfp4(w)", "quantize_int4(w, 32)"])
def test_quantizing_a_large_weight_adds_little_beyond_its_output(call) -> None:
    """The outputs are 1/8 of the float32 input (about 17 MiB here); quantizing in one go took
    several input-sized float32 temporaries (hundreds of MiB); in chunks the peak grows by the
    outputs plus a chunk's temporaries."""
    out = subprocess.run([sys.executable, "-c", _PEAK.format(call=call)], cwd=REPO,
                         capture_output=True, text=True, timeout=300, check=True)
    grew = json.loads(out.stdout.strip().splitlines()[-1])["grew_mib"]
    assert grew < 96, f"{call}: peak RSS grew by {grew:.0f} MiB quantizing 128 MiB"
