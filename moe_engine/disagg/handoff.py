"""A request's hand-off between a prefill instance and a decode instance, on their engine cores.

The sequence (vLLM's and SGLang's disaggregated prefill, with the decode side allocating first):

1. decode: `DecodeHandoff.park(rid, prompt, params)` validates and queues the request as any
   other, then allocates blocks for its whole prompt (a prefix-cache hit keeps its own) and
   returns where they are (`KVPlacement`: block tables and the first block to fill);
2. prefill: `PrefillHandoff.add(rid, prompt, params)` runs the prompt with max_tokens 1; when
   that step samples the first token the request finishes and keeps its blocks;
3. prefill: `PrefillHandoff.send(rid, placement)` writes the blocks into the decode
   instance's cache (`KVTransfer.write`, whole blocks per group) and frees its own;
4. decode: `DecodeHandoff.arrived(rid, first_token)` starts decoding from the received K/V
   with the first token appended (its output is the request's first).

Aborts on either side free the blocks; a transfer that fails leaves the decode request
parked, and the caller aborts it (its blocks were never in the prefix-cache map, so nothing
partially written is ever read). Under expert parallelism each rank has its own cache and
transfer engine: a placement names the decode rank's cache, and a prefill rank writes its own
blocks there. Linear-attention state models are not handled yet (`kv_transfer_for` refuses).
Served, `disagg.role` drives these from the engine core process and `disagg.router` pairs the
instances.
"""

from __future__ import annotations

from dataclasses import replace

import msgspec

from moe_engine.core.engine_core import EngineCore
from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.disagg.kv_layout import KVCacheDescriptor, block_copies, describe, slot_tensors
from moe_engine.disagg.transfer import KVTransfer
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.sampling_params import SamplingParams


class KVPlacement(msgspec.Struct, frozen=True):
    """Where a decode instance wants a request's prompt K/V.

    Attributes:
        cache: the decode instance's cache descriptor.
        tables: per KV-cache group, the request's block ids there.
        first_block: per group, the first block index to write (earlier ones are its own
            prefix-cache hit).
    """

    cache: KVCacheDescriptor
    tables: list[list[int]]
    first_block: list[int]


def kv_transfer_for(core: EngineCore, hostname: str = "127.0.0.1",
                    backend: str = "mooncake-tcp", timeout_s: float = 30.0
                    ) -> tuple[KVTransfer, KVCacheDescriptor]:
    """Register a core's KV cache with the transfer engine; (transfer, its descriptor).
    Keep the transfer object: its engine stops listening (peers' writes fail) once it is freed.

    Under expert parallelism every rank calls this for its own KV cache (each rank owns its
    requests and their blocks), so each has its own transfer engine and session.

    Raises:
        ValueError: the model keeps linear-attention state (not moved yet).
        RuntimeError: Mooncake is missing or refused to start.
    """
    if core.kv.state_slots is not None:
        raise ValueError("disaggregation: models with linear-attention state slots "
                         "(Qwen3-Next) are not supported yet")
    runner = core.runner
    transfer = KVTransfer(slot_tensors(runner.kv_caches), hostname, backend, timeout_s)
    desc = describe(transfer.session, runner.kv_caches, runner.kv_groups,
                    core.kv.pool.num_blocks)
    return transfer, desc


class PrefillHandoff:
    """The prefill instance's side: prompts run to their first token, blocks sent, freed."""

    def __init__(self, core: EngineCore, transfer: KVTransfer, cache: KVCacheDescriptor):
        self.core, self.transfer, self.cache = core, transfer, cache

    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        """Queue the prompt with max_tokens 1 (and min_tokens 0); it keeps its blocks when
        it finishes. Raises RequestError as `EngineCore.add_request`."""
        if params.n != 1:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "n",
                               f"n: a disaggregated request has one completion, got {params.n}")
        first = replace(params, max_tokens=1, min_tokens=0)
        self.core.add_request(request_id, prompt, first)
        self.core.scheduler.requests[request_id].hold_kv = True

    def send(self, request_id: str, placement: KVPlacement) -> float:
        """Write the held prefill's blocks where the decode instance placed them, then free
        them (also when the write fails); returns the transfer's seconds.

        Raises:
            KeyError: no held prefill with this id (never added, aborted, or sent already).
            TransferError: the write failed (the decode side must abort the request).
            ValueError: the two caches' layouts or block counts differ.
        """
        if request_id not in self.core.scheduler.held:
            raise KeyError(f"no prefilled request {request_id!r} waits to be sent")
        kv = self.core.kv
        try:
            tables = [kv.block_table(request_id, g) for g in range(len(self.cache.groups))]
            srcs, dsts, lens = block_copies(self.cache, placement.cache, tables,
                                            placement.tables, placement.first_block)
            return self.transfer.write(placement.cache.session, srcs, dsts, lens)
        finally:
            self.core.scheduler.release_held(request_id)

    def release(self, request_id: str) -> bool:
        """Give up a held prefill (its decode side went away); False when none is held."""
        return self.core.scheduler.release_held(request_id)


class DecodeHandoff:
    """The decode instance's side: blocks allocated first, decoding once the K/V is in."""

    def __init__(self, core: EngineCore, cache: KVCacheDescriptor):
        self.core, self.cache = core, cache

    def park(self, request_id: str, prompt: list[int], params: SamplingParams) -> KVPlacement:
        """Validate the request, allocate its prompt's blocks and say where they are.

        Raises:
            RequestError: as `EngineCore.add_request`, or RESOURCE_EXHAUSTED when the batch
                (max_num_seqs) or the KV pool has no room now (nothing is kept then).
        """
        if params.n != 1:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "n",
                               f"n: a disaggregated request has one completion, got {params.n}")
        core = self.core
        core.add_request(request_id, prompt, params)
        hit = core.scheduler.park_for_remote_kv(request_id)
        if hit is None:
            core.abort_requests([request_id])
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, "kv_cache",
                               "kv_cache: no free batch slot or KV blocks for the prompt on "
                               "this decode instance now; retry later")
        tables = [list(core.kv.block_table(request_id, g)) for g in range(len(self.cache.groups))]
        first = hit // core.kv.block_size
        return KVPlacement(self.cache, tables, [first] * len(tables))

    def arrived(self, request_id: str, first_token: int,
                first_logprobs: tuple[float, dict[int, float]] | None = None
                ) -> list[EngineCoreOutput]:
        """The K/V is in: decode from here; returns the first token's output (finished when
        that token already ends the request), with `first_logprobs` (the prefill's entry for
        it) when the request asks for logprobs.

        Raises:
            KeyError: the request is not parked (aborted meanwhile).
        """
        core = self.core
        req = core.scheduler.remote_kv_arrived(request_id, first_token,
                                               on_token=core.check_stop_strings)
        lps = [first_logprobs] if req.sampling_params.logprobs is not None else None
        if lps == [None]:
            lps = [(0.0, {})]  # a caller that sent no entry: keep tokens and entries aligned
        return core.emit_tokens(req, [first_token], lps)

    def abort(self, request_id: str) -> list[EngineCoreOutput]:
        """End a parked (or running) request and free its blocks."""
        return self.core.abort_requests([request_id])

