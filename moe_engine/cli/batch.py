"""`moe-client batch FILE.jsonl`: run a JSONL file of requests concurrently.

Each non-empty line is one request object ("prompt" or "prompt_ids", sampling fields by their
proto names; "stop" may be one string). Every line is checked before anything is sent. One
JSON line is printed per finished request (index, token_ids, finish_reason, usage, ttft_s,
e2e_s, or index and error), then a summary line (wall_s, output_tokens, output_tokens_per_s).

A batch needs each request's result, not its tokens as they come, so requests are sent with
`final_only` (one response per completion; ttft_s is then the server's measurement, from the
finished response); `--stream` streams every step's tokens instead (ttft_s measured here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from moe_engine.cli.argtypes import int_at_least
from moe_engine.cli.completions import Completions
from moe_engine.cli.request_fields import JSON_TYPE_NAMES, build_request
from moe_engine.cli.rpc_errors import error_text
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc


def add_batch_parser(sub: argparse._SubParsersAction) -> None:
    """The `batch` subcommand: FILE and --concurrency."""
    b = sub.add_parser("batch", help="run a JSONL file of requests concurrently")
    b.add_argument("file", type=Path, help="one JSON request object per line")
    b.add_argument(
        "--concurrency",
        type=int_at_least(1),
        default=16,
        help="requests in flight, >= 1 (default: %(default)s)",
    )
    b.add_argument(
        "--stream",
        action="store_true",
        help="stream each request's tokens step by step (default: one response per "
        "completion when it finishes, final_only)",
    )


class BatchFileError(ValueError):
    """Bad lines in a batch file; `problems` has one line of text per bad line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def parse_batch_line(line: str) -> pb.GenerateRequest:
    """The GenerateRequest one JSONL line describes.

    Raises:
        ValueError: not JSON, not an object, or a bad field (named, with the expected type).
    """
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(
            f"expected a JSON object, got {JSON_TYPE_NAMES.get(type(obj), 'a value')}"
        )
    return build_request(
        prompt=obj.pop("prompt", None), prompt_ids=obj.pop("prompt_ids", None), **obj
    )


def load_batch(path: Path) -> list[pb.GenerateRequest]:
    """One GenerateRequest per non-empty line of a JSONL file.

    Raises:
        BatchFileError: one problem per bad line, each naming the file, the line number
            (from 1), the field and the expected type; nothing is sent then.
        OSError: the file cannot be read.
    """
    requests = []
    problems = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            requests.append(parse_batch_line(line))
        except ValueError as exc:
            problems.append(f"{path}: line {number}: {exc}")
    if problems:
        raise BatchFileError(problems)
    return requests


async def _run_one(
    stub: pb_grpc.MoeEngineStub,
    index: int,
    request: pb.GenerateRequest,
    timeout: float | None,
    metadata: tuple[tuple[str, str], ...] = (),
    server: str | None = None,
) -> dict[str, Any]:
    """One request of a batch: its result line (the completions, ttft_s and e2e_s in seconds
    from the call's start), or {index, error: {code, message}} when the call failed."""
    start = time.perf_counter()
    ttft = None
    completions = Completions()
    try:
        async for response in stub.Generate(request, timeout=timeout, metadata=metadata or None):
            if ttft is None and response.token_ids:
                ttft = response.ttft_s if request.final_only else time.perf_counter() - start
            completions.add(response)
    except grpc.RpcError as err:
        message = error_text(err, server).removeprefix(f"{err.code().name}: ")  # code apart
        return {"index": index, "error": {"code": err.code().name, "message": message}}
    return {
        "index": index,
        **completions.as_dict(),
        "ttft_s": ttft,
        "e2e_s": time.perf_counter() - start,
    }


async def run_batch(
    server: str,
    requests: list[pb.GenerateRequest],
    concurrency: int,
    timeout: float | None,
    *,
    credentials: grpc.ChannelCredentials | None = None,
    metadata: tuple[tuple[str, str], ...] = (),
    stream: bool = False,
) -> int:
    """Run `requests` with at most `concurrency` in flight; print results as they finish.

    `credentials` (TLS, None for plaintext) and `metadata` (e.g. the API key) apply to every
    call. Without `stream`, every request is sent `final_only` (one response per completion).
    """
    for request in requests:
        request.final_only = request.final_only or not stream
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    semaphore = asyncio.Semaphore(concurrency)
    output_tokens = errors = 0
    start = time.perf_counter()
    if credentials is None:
        channel_cm = grpc.aio.insecure_channel(server)
    else:
        channel_cm = grpc.aio.secure_channel(server, credentials)
    async with channel_cm as channel:
        stub = pb_grpc.MoeEngineStub(channel)

        async def bounded(index: int, request: pb.GenerateRequest) -> dict[str, Any]:
            async with semaphore:
                return await _run_one(stub, index, request, timeout, metadata, server)

        tasks = [asyncio.create_task(bounded(i, r)) for i, r in enumerate(requests)]
        for done in asyncio.as_completed(tasks):
            result = await done
            if "error" in result:
                errors += 1
            else:
                output_tokens += int(result["usage"].get("completion_tokens", 0))
            print(json.dumps(result), flush=True)
    wall = time.perf_counter() - start
    summary = {
        "summary": True,
        "num_requests": len(requests),
        "num_errors": errors,
        "wall_s": wall,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / wall if wall > 0 else 0.0,
    }
    print(json.dumps(summary), flush=True)
    return 1 if errors else 0


def cmd_batch(
    args: argparse.Namespace,
    credentials: grpc.ChannelCredentials | None,
    metadata: tuple[tuple[str, str], ...],
) -> int:
    """Load `args.file` and run it against `args.server`.

    Returns the exit status: 2 when the file cannot be read or has bad lines (one line per
    problem on stderr, nothing sent), 1 when some request failed, else 0.
    """
    try:
        requests = load_batch(args.file)
    except BatchFileError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {args.file}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    return asyncio.run(
        run_batch(
            args.server,
            requests,
            args.concurrency,
            args.timeout,
            credentials=credentials,
            metadata=metadata,
            stream=args.stream,
        )
    )
