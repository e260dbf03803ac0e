"""`with_cancellation`: a route whose client disconnects is cancelled, so that a non-streamed
generation request is aborted in the engine (and frees its KV blocks) when nobody waits for
its answer any more.

A streamed response already sees the disconnect (Starlette's `StreamingResponse` listens for
it and cancels the body's generator). A non-streamed handler only awaits the engine's outputs
and never reads the ASGI channel again, so without this it runs to the end. The idea is
vLLM's (`with_cancellation` and `listen_for_disconnect` in vllm/entrypoints/utils.py): run the
handler as a task and race it against a task that waits for the ASGI `http.disconnect`
message; whichever ends first wins, the other is cancelled. The body has been read by then
(FastAPI parsed it before calling the route), so the next `receive()` only returns when the
client goes (ASGI spec: `http.disconnect` after the last `http.request` message).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

#: The status of a response nobody reads (nginx's "client closed request").
CLIENT_CLOSED_REQUEST = 499


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client has disconnected (the ASGI `http.disconnect` message)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def with_cancellation(handler: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Wrap a FastAPI route that takes `request: Request` (keyword, as FastAPI passes it).

    The handler is cancelled when the client disconnects first: its `finally` blocks run
    (for the generation routes, closing the engine streams, which aborts their requests)
    before this returns an empty 499 response, which nobody receives. Exceptions of the
    handler (the HTTP errors) propagate unchanged. The wrapper keeps the handler's signature
    (`functools.wraps`), so FastAPI sees the same parameters.
    """

    @functools.wraps(handler)
    async def route(*args: Any, **kwargs: Any) -> Any:
        request: Request = kwargs["request"]
        work = asyncio.create_task(handler(*args, **kwargs))
        gone = asyncio.create_task(wait_for_disconnect(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                task.cancel()
            # The handler's cleanup (aborting its engine requests) finishes before we answer.
            with contextlib.suppress(asyncio.CancelledError):
                await gone
            if not work.done():
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if work.cancelled():
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        return work.result()

    return route
