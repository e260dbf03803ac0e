"""A real engine core whose finished outputs carry synthetic routed experts, for the front
ends' routing-replay tests (tests/test_routed_experts_front.py): the recording itself is the
engine's (tests/test_routed_experts*.py check it against transformers); these check what
the HTTP and gRPC front ends make of `EngineCoreOutput.routed_experts`.

For a request with `return_routed_experts`, each completion's finished output gets the ids
`synthetic_routed(tokens, index, layers, top_k, num_experts)` for its
`tokens = prompt + output - 1` positions, as raw little-endian int32 bytes with their shape,
whatever the engine recorded; everything else (scheduler, sampling, outputs) is the engine's.

Selected with `ServerThread(config, options, core_factory="routed_core:build_routed_core")`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from moe_engine.core.build import build_engine_core


def synthetic_routed(tokens: int, index: int, layers: int, top_k: int,
                     num_experts: int) -> np.ndarray:
    """[tokens, layers, top_k] int32 ids that differ by position, completion, layer and k:
    (7 t + 3 index + 5 layer + k) mod num_experts."""
    t = np.arange(tokens).reshape(-1, 1, 1)
    layer = np.arange(layers).reshape(1, -1, 1)
    k = np.arange(top_k).reshape(1, 1, -1)
    return ((7 * t + 3 * index + 5 * layer + k) % num_experts).astype(np.int32)


def build_routed_core(config: Any, rank_context: Any = None, **kwargs: Any) -> Any:
    """`build_engine_core`, with synthetic routed experts on finished outputs of requests
    that asked for them (the shape from the model: its layers, top-k and experts)."""
    core = build_engine_core(config, rank_context, **kwargs)
    info = core.model_info()
    dims = (info.num_layers, info.num_experts_per_tok, info.num_experts)
    asked: set[str] = set()
    add_request, step = core.add_request, core.step

    def add(request_id: str, prompt_token_ids: list[int], params: Any,
            arrival_time: float | None = None) -> None:
        add_request(request_id, prompt_token_ids, params, arrival_time)
        if params.return_routed_experts:
            asked.add(request_id)

    def routed_step() -> list[Any]:
        outputs = step()
        for out in outputs:
            if out.finished and out.request_id in asked:
                tokens = out.num_prompt_tokens + out.num_output_tokens - 1
                ids = synthetic_routed(tokens, out.index, *dims)
                out.routed_experts = ids.astype("<i4").tobytes()
                out.routed_experts_shape = tuple(ids.shape)
        return outputs

    core.add_request, core.step = add, routed_step
    return core


def start_routed_server(ckpt: Any) -> Any:
    """A gRPC + HTTP `ServerThread` of `ckpt` on this core, started with
    --enable-return-routed-experts, the test API key and model name. Close it with
    `.close()`."""
    from grpc_helpers import ServerThread
    from http_helpers import API_KEY, MAX_MESSAGE_BYTES, MAX_MODEL_LEN, MODEL, NUM_BLOCKS

    from moe_engine.server.app import ServerOptions
    from moe_engine.startup.config import (
        CacheConfig,
        EngineConfig,
        ModelConfig,
        SchedulerConfig,
    )

    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        enable_return_routed_experts=True,
    )
    opts = ServerOptions(port=0, http_port=0, api_key=API_KEY, served_model_name=MODEL,
                         max_message_bytes=MAX_MESSAGE_BYTES, log_stats_interval_s=None)
    return ServerThread(config, opts, core_factory="routed_core:build_routed_core")
