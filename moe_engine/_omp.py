"""The OpenMP wait policy and torch's huge-page default, set before torch loads (imported
first by `moe_engine`).

The engine's CPU kernels run on their own thread pool (kernels/native/csrc/thread_pool.h), and
torch's OpenMP workers, which by default spin after every torch op, took the core from them
(mixed-64 batched 16-25% slower, prefill 22%; bench/NOTES.md section 14). libgomp reads
`OMP_WAIT_POLICY` when torch loads: in a process that imported torch first it reaches only the
processes this one starts (the engine core of `moe-serve`, expert-parallel ranks), and `LLM`
warns (bench/NOTES.md: torch first without a policy measured mixed-64 27% slower offline).
`MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT=1` records that the policy came from here, so that a
benchmark can give peer engines the environment without it (bench/peer_runner.py).

`THP_MEM_ALLOC_ENABLE=1` (read by torch's CPU allocator, c10/core/alloc_cpu.cpp, at its first
allocation) aligns allocations of 2 MiB and more to 2 MiB and asks for transparent huge pages
(`madvise(MADV_HUGEPAGE)`, which a kernel in THP "madvise" mode needs): a decode step reads
every weight once, and on 4 KiB pages the TLB misses cost the one-row kernels 12-14% of their
read rate (the LM head of gpt-oss-20b, bench/NOTES.md section 30). Set unless the environment
names a value; `MOE_ENGINE_THP_DEFAULT=1` marks it, as above.
"""

import os
import sys

#: Whether torch was loaded before this package with no `OMP_WAIT_POLICY` in the environment,
#: so that the policy set here came too late for this process (`moe_engine.offline.llm` warns).
TORCH_LOADED_WITHOUT_WAIT_POLICY = "OMP_WAIT_POLICY" not in os.environ and "torch" in sys.modules

if "OMP_WAIT_POLICY" not in os.environ:
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ["MOE_ENGINE_OMP_WAIT_POLICY_DEFAULT"] = "1"

if "THP_MEM_ALLOC_ENABLE" not in os.environ:
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    os.environ["MOE_ENGINE_THP_DEFAULT"] = "1"
