"""An engine failure after an HTTP stream started (a rank died, the engine core went down)
ends the stream with one error event in OpenAI's shape and `[DONE]`, not a cut connection
(issue 45's new-user trial: killing a rank mid-rebalance cut every open stream, rc 18 in
curl, `APIConnectionError` in the openai client)."""

from __future__ import annotations

import asyncio
import json

import pytest

from moe_engine.errors import ErrorCode, RequestError
from moe_engine.server.http.common import SSE_DONE, sse, with_error_event


async def _drain(chunks) -> list[bytes]:
    return [c async for c in chunks]


def test_engine_failure_mid_stream_ends_with_an_error_event() -> None:
    async def failing():
        yield sse({"choices": [{"index": 0, "text": "a"}]})
        raise RequestError(ErrorCode.UNAVAILABLE, "engine",
                           "engine unavailable: rank 1 (pid 42) is a zombie (it died)")

    got = asyncio.run(_drain(with_error_event(failing())))
    assert len(got) == 3 and got[-1] == SSE_DONE
    error = json.loads(got[1].removeprefix(b"data: "))["error"]
    assert "rank 1 (pid 42)" in error["message"]
    assert error["code"] == "unavailable" and error["type"] != "invalid_request_error"


def test_a_stream_that_ends_well_is_unchanged() -> None:
    async def fine():
        yield sse({"choices": []})
        yield SSE_DONE

    assert asyncio.run(_drain(with_error_event(fine()))) == [sse({"choices": []}), SSE_DONE]


def test_other_exceptions_still_propagate() -> None:
    async def broken():
        yield b""
        raise KeyError("bug")

    with pytest.raises(KeyError):
        asyncio.run(_drain(with_error_event(broken())))
