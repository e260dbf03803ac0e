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

from moe_engine.engine.client import EngineClient
from moe_engine.errors import ErrorCode, RequestError, StartupError
from moe_engine.request import FinishReason
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

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
                if stats.total.num_running == 0:
                    break
                await asyncio.sleep(0.02)
            assert stats.total.num_running == 0 and stats.total.num_aborted == 1
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
        from moe_engine.startup.config import EngineConfig, ModelConfig
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
    # r1 must still run when r3 arrives: the tiny model decodes 200 tokens in about 0.1 s,
    # so r1 asks for 1000 (the 64 blocks hold 1024 tokens)
    config = EngineConfig(
        ModelConfig(str(qwen3_ckpt), max_model_len=1024),
        CacheConfig(num_blocks_override=64),
        SchedulerConfig(max_num_seqs=1, max_waiting=1),
    )
    long = SamplingParams(max_tokens=1000, ignore_eos=True)

    async def main() -> None:
        client = EngineClient()
        await client.start(config)
        try:
            first = client.generate("r1", [5] * 4, long)
            await anext(first)  # r1 runs and holds the only sequence slot
            second = client.generate("r2", [6] * 4, long)
            second_task = asyncio.create_task(anext(second))
            await asyncio.sleep(0.05)  # r2 is sent, and waits
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


#: The silence bound the tests give the core (seconds), and how long they wait beyond it.
SILENCE_S = 3.0
_EXIT_MARGIN_S = 12.0

_SILENT_FRONT_END = """
import asyncio, sys, time
sys.path[:0] = [{tests!r}, {repo!r}]
from moe_engine.startup.config import EngineConfig, ModelConfig
from moe_engine.engine.client import EngineClient

async def main():
    client = EngineClient()
    start = asyncio.create_task(client.start(
        EngineConfig(ModelConfig(model="/fake")), core_factory={factory!r},
        frontend_timeout_s={silence!r}))
    while client.core_pid is None:
        await asyncio.sleep(0.05)
    if {wait_ready!r}:
        await start
    print(client.core_pid, flush=True)
    if {wait_ready!r}:
        return  # the loop ends without SHUTDOWN, as a test's loop that timed out does
    await asyncio.sleep(3600)

if __name__ == "__main__":
    asyncio.run(main())
    time.sleep(3600)  # the process (pytest) stays alive; only its front end is gone
"""


@pytest.mark.parametrize(
    ("factory", "wait_ready", "stop_parent"),
    [("fake_core:FakeEngineCore", True, False), ("fake_core:SlowEngineCore", False, True)],
    ids=["ready-loop-gone", "loading-parent-stopped"],
)
def test_core_exits_when_front_end_goes_silent(
    tmp_path: Path, factory: str, wait_ready: bool, stop_parent: bool
) -> None:
    """A front end that is alive but silent (its loop ended without SHUTDOWN, or it is stopped
    while the model loads) does not keep the core: it exits with a logged reason."""
    script = tmp_path / "front_end.py"
    script.write_text(
        _SILENT_FRONT_END.format(
            tests=str(TESTS), repo=str(REPO), factory=factory, silence=SILENCE_S,
            wait_ready=wait_ready,
        )
    )
    log = tmp_path / "stderr.txt"
    with open(log, "w") as err:
        parent = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, text=True
        )
    core_pid = -1
    try:
        core_pid = int(parent.stdout.readline())
        if stop_parent:
            parent.send_signal(signal.SIGSTOP)
        silent_at = time.monotonic()
        while _alive(core_pid) and time.monotonic() - silent_at < SILENCE_S + _EXIT_MARGIN_S:
            time.sleep(0.1)
        assert not _alive(core_pid), "engine core outlived its silent front end"
        assert parent.poll() is None  # the parent is alive: its pid did not end the core
        assert "no heartbeat from the front end" in log.read_text()
    finally:
        parent.kill()
        parent.wait()
        if core_pid > 0 and _alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_startup_progress_reaches_the_client(monkeypatch: pytest.MonkeyPatch) -> None:
    """While the core builds kernels, the client knows it, says so to callers, and logs it."""
    monkeypatch.setenv("FAKE_CORE_START_S", "4")

    async def main() -> None:
        client = EngineClient()
        start = asyncio.create_task(
            client.start(FAKE_CONFIG, core_factory="fake_core:SlowStartEngineCore")
        )
        try:
            deadline = time.monotonic() + 60
            while client.startup_status.phase != "building native CPU kernels":
                assert time.monotonic() < deadline and not start.done()
                await asyncio.sleep(0.05)
            assert client.startup_status.eta_s is not None
            with pytest.raises(RequestError) as info:
                await anext(client.generate("early", [5], SamplingParams()))
            assert info.value.code == ErrorCode.UNAVAILABLE
            text = info.value.message
            assert "building native CPU kernels" in text and "left" in text, text
            await start
            info = await client.get_model_info()
            assert info.architecture == "FakeEcho" and info.pid == client.core_pid
            outs = [o async for o in client.generate("a", [5], SamplingParams(max_tokens=2))]
            assert outs[-1].finished
        finally:
            start.cancel()
            await client.shutdown()

    asyncio.run(main())


_LEFT_RUNNING = """
import asyncio, sys, threading
sys.path[:0] = [{tests!r}, {repo!r}]
from moe_engine.startup.config import EngineConfig, ModelConfig
from moe_engine.engine.client import EngineClient

if __name__ == "__main__":
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    client = EngineClient()
    start = client.start(EngineConfig(ModelConfig(model="/fake")), core_factory={factory!r})
    asyncio.run_coroutine_threadsafe(start, loop).result(60)
    print(client.core_pid, flush=True)
    # The main thread ends with the loop (and its heartbeats) still running, no shutdown.
"""


def test_interpreter_exit_kills_a_core_never_shut_down(tmp_path: Path) -> None:
    """A server left running by a test (its loop thread still heartbeating) must not make the
    interpreter wait forever at exit for a core that ignores SIGTERM."""
    script = tmp_path / "left_running.py"
    script.write_text(
        _LEFT_RUNNING.format(tests=str(TESTS), repo=str(REPO), factory="fake_core:FakeEngineCore")
    )
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    core_pid = -1
    try:
        core_pid = int(parent.stdout.readline())
        assert parent.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while _alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(core_pid)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        if core_pid > 0 and _alive(core_pid):
            os.kill(core_pid, signal.SIGKILL)
