"""The endpoints: /v1/completions, /v1/chat/completions, /v1/models (and /v1/models/{id}),
/tokenize, /detokenize, /health, /ping, /metrics, /version (the last six as vLLM's server names
them). SGLang's RL admin endpoints
(/pause_generation, /continue_generation, /update_weights_from_disk) are in `admin.py`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from moe_engine import __version__
from moe_engine.server.http.cancellation import with_cancellation
from moe_engine.server.http.chat import create_chat_completion, render_chat
from moe_engine.server.http.completions import create_completion
from moe_engine.server.http.errors import OpenAIError
from moe_engine.server.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from moe_engine.server.http.state import HttpState

router = APIRouter()


def _state(request: Request) -> HttpState:
    return request.app.state.http


@router.post("/v1/completions")
@with_cancellation
async def completions(body: CompletionRequest, request: Request):
    return await create_completion(_state(request), body)


@router.post("/v1/chat/completions")
@with_cancellation
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await create_chat_completion(_state(request), body)


def _model_entry(state: HttpState) -> dict:
    """The served model as OpenAI's Model object (with vLLM's `root` and `max_model_len`)."""
    info = state.engine.model_info
    return {
        "id": state.served_model_name, "object": "model", "created": state.created,
        "owned_by": "moe-engine", "root": info.model if info is not None else None,
        "max_model_len": info.max_model_len if info is not None else None,
    }


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    return JSONResponse({"object": "list", "data": [_model_entry(_state(request))]})


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> JSONResponse:
    """OpenAI's models.retrieve: the served model, or 404 (model_not_found) for another id."""
    state = _state(request)
    state.check_model(model_id)
    return JSONResponse(_model_entry(state))


def _need_tokenizer(state: HttpState, field: str):
    state.check_ready()
    if state.tokenizer is None:
        raise OpenAIError(400, f"{field}: the served model has no tokenizer (its folder has no "
                          "tokenizer files; start the server with --tokenizer PATH)", field,
                          "unsupported_value")
    return state.tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    """`prompt` (or `messages` through the chat template) as token ids."""
    state = _state(request)
    state.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "give either prompt or messages", "prompt", "invalid_value")
    if body.messages is not None:
        _need_tokenizer(state, "messages")
        tokens = render_chat(state, body.messages, body.add_generation_prompt,
                             tools=body.tools, continue_final_message=body.continue_final_message,
                             chat_template_kwargs=body.chat_template_kwargs)
    else:
        tok = _need_tokenizer(state, "prompt")
        tokens = list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    return JSONResponse(
        {"count": len(tokens), "max_model_len": state.max_model_len(), "tokens": tokens}
    )


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    state = _state(request)
    state.check_model(body.model)
    tok = _need_tokenizer(state, "tokens")
    vocab = state.engine.model_info.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise OpenAIError(
            400, f"tokens: token id {bad[0]} is outside [0, {vocab}) (vocab_size {vocab})",
            "tokens", "invalid_value",
        )
    return JSONResponse({"prompt": tok.decode(body.tokens)})


@router.get("/health")
async def health(request: Request) -> Response:
    """200 with an empty body while serving; 503 in OpenAI's error shape saying why not."""
    _state(request).check_ready()
    return Response(status_code=200)


@router.get("/ping")
@router.post("/ping")
async def ping(request: Request) -> Response:
    """SageMaker's health probe (as vLLM serves it): /health's answer, GET or POST."""
    _state(request).check_ready()
    return Response(status_code=200)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    """Prometheus' text exposition: the `moe_engine_*` and `vllm:*` series, as on
    --metrics-port (404 where the server keeps no metrics)."""
    server_metrics = _state(request).metrics
    if server_metrics is None:
        raise OpenAIError(404, "GET /metrics: this server keeps no metrics", None, None)
    body, content_type = server_metrics.render()
    return Response(body, media_type=content_type)


@router.get("/version")
async def version() -> JSONResponse:
    return JSONResponse({"version": __version__})
