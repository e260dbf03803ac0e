"""A stand-in for EngineCore with the same methods, for front-end tests without a model.

Each step every running request "generates" one token: the prompt's tokens cycled
(`prompt[i % len(prompt)]`), shifted by one so that prompts ending in EOS still run. KV blocks
are counted like the real cache (ceil(tokens / block_size) per request), so tests can check that
aborts free them. A step sleeps `FAKE_CORE_STEP_S` seconds (default 0.01) to mimic compute.

Selected through `EngineClient.start(..., core_factory="fake_core:FakeEngineCore")`;
`fake_core:FailingEngineCore` raises at startup, `fake_core:SlowEngineCore` never gets ready,
`fake_core:SlowStartEngineCore` reports building kernels for `FAKE_CORE_START_S` seconds (default
5) before it is ready, and a prompt starting with `CRASH_TOKEN_ID` makes a step raise.
"""

from __future__ import annotations

import os
import time

from moe_engine.core.outputs import CoreStats, EngineCoreOutput, ExpertLoad, ModelInfo
from moe_engine.core.validation import validate_request
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.request import FinishReason, Request, RequestStatus
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import EngineConfig
from moe_engine.startup.progress import StartupProgressFn

VOCAB_SIZE = 512
EOS_TOKEN_ID = 2
#: A prompt starting with this id makes the next step raise (the engine-death test).
CRASH_TOKEN_ID = 499


class FakeEngineCore:
    """Echo engine: continuous batching without a model."""

    def __init__(self, config: EngineConfig, *, progress: StartupProgressFn | None = None) -> None:
        self.config = config
        self.tokenizer = None
        self.vocab_size = VOCAB_SIZE
        self.max_model_len = config.model.max_model_len or 256
        self.eos_token_ids = frozenset({EOS_TOKEN_ID})
        self.block_size = config.cache.block_size
        self.num_blocks = config.cache.num_blocks_override or 1024
        self.step_s = float(os.environ.get("FAKE_CORE_STEP_S", "0.01"))
        self.requests: dict[str, Request] = {}
        self.counters = dict.fromkeys(
            [
                "prompt_tokens_total",
                "generation_tokens_total",
                "num_finished",
                "num_aborted",
                "num_rejected",
                "num_steps",
            ],
            0,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self.requests:
            raise RequestError(
                ErrorCode.ALREADY_EXISTS, "request_id", f"request_id {request_id!r} is live"
            )
        validate_request(
            prompt_token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len
        )
        req = Request(request_id, prompt_token_ids, params, self.eos_token_ids, arrival_time or 0)
        req.status = RequestStatus.RUNNING
        self.requests[request_id] = req
        self.counters["prompt_tokens_total"] += len(prompt_token_ids)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        outputs = []
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            self.counters["num_aborted"] += 1
            outputs.append(self._output(req, [], FinishReason.ABORT))
        return outputs

    def step(self) -> list[EngineCoreOutput]:
        time.sleep(self.step_s)
        self.counters["num_steps"] += 1
        if any(r.prompt_token_ids[0] == CRASH_TOKEN_ID for r in self.requests.values()):
            raise RuntimeError("fake step failure")
        outputs = []
        for rid, req in list(self.requests.items()):
            prompt = req.prompt_token_ids
            token = (prompt[req.num_output_tokens % len(prompt)] + 1) % self.vocab_size
            req.append_token(token)
            self.counters["generation_tokens_total"] += 1
            reason = req.check_stop_token()
            if reason is not None:
                del self.requests[rid]
                self.counters["num_finished"] += 1
            outputs.append(self._output(req, [token], reason))
        return outputs

    def _output(
        self, req: Request, new: list[int], reason: FinishReason | None
    ) -> EngineCoreOutput:
        logprobs = None
        if req.sampling_params.logprobs is not None and new:
            top = {t: -0.5 for t in range(req.sampling_params.logprobs)}
            logprobs = [(-0.5, top) for _ in new]
        return EngineCoreOutput(
            request_id=req.request_id,
            new_token_ids=new,
            new_text="",
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            logprobs=logprobs,
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def _used_blocks(self) -> int:
        bs = self.block_size
        return sum((r.num_tokens + bs - 1) // bs for r in self.requests.values())

    def get_stats(self) -> CoreStats:
        used = self._used_blocks()
        return CoreStats(
            num_running=len(self.requests),
            num_waiting=0,
            kv_blocks_total=self.num_blocks,
            kv_blocks_free=self.num_blocks - used,
            kv_blocks_used=used,
            kv_cached_blocks=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            num_preemptions=0,
            **self.counters,
        )

    def get_expert_load(self) -> ExpertLoad:
        """No MoE layers: empty tables."""
        return ExpertLoad(
            moe_layers=[], counts=[], window_counts=[], window_steps=0, imbalance_ratio=[],
            balancedness=[],
        )

    def model_info(self) -> ModelInfo:
        return ModelInfo(
            model=self.config.model.model,
            architecture="FakeEcho",
            dtype="float32",
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            num_layers=0,
            num_experts=0,
            num_experts_per_tok=0,
            hidden_size=0,
            block_size=self.block_size,
            num_kv_blocks=self.num_blocks,
            max_num_seqs=self.config.scheduler.max_num_seqs,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
        )

    def close(self) -> None:
        pass


class FailingEngineCore:
    """Fails at startup the way a real core does on a bad configuration."""

    def __init__(self, config: EngineConfig, *, progress: StartupProgressFn | None = None) -> None:
        from moe_engine.errors import StartupError

        raise StartupError("fake startup failure: kv_cache_memory 1 bytes is too small")


class SlowEngineCore:
    """Never finishes loading (for the startup-timeout test)."""

    def __init__(self, config: EngineConfig, *, progress: StartupProgressFn | None = None) -> None:
        time.sleep(3600)


class SlowStartEngineCore(FakeEngineCore):
    """Reports "building native CPU kernels" with a shrinking estimate for FAKE_CORE_START_S
    seconds (from a thread of its own, as the kernel build does), then is a FakeEngineCore."""

    def __init__(self, config: EngineConfig, *, progress: StartupProgressFn | None = None) -> None:
        import threading

        total = float(os.environ.get("FAKE_CORE_START_S", "5"))
        start = time.monotonic()
        assert progress is not None, "the core process passes a progress callback"

        def tick() -> None:
            while (elapsed := time.monotonic() - start) < total:
                progress("building native CPU kernels", "fake_kernels", total - elapsed)
                time.sleep(0.2)

        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        ticker.join()
        progress("loading weights", "", None)
        super().__init__(config, progress=progress)
