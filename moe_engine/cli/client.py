"""`moe-client`: talk to a `moe-serve` server.

    moe-client [--server HOST:PORT] generate (TEXT | --prompt-ids 1,2,3) [--max-tokens N]
               [--min-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
               [--stop S ...] [--ignore-eos] [--logprobs N] [--json]
    moe-client [--server HOST:PORT] batch FILE.jsonl [--concurrency N]
    moe-client [--server HOST:PORT] stats [--json]
    moe-client [--server HOST:PORT] info [--json]

`generate` streams text (token ids when the model has no tokenizer); with --json it prints one
JSON object (request_id, token_ids, text, finish_reason, usage). `batch` reads one request object
per line ("prompt" or "prompt_ids", sampling fields by their proto names), runs them
concurrently and prints one JSON line per finished request (index, token_ids, finish_reason,
usage, ttft_s, e2e_s), then a summary line (wall_s, output_tokens, output_tokens_per_s). On an
error status the code and message go to stderr and the exit status is 1.
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
from google.protobuf.json_format import MessageToDict

from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

#: Request fields a batch line may set (besides prompt / prompt_ids).
_BATCH_FIELDS = {
    f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.name not in ("text", "prompt_ids")
}


def build_request(
    *, prompt: str | None = None, prompt_ids: list[int] | None = None, **fields: Any
) -> pb.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt and sampling fields (None = unset).

    Raises:
        ValueError: an unknown field, or neither/both prompt forms.
    """
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt (text) and prompt_ids")
    unknown = set(fields) - _BATCH_FIELDS
    if unknown:
        raise ValueError(
            f"unknown request fields {sorted(unknown)}; known: {sorted(_BATCH_FIELDS)}"
        )
    request = pb.GenerateRequest(**{k: v for k, v in fields.items() if v is not None})
    if prompt is not None:
        request.text = prompt
    else:
        request.prompt_ids.ids.extend(prompt_ids or [])
        request.prompt_ids.SetInParent()
    return request


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ids like 1,2,3, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-client", description="Client for moe-serve.")
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT (default %(default)s)")
    p.add_argument("--timeout", type=float, default=None, help="deadline per call (seconds)")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate for one prompt, streaming")
    g.add_argument("text", nargs="?", default=None, help="the prompt text")
    g.add_argument("--prompt-ids", type=_parse_ids, default=None, help="prompt as ids: 1,2,3")
    g.add_argument("--max-tokens", type=int)
    g.add_argument("--min-tokens", type=int)
    g.add_argument("--temperature", type=float)
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", nargs="+", action="extend", default=[], help="stop strings")
    g.add_argument("--stop-token-ids", type=_parse_ids, default=None)
    g.add_argument("--ignore-eos", action="store_true", default=None)
    g.add_argument("--logprobs", type=int)
    g.add_argument("--request-id", default="")
    g.add_argument("--json", action="store_true", help="print one JSON object at the end")

    b = sub.add_parser("batch", help="run a JSONL file of requests concurrently")
    b.add_argument("file", type=Path)
    b.add_argument("--concurrency", type=int, default=16)

    for name, help_text in (("stats", "server statistics"), ("info", "model information")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--json", action="store_true")
    return p


def _fail(err: grpc.RpcError) -> int:
    print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
    return 1


def cmd_generate(args: argparse.Namespace, stub: pb_grpc.MoeEngineStub) -> int:
    if (args.text is None) == (args.prompt_ids is None):
        print("error: give either TEXT or --prompt-ids", file=sys.stderr)
        return 2
    request = build_request(
        prompt=args.text,
        prompt_ids=args.prompt_ids,
        request_id=args.request_id,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop or None,
        stop_token_ids=args.stop_token_ids,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
    result = {"request_id": "", "token_ids": [], "text": "", "finish_reason": "", "usage": {}}
    logprobs: list[dict] = []
    try:
        for response in stub.Generate(request, timeout=args.timeout):
            result["request_id"] = response.request_id
            result["token_ids"].extend(response.token_ids)
            result["text"] += response.text
            result["finish_reason"] = response.finish_reason
            result["usage"] = MessageToDict(
                response.usage,
                preserving_proto_field_name=True,
                always_print_fields_with_no_presence=True,
            )
            logprobs.extend(
                MessageToDict(
                    lp,
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                )
                for lp in response.logprobs
            )
            if not args.json and response.text:
                print(response.text, end="", flush=True)
    except grpc.RpcError as err:
        if not args.json:
            print()
        return _fail(err)
    if logprobs:
        result["logprobs"] = logprobs
    if args.json:
        print(json.dumps(result))
    elif result["text"]:
        print()
    else:
        print(" ".join(map(str, result["token_ids"])))
    return 0


def cmd_show(args: argparse.Namespace, stub: pb_grpc.MoeEngineStub) -> int:
    try:
        if args.command == "stats":
            message = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=args.timeout)
        else:
            message = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
    except grpc.RpcError as err:
        return _fail(err)
    data = MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    if args.json:
        print(json.dumps(data))
    else:
        width = max(map(len, data))
        for key, value in data.items():
            print(f"{key:<{width}}  {value}")
    return 0


def load_batch(path: Path) -> list[pb.GenerateRequest]:
    """One GenerateRequest per non-empty line of a JSONL file.

    Raises:
        ValueError: naming the line number of a bad line.
    """
    requests = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            requests.append(
                build_request(
                    prompt=obj.pop("prompt", None), prompt_ids=obj.pop("prompt_ids", None), **obj
                )
            )
        except (ValueError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {exc}") from exc
    return requests


async def _run_one(
    stub: pb_grpc.MoeEngineStub, index: int, request: pb.GenerateRequest, timeout: float | None
) -> dict[str, Any]:
    start = time.perf_counter()
    ttft = None
    token_ids: list[int] = []
    text = ""
    last = None
    try:
        async for response in stub.Generate(request, timeout=timeout):
            if ttft is None and response.token_ids:
                ttft = time.perf_counter() - start
            token_ids.extend(response.token_ids)
            text += response.text
            last = response
    except grpc.RpcError as err:
        return {"index": index, "error": {"code": err.code().name, "message": err.details()}}
    usage = MessageToDict(
        last.usage, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return {
        "index": index,
        "request_id": last.request_id,
        "token_ids": token_ids,
        "text": text,
        "finish_reason": last.finish_reason,
        "usage": usage,
        "ttft_s": ttft,
        "e2e_s": time.perf_counter() - start,
    }


async def run_batch(
    server: str, requests: list[pb.GenerateRequest], concurrency: int, timeout: float | None
) -> int:
    """Run `requests` with at most `concurrency` in flight; print results as they finish."""
    semaphore = asyncio.Semaphore(max(1, concurrency))
    output_tokens = errors = 0
    start = time.perf_counter()
    async with grpc.aio.insecure_channel(server) as channel:
        stub = pb_grpc.MoeEngineStub(channel)

        async def bounded(index: int, request: pb.GenerateRequest) -> dict[str, Any]:
            async with semaphore:
                return await _run_one(stub, index, request, timeout)

        tasks = [asyncio.create_task(bounded(i, r)) for i, r in enumerate(requests)]
        for done in asyncio.as_completed(tasks):
            result = await done
            if "error" in result:
                errors += 1
            else:
                output_tokens += len(result["token_ids"])
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "batch":
        try:
            requests = load_batch(args.file)
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return asyncio.run(run_batch(args.server, requests, args.concurrency, args.timeout))
    with grpc.insecure_channel(args.server) as channel:
        stub = pb_grpc.MoeEngineStub(channel)
        if args.command == "generate":
            return cmd_generate(args, stub)
        return cmd_show(args, stub)


if __name__ == "__main__":
    sys.exit(main())
