"""EngineClient and the core process: startup errors, timeouts, parent death, queue limits."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moe_engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from moe_engine.engine.client import EngineClient
from moe_engine.errors import ErrorCode, RequestError, StartupError
from moe_engine.request import FinishReason, SamplingParams

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FAKE_CONFIG = EngineConfig(ModelConfig(model="/fake", max_model_len=256))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_startup_failure_is_reported_not_hung() -> None:
    async def main() -> None:
        client = EngineClient()
        t0 = time.monotonic()
        with pytest.raises(StartupError, match="fake startup failure: kv_cache_memory"):
            await client.start(FAKE_CONFIG, core_factory="fake_core:FailingEngineCore")
        assert time.monotonic() - t0 < 60
        assert client.dead.is_set()

    asyncio.run(main())


def test_startup_timeout_kills_the_core() -> None:
    async def main() -> None:
        client = EngineClient()
        with pytest.raises(StartupError, match="not ready within"):
            await client.start(
                FAKE_CONFIG, core_factory="fake_core:SlowEngineCore", startup_timeout_s=4
            )
        assert client.core_pid is not None and not _alive(client.core_pid)

    asyncio.run(main())


def test_fake_core_generate_abort_and_close() -> None:
    async def main() -> None:
        client = EngineClient()
        await client.start(FAKE_CONFIG, core_factory="fake_core:FakeEngineCore")
        try:
            outs = [o async for o in client.generate("a", [5, 6], SamplingParams(max_tokens=4))]
            assert [t for o in outs for t in o.new_token_ids] == [6, 7, 6, 7]
            assert outs[-1].finish_reason == FinishReason.LENGTH
            # Consumer stops early: the request is aborted in the core.
            stream = client.generate("b", [5], SamplingParams(max_tokens=200))
            await anext(stream)
            await stream.aclose()
            for _ in range(100):
                stats = await client.get_stats()
                if stats["num_running"] == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats["num_running"] == 0 and stats["num_aborted"] == 1
            with pytest.raises(RequestError) as info:
                await anext(client.generate("c", [], SamplingParams()))
            assert info.value.field == "prompt"
        finally:
            await client.shutdown()
        with pytest.raises(RequestError) as info:
            await anext(client.generate("d", [5], SamplingParams()))
        assert info.value.code == ErrorCode.UNAVAILABLE

    asyncio.run(main())


def test_core_exits_when_parent_dies(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path[:0] = [{str(TESTS)!r}, {str(REPO)!r}]
        from moe_engine.config import EngineConfig, ModelConfig
        from moe_engine.engine.client import EngineClient

        async def main():
            client = EngineClient()
            await client.start(EngineConfig(ModelConfig(model="/fake")),
                               core_factory="fake_core:FakeEngineCore")
            print(client.core_pid, flush=True)
            await asyncio.sleep(3600)

        if __name__ == "__main__":
            asyncio.run(main())
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        assert _alive(core_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(core_pid), "engine core outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()


def test_queue_full_is_resource_exhausted(qwen3_ckpt: Path) -> None:
    config = EngineConfig(
        ModelConfig(str(qwen3_ckpt), max_model_len=256),
        CacheConfig(num_blocks_override=64),
        SchedulerConfig(max_num_seqs=1, max_waiting=1),
    )
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def main() -> None:
        client = EngineClient()
        await client.start(config)
        try:
            first = client.generate("r1", [5] * 4, long)
            await anext(first)  # r1 runs and holds the only sequence slot
            second = client.generate("r2", [6] * 4, long)
            second_task = asyncio.create_task(anext(second))
            await asyncio.sleep(0.2)  # r2 waits
            with pytest.raises(RequestError) as info:
                await anext(client.generate("r3", [7] * 4, long))
            assert info.value.code == ErrorCode.RESOURCE_EXHAUSTED
            assert "max_waiting" in info.value.message
            assert await client.abort("r1") and await client.abort("r2")
            assert not await client.abort("r1")  # already being aborted
            await second_task
            await first.aclose()
            await second.aclose()
        finally:
            await client.shutdown()

    asyncio.run(main())


def test_core_failure_ends_streams_with_unavailable() -> None:
    from fake_core import CRASH_TOKEN_ID

    async def main() -> None:
        client = EngineClient()
        await client.start(FAKE_CONFIG, core_factory="fake_core:FakeEngineCore")
        try:
            with pytest.raises(RequestError) as info:
                async for _ in client.generate("x", [CRASH_TOKEN_ID], SamplingParams()):
                    pass
            assert info.value.code == ErrorCode.UNAVAILABLE
            assert "fake step failure" in info.value.message
            await asyncio.wait_for(client.dead.wait(), 10)
        finally:
            await client.shutdown()

    asyncio.run(main())
