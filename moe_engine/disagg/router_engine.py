"""`RouterEngine`: the engine the router's OpenAI HTTP API runs on, a prefill/decode `Pairing`.

The HTTP routes (`moe_engine.server.http`) are written against `EngineClient`; this class has
the part of its interface they use (`model_info`, `tokenizer`, `encode`, `generate`, `abort`,
`dead`), so the router serves exactly moe-serve's OpenAI API: chat templates, streaming,
logprobs, stop strings, structured output and the same errors. A request's `SamplingParams`
travel to the instances as the GenerateRequest fields `convert.sampling_params_from_proto`
reads back (`request_from_params` is its inverse), and each GenerateResponse comes back as the
EngineCoreOutput `convert.response_from_output` made it from (`output_from_response`).

The tokenizer is the checkpoint's, loaded in the router from the path the decode instance
serves (`ModelInfo.model`, so the router needs that path too, as vLLM's and SGLang's routers
need the model's tokenizer) or from `--tokenizer`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from moe_engine.core.outputs import EngineCoreOutput, ModelInfo
from moe_engine.disagg.pairing import BackendError, Pairing
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.request import FinishReason
from moe_engine.sampling_params import OUTPUT_FINAL_ONLY, SamplingParams
from moe_engine.server.pb import moe_engine_pb2 as pb

logger = logging.getLogger(__name__)

#: The SamplingParams fields sent as GenerateRequest fields of the same name.
_SCALARS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos",
            "logprobs", "n", "include_stop_str_in_output", "skip_special_tokens",
            "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p",
            "truncate_prompt_tokens", "priority")


def request_from_params(request_id: str, prompt: list[int], params: SamplingParams
                        ) -> pb.GenerateRequest:
    """The GenerateRequest that `convert.sampling_params_from_proto` turns back into
    `params` (every field; unset optional fields keep their defaults there)."""
    req = pb.GenerateRequest(request_id=request_id, prompt_ids=pb.TokenIds(ids=prompt),
                             stop=list(params.stop or ()),
                             stop_token_ids=list(params.stop_token_ids or ()),
                             final_only=params.output_kind == OUTPUT_FINAL_ONLY)
    for name in _SCALARS:
        value = getattr(params, name)
        if value is not None:
            setattr(req, name, value)
    if params.logit_bias:
        req.logit_bias.update(params.logit_bias)
    so = params.structured_outputs
    if so is not None:
        req.json_schema = so.json or ""
        req.json_object = so.json_object
    return req


def output_from_response(response: pb.GenerateResponse) -> EngineCoreOutput:
    """The EngineCoreOutput `convert.response_from_output` made `response` from (logprobs as
    the wire's float32)."""
    logprobs = [
        (e.logprob, {t.token_id: t.logprob for t in e.top_logprobs}) for e in response.logprobs
    ] or None
    kind = response.WhichOneof("stop_reason")
    return EngineCoreOutput(
        request_id=response.request_id,
        new_token_ids=list(response.token_ids),
        new_text=response.text,
        finished=response.finished,
        finish_reason=FinishReason(response.finish_reason) if response.finish_reason else None,
        num_prompt_tokens=response.usage.prompt_tokens,
        num_output_tokens=response.usage.completion_tokens,
        logprobs=logprobs,
        index=response.index,
        stop_reason=getattr(response, kind) if kind else None,
        weight_version=response.weight_version,
        weight_versions=[(w.weight_version, w.start) for w in response.weight_versions]
        if response.finished else None,
        kv_from_other_weights=response.kv_from_other_weights,
    )


def model_info_from_proto(info: pb.ModelInfo) -> ModelInfo:
    """ModelInfo from GetModelInfo's answer (the fields the proto carries)."""
    fields = {name: getattr(info, name) for name in ModelInfo.__struct_fields__
              if name not in ("experts_per_rank", "kernel_backends", "local_experts",
                              "rank_pids") and name in pb.ModelInfo.DESCRIPTOR.fields_by_name}
    return ModelInfo(**fields, kernel_backends=dict(info.kernel_backends),
                     experts_per_rank=[list(r.experts) for r in info.experts_per_rank])


class RouterEngine:
    """An `EngineClient` look-alike over a `Pairing` (see the module docstring).

    Attributes:
        model_info: the decode instances' model (None until `start` has it).
        tokenizer: the checkpoint's tokenizer in the router, or None.
        dead: never set (an instance that dies fails its requests, not the router).
    """

    def __init__(self, pairing: Pairing, tokenizer_path: str | None = None) -> None:
        self.pairing = pairing
        self.tokenizer_path = tokenizer_path
        self.model_info: ModelInfo | None = None
        self.tokenizer: Any | None = None
        self.dead = asyncio.Event()

    async def start(self, wait_s: float = 600.0) -> None:
        """Wait for a decode instance's model info (they may still be loading), then load the
        tokenizer; `model_info` is set last (the HTTP API takes requests from then on).

        Raises:
            RequestError: UNAVAILABLE when no decode instance answered within `wait_s`.
        """
        deadline = time.monotonic() + wait_s
        while True:
            try:
                info = model_info_from_proto(await self.pairing.model_info())
                break
            except BackendError as exc:
                if time.monotonic() > deadline:
                    raise exc.as_request_error() from None
                await asyncio.sleep(0.5)
        path = self.tokenizer_path or (info.model if info.has_tokenizer else None)
        if path is not None:
            from moe_engine.core.tokenizer import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, path)
            if self.tokenizer is None:
                logger.warning("moe-router: no tokenizer at %s (pass --tokenizer): the HTTP "
                               "API takes token-id prompts only", path)
        self.model_info = info

    def encode(self, text: str) -> list[int]:
        """Tokenise a text prompt.

        Raises:
            RequestError: INVALID_ARGUMENT ("text") when the router has no tokenizer.
        """
        if self.tokenizer is None:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "text",
                               "text: the router has no tokenizer for this model (moe-router "
                               "--tokenizer PATH); send the prompt as token ids")
        return list(self.tokenizer.encode(text))

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, arrival_time: float | None = None
                       ) -> AsyncIterator[EngineCoreOutput]:
        """The request's outputs through a prefill and a decode instance.

        Raises:
            RequestError: a refusal or failure on either instance (`BackendError`'s code,
                field and message); INVALID_ARGUMENT "return_routed_experts" for routing
                replay, which disaggregation does not carry (the prompt's routing is on the
                prefill instance), refused rather than answered without it.
        """
        if params.return_routed_experts:
            raise RequestError(ErrorCode.INVALID_ARGUMENT, "return_routed_experts",
                               "return_routed_experts: not available through moe-router "
                               "(prefill/decode disaggregation); ask a moe-serve started "
                               "with --enable-return-routed-experts directly")
        request = request_from_params(request_id, list(prompt_token_ids), params)
        try:
            async with aclosing(self.pairing.generate(request)) as stream:
                async for response in stream:
                    yield output_from_response(response)
        except BackendError as exc:
            raise exc.as_request_error() from None

    async def abort(self, request_id: str) -> bool:
        """Abort the request on every instance; True when one had it live."""
        return await self.pairing.abort(request_id)
