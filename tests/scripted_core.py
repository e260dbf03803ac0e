"""A real engine core whose outputs can be scripted from the prompt, for the chat parsers'
end-to-end tests (a random tiny model never writes a tool call by itself).

A prompt whose text holds `[[SAY:<text>:SAY]]` makes each completion "sample" the tokens of
`<text>` (encoded with the checkpoint's tokenizer, special markers included) and then EOS,
whatever the model computed; every other request runs unchanged. Everything else (scheduler,
KV cache, detokenizer, stop strings, special-token handling, outputs) is the engine's own.

Selected with `ServerThread(config, options, core_factory="scripted_core:build_scripted_core")`.
"""

from __future__ import annotations

from typing import Any

from moe_engine.core.build import build_engine_core

START, END = "[[SAY:", ":SAY]]"


def build_scripted_core(config: Any, rank_context: Any = None, **kwargs: Any) -> Any:
    """`build_engine_core`, with the runner's sampled tokens replaced for scripted prompts."""
    core = build_engine_core(config, rank_context, **kwargs)
    execute = core.runner.execute
    eos = min(core.eos_token_ids)
    scripts: dict[str, list[int] | None] = {}

    def script_of(request: Any) -> list[int] | None:
        rid = request.request_id
        if rid not in scripts:
            text = core.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=False)
            start, end = text.rfind(START), text.rfind(END)
            scripts[rid] = None
            if start != -1 and end > start:
                said = text[start + len(START):end]
                scripts[rid] = core.tokenizer.encode(said, add_special_tokens=False) + [eos]
        return scripts[rid]

    def scripted(out: Any, kv: Any) -> Any:
        rows, samples = execute(out, kv)
        for i, s in enumerate(rows):
            script = script_of(s.request)
            if script is not None:
                n = s.request.num_output_tokens
                samples.token_ids[i] = [script[min(n, len(script) - 1)]]
        return rows, samples

    core.runner.execute = scripted
    return core


def start_scripted_server(ckpt: Any, num_blocks: int = 512, max_num_seqs: int = 16,
                          max_num_batched_tokens: int = 1024) -> Any:
    """A gRPC + HTTP `ServerThread` of `ckpt` (a chat_fixtures family checkpoint) on this core,
    with `--enable-auto-tool-choice`, the test API key and model name; prompts with tools in
    the system turn are a few hundred tokens, so max_model_len is 1024. Close it with
    `.close()`."""
    from grpc_helpers import ServerThread
    from http_helpers import API_KEY, MAX_MESSAGE_BYTES, MODEL

    from moe_engine.server.app import ServerOptions
    from moe_engine.startup.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=1024),
        cache=CacheConfig(block_size=16, num_blocks_override=num_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens),
    )
    opts = ServerOptions(port=0, http_port=0, api_key=API_KEY, served_model_name=MODEL,
                         max_message_bytes=MAX_MESSAGE_BYTES, log_stats_interval_s=None,
                         enable_auto_tool_choice=True)
    return ServerThread(config, opts, core_factory="scripted_core:build_scripted_core")
