"""A server with both front ends for the HTTP API tests: the tiny Qwen3-MoE with the demo's
tokenizer recipe (chat template included), gRPC and HTTP on free ports, one API key."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
from grpc_helpers import ServerThread

from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from moe_engine.startup.demo import write_tokenizer

API_KEY = "test-key"
MODEL = "tiny-qwen3"
MAX_MODEL_LEN = 128
NUM_BLOCKS = 96
MAX_MESSAGE_BYTES = 64 * 1024


def tokenizer_checkpoint(qwen3_ckpt: Path, root: Path) -> Path:
    """`qwen3_ckpt` with a 512-token byte-level BPE and the demo's chat template."""
    path = root / "qwen3-with-tokenizer"
    if not (path / "tokenizer.json").is_file():
        shutil.copytree(qwen3_ckpt, path, dirs_exist_ok=True)
        write_tokenizer(path, vocab_size=512, max_chars=300_000)
    return path


def start_server(ckpt: Path, max_waiting: int | None = None, **options) -> ServerThread:
    scheduler = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=512)
    if max_waiting is not None:
        scheduler = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=512,
                                    max_waiting=max_waiting)
    config = EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=scheduler,
    )
    opts = ServerOptions(
        port=0, http_port=0, api_key=API_KEY, served_model_name=MODEL,
        max_message_bytes=MAX_MESSAGE_BYTES, log_stats_interval_s=None, **options,
    )
    return ServerThread(config, opts)


class Grpc:
    """A gRPC stub with the API key."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.MoeEngineStub(self.channel)
        self.metadata = (("authorization", f"Bearer {API_KEY}"),)

    def stats(self) -> pb.ServerStats:
        return self.stub.GetServerStats(pb.GetServerStatsRequest(), metadata=self.metadata)

    def generate(self, req: pb.GenerateRequest) -> list[pb.GenerateResponse]:
        return list(self.stub.Generate(req, metadata=self.metadata, timeout=60))

    def close(self) -> None:
        self.channel.close()


def wait_idle(rpc: Grpc, timeout_s: float = 30.0) -> pb.ServerStats:
    """Wait until nothing runs or waits and every KV block is free (else fail)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        s = rpc.stats()
        if (s.num_running, s.num_waiting, s.kv_blocks_free) == (0, 0, s.kv_blocks_total):
            return s
        if time.monotonic() > deadline:
            pytest.fail(f"not idle after {timeout_s} s: {s}")
        time.sleep(0.05)
