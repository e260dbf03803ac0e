"""`moe-client`: talk to a `moe-serve` server.

    moe-client [--server HOST:PORT] generate (TEXT | --prompt-ids 1,2,3) [--max-tokens N]
               [--min-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
               [--stop S [--stop S ...]] [--ignore-eos] [--logprobs N] [--json]
    moe-client [--server HOST:PORT] batch FILE.jsonl [--concurrency N]
    moe-client [--server HOST:PORT] stats [--json]
    moe-client [--server HOST:PORT] info [--json]
    moe-client [--server HOST:PORT] health [--wait S] [--service NAME] [--json]
    moe-client --version

Common flags: --server HOST:PORT (the port is required, gRPC would otherwise pick 443; default
127.0.0.1:50051; IPv6 as [::1]:50051), --timeout S (deadline per call, seconds > 0), --api-key
KEY (or $MOE_ENGINE_API_KEY; sent as the metadata "authorization: Bearer KEY"), --tls (TLS with
the system's CAs), --tls-ca PEM (the CA that signed the server's certificate; implies --tls),
--tls-cert PEM --tls-key PEM (a client certificate, for servers started with --tls-ca).

`generate` streams text (token ids when the model has no tokenizer); `--stop` takes exactly one
stop string and is repeated for several (`--stop a --stop b`), so a prompt after it is never
taken for a stop string (`--stop=VALUE` for a value that starts with "-"); with --json it
prints one JSON object (request_id, token_ids, text, finish_reason, usage). `batch` reads one
request object per line ("prompt" or "prompt_ids", sampling fields by their proto names), runs
them concurrently and prints one JSON line per finished request (index, token_ids, finish_reason,
usage, ttft_s, e2e_s), then a summary line (wall_s, output_tokens, output_tokens_per_s); a
batch line's "stop" may be one string. On an error status the code and message go to stderr and
the exit status is 1 (when nothing answers at the address, the message says the server may not
be running there); `health` prints SERVING, NOT_SERVING or UNKNOWN (with the server's detail,
e.g. what it is loading) and exits 0 only when SERVING; a bad flag or batch line is one line
per problem on stderr and exit status 2 (nothing is sent); Ctrl-C cancels what is in flight and
exits 130.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import grpc
from google.protobuf import descriptor

from moe_engine import __version__
from moe_engine.cli.argtypes import int_at_least, positive_seconds
from moe_engine.cli.completions import Completions
from moe_engine.cli.health import add_health_parser, cmd_health
from moe_engine.request import SamplingParams
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.security import (
    API_KEY_ENV,
    api_key_from_env,
    auth_metadata,
    channel_credentials,
    check_api_key,
)

#: Request fields a batch line may set (besides prompt / prompt_ids).
_BATCH_FIELDS = {
    f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.name not in ("text", "prompt_ids")
}


_FD = descriptor.FieldDescriptor
#: Integer proto types -> (low, high, description).
_INT_RANGES = {
    _FD.TYPE_INT32: (-(2**31), 2**31 - 1, "a 32-bit integer"),
    _FD.TYPE_INT64: (-(2**63), 2**63 - 1, "a 64-bit integer"),
    _FD.TYPE_UINT32: (0, 2**32 - 1, "an unsigned 32-bit integer"),
    _FD.TYPE_UINT64: (0, 2**64 - 1, "an unsigned 64-bit integer"),
}
_INT32 = _INT_RANGES[_FD.TYPE_INT32]
_JSON_TYPE_NAMES = {
    str: "a string",
    bool: "a boolean",
    int: "an integer",
    float: "a number",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _describe(value: Any) -> str:
    """`value` for an error message, with its JSON type."""
    kind = _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
    return f"{json.dumps(value)[:40]} ({kind})" if kind != "null" else "null"


def _check_utf8(value: str) -> str | None:
    """None when `value` can be sent (encodes as UTF-8), else why not."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "is not valid UTF-8 (undecodable bytes in the argument)"
    return None


def _check_scalar(field: descriptor.FieldDescriptor, value: Any) -> str | None:
    """None when `value` fits `field`'s scalar type, else what was expected instead."""
    if field.type in _INT_RANGES:
        low, high, what = _INT_RANGES[field.type]
        if isinstance(value, bool) or not isinstance(value, int):
            return f"expected {what}, got {_describe(value)}"
        if not low <= value <= high:
            return f"expected {what} in {low}..{high}, got {value}"
    elif field.type in (_FD.TYPE_DOUBLE, _FD.TYPE_FLOAT):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {_describe(value)}"
    elif field.type == _FD.TYPE_BOOL:
        if not isinstance(value, bool):
            return f"expected true or false, got {_describe(value)}"
    elif field.type == _FD.TYPE_STRING:
        if not isinstance(value, str):
            return f"expected a string, got {_describe(value)}"
        bad = _check_utf8(value)
        if bad is not None:
            return bad
    return None


def _check_field(name: str, value: Any) -> Any:
    """`value` for request field `name`, type-checked (a lone string is one stop string).

    Raises:
        ValueError: naming the field and the expected type.
    """
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name[name]
    if field.is_repeated:
        if name == "stop" and isinstance(value, str):
            value = [value]
        if not isinstance(value, list):
            element = "strings" if field.type == _FD.TYPE_STRING else "integers"
            raise ValueError(f"{name}: expected an array of {element}, got {_describe(value)}")
        for i, item in enumerate(value):
            problem = _check_scalar(field, item)
            if problem is not None:
                raise ValueError(f"{name}[{i}]: {problem}")
        return value
    problem = _check_scalar(field, value)
    if problem is not None:
        raise ValueError(f"{name}: {problem}")
    return value


def build_request(
    *, prompt: str | None = None, prompt_ids: list[int] | None = None, **fields: Any
) -> pb.GenerateRequest:
    """A GenerateRequest from a text or token-id prompt and sampling fields (None = unset).

    Each field's value is checked against its proto type; `stop` may be one string.

    Raises:
        ValueError: an unknown field, a value of the wrong type or out of the proto type's
            range (naming the field and the expected type), or neither/both prompt forms.
    """
    if (prompt is None) == (prompt_ids is None):
        raise ValueError("give exactly one of prompt (text) and prompt_ids")
    unknown = set(fields) - _BATCH_FIELDS
    if unknown:
        raise ValueError(
            f"unknown request fields {sorted(unknown)}; known: {sorted(_BATCH_FIELDS)}"
        )
    checked = {k: _check_field(k, v) for k, v in fields.items() if v is not None}
    request = pb.GenerateRequest(**checked)
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"prompt: expected a string, got {_describe(prompt)}")
        bad = _check_utf8(prompt)
        if bad is not None:
            raise ValueError(f"prompt: {bad}")
        request.text = prompt
    else:
        if not isinstance(prompt_ids, list):
            raise ValueError(
                f"prompt_ids: expected an array of integers, got {_describe(prompt_ids)}"
            )
        ids_field = pb.TokenIds.DESCRIPTOR.fields_by_name["ids"]
        for i, item in enumerate(prompt_ids):
            problem = _check_scalar(ids_field, item)
            if problem is not None:
                raise ValueError(f"prompt_ids[{i}]: {problem}")
        request.prompt_ids.ids.extend(prompt_ids)
        request.prompt_ids.SetInParent()
    return request


def _parse_ids(text: str) -> list[int]:
    """Comma-separated 32-bit token ids ("1,2,3"; spaces allowed, empty elements not)."""
    parts = text.replace(" ", "").split(",")
    if any(not part for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected ids like 1,2,3 (no empty elements), got {text!r}"
        )
    try:
        ids = [int(part) for part in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ids like 1,2,3, got {text!r}") from None
    low, high, what = _INT32
    for value in ids:
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"each id must be {what} in {low}..{high}, got {value}"
            )
    return ids


def _int_type(field_name: str):
    """An argparse type: an integer in the range of GenerateRequest's `field_name`."""
    field = pb.GenerateRequest.DESCRIPTOR.fields_by_name[field_name]
    low, high, what = _INT_RANGES[field.type]

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be {what} in {low}..{high}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def _utf8_text(text: str) -> str:
    """An argparse type: text that can be sent (valid UTF-8)."""
    bad = _check_utf8(text)
    if bad is not None:
        raise argparse.ArgumentTypeError(f"{ascii(text)} {bad}")
    return text



def server_address(text: str) -> str:
    """An argparse type: a gRPC server address HOST:PORT (IPv6 as [ADDR]:PORT), port 1..65535.

    The port is required: gRPC would otherwise silently pick 443, not moe-serve's 50051.

    Raises:
        argparse.ArgumentTypeError: no port, an empty host, a bare IPv6 address, or a port that
            is not an integer in 1..65535.
    """
    example = "HOST:PORT, e.g. 127.0.0.1:50051 or [::1]:50051"
    if text.startswith("["):  # [IPv6]:PORT
        end = text.find("]")
        host, rest = (text[: end + 1], text[end + 1 :]) if end > 1 else (text, "")
        if end <= 1 or any(c.isspace() for c in host):
            raise argparse.ArgumentTypeError(f"expected {example}, got {text!r}")
        sep, port = rest[:1], rest[1:]
        if sep != ":" or not port:
            raise argparse.ArgumentTypeError(f"expected {example}; {text!r} has no port")
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not port or ":" in host:
            why = " (IPv6 addresses go in brackets)" if ":" in host else ""
            raise argparse.ArgumentTypeError(f"expected {example}; {text!r} has no port{why}")
        if not host or any(c.isspace() for c in host):
            why = "has no host" if not host else "has a space in its host"
            raise argparse.ArgumentTypeError(f"expected {example}; {text!r} {why}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected {example}; the port must be an integer in 1..65535, got {port!r}"
        )
    return text



class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): `prog: error: argument --flag: why`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe-client", description="Client for moe-serve.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--server",
        type=server_address,
        default="127.0.0.1:50051",
        metavar="HOST:PORT",
        help="server address; the port is required ([::1]:PORT for IPv6; default %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="deadline per call, seconds > 0 (default: none)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help=f"API key sent with every call (default ${API_KEY_ENV}, else none)",
    )
    p.add_argument("--tls", action="store_true", help="connect with TLS (the system's CAs)")
    p.add_argument("--tls-ca", default=None, help="PEM CA of the server's certificate (TLS)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    sub = p.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)

    b = sub.add_parser("batch", help="run a JSONL file of requests concurrently")
    b.add_argument("file", type=Path, help="one JSON request object per line")
    b.add_argument(
        "--concurrency",
        type=int_at_least(1),
        default=16,
        help="requests in flight, >= 1 (default: %(default)s)",
    )

    for name, help_text in (("stats", "server statistics"), ("info", "model information")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--json", action="store_true", help="print one JSON object")
    add_health_parser(sub)
    return p


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """The `generate` subcommand; each sampling flag's help gives the default the server
    applies when the flag is not given (`SamplingParams`' defaults, vLLM's)."""
    d = SamplingParams()
    g = sub.add_parser("generate", help="generate for one prompt, streaming")
    g.add_argument("text", nargs="?", type=_utf8_text, default=None, help="the prompt text")
    g.add_argument(
        "--prompt-ids",
        type=_parse_ids,
        default=None,
        metavar="IDS",
        help="the prompt as token ids, 1,2,3, instead of TEXT (default: none)",
    )
    g.add_argument(
        "--max-tokens",
        type=_int_type("max_tokens"),
        metavar="N",
        help=f"most tokens to generate (default: {d.max_tokens})",
    )
    g.add_argument(
        "--min-tokens",
        type=_int_type("min_tokens"),
        metavar="N",
        help=f"tokens generated before EOS or a stop counts (default: {d.min_tokens})",
    )
    g.add_argument(
        "--temperature",
        type=float,
        metavar="T",
        help=f"0 is greedy (default: {d.temperature})",
    )
    g.add_argument(
        "--top-p", type=float, metavar="P", help=f"nucleus mass, in (0, 1] (default: {d.top_p})"
    )
    g.add_argument(
        "--top-k",
        type=_int_type("top_k"),
        metavar="K",
        help=f"sample among the K most likely tokens, -1 for all (default: {d.top_k})",
    )
    g.add_argument(
        "--seed",
        type=_int_type("seed"),
        metavar="S",
        help="per-request seed: the same seed and prompt give the same tokens (default: none)",
    )
    g.add_argument(
        "--stop",
        action="append",
        type=_utf8_text,
        default=None,
        metavar="S",
        help="a stop string; repeat the flag for several (--stop a --stop b); a newline in "
        "bash: --stop $'\\n'; a value starting with '-': --stop=-x (default: none)",
    )
    g.add_argument(
        "--stop-token-ids",
        type=_parse_ids,
        default=None,
        metavar="IDS",
        help="token ids that end the request besides EOS: 5,9 (default: none)",
    )
    g.add_argument(
        "--ignore-eos",
        action="store_true",
        default=None,
        help="generate past the model's EOS token (default: off)",
    )
    g.add_argument(
        "--logprobs",
        type=_int_type("logprobs"),
        metavar="N",
        help="return the N most likely tokens' logprobs per token (default: none)",
    )
    g.add_argument(
        "--n",
        type=_int_type("n"),
        metavar="N",
        help=f"parallel sampling: N completions of the prompt, sharing its KV blocks; with a "
        f"seed, completion i uses seed + i (default: {d.n})",
    )
    g.add_argument(
        "--request-id",
        type=_utf8_text,
        default="",
        metavar="ID",
        help="the request's id (default: one the server makes)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end (default: stream the text)",
    )


#: gRPC's own words (in UNAVAILABLE details) for a call that never reached a server: a host
#: name that does not resolve, and nothing listening.
_RESOLVE_FAILURES = ("errors resolving", "dns resolution failed", "name resolution")
_CONNECT_FAILURES = (
    "failed to connect",
    "connection refused",
    "connections to all backends failing",
)


def _error_text(err: grpc.RpcError, server: str | None = None) -> str:
    """`CODE: details`, with a hint when gRPC itself refused an oversize message, or when the
    call could not reach `server` (nothing listening, an unknown host, a TLS mismatch)."""
    details = err.details() or ""
    text = f"{err.code().name}: {details}"
    if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
        text += (
            " (the request is far over the server's message size limit: send a smaller "
            "request, or restart moe-serve with a larger --max-message-bytes)"
        )
    elif err.code() == grpc.StatusCode.UNAVAILABLE:
        text += _connect_hint(details.lower(), server or "the address given")
    return text


def _connect_hint(details: str, server: str) -> str:
    """The hint for an UNAVAILABLE whose details are gRPC's connection errors ("" otherwise:
    the server itself answered UNAVAILABLE, e.g. while it loads or drains)."""
    if "handshake" in details or "ssl" in details:
        return (
            f" (the TLS handshake with {server} failed: drop --tls for a plaintext server, or "
            "give the CA that signed its certificate with --tls-ca)"
        )
    if "socket closed" in details:
        return (
            f" (the connection to {server} was closed: is it a moe-serve server? a TLS server "
            "needs --tls)"
        )
    if any(phrase in details for phrase in _RESOLVE_FAILURES):
        host = server.rpartition(":")[0] or server
        return f" (the host {host} of {server} does not resolve: check --server HOST:PORT)"
    if any(phrase in details for phrase in _CONNECT_FAILURES):
        return (
            f" (the server may not be running at {server}: start it with `moe-serve`, or "
            "point --server HOST:PORT at it)"
        )
    return ""


def _fail(err: grpc.RpcError, server: str | None = None) -> int:
    print(f"error: {_error_text(err, server)}", file=sys.stderr)
    return 1


def request_from_args(args: argparse.Namespace) -> pb.GenerateRequest:
    """The GenerateRequest `generate`'s flags describe.

    Raises:
        ValueError: neither or both of TEXT and --prompt-ids, or a bad value.
    """
    if (args.text is None) == (args.prompt_ids is None):
        raise ValueError("give either TEXT or --prompt-ids")
    return build_request(
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
        n=args.n,
    )


def cmd_generate(
    args: argparse.Namespace, stub: pb_grpc.MoeEngineStub, request: pb.GenerateRequest
) -> int:
    """Run one Generate call: stream the text of a single completion as it comes, or, with
    `--n` > 1, print each completion when all are done ("[i] text" lines, or one JSON object
    whose `completions` list holds them)."""
    completions = Completions()
    stream_text = not args.json and request.n <= 1
    printed = False  # streamed text is on the terminal, without its final newline
    call = stub.Generate(request, timeout=args.timeout)
    try:
        for response in call:
            completions.add(response)
            if stream_text and response.text:
                print(response.text, end="", flush=True)
                printed = True
    except KeyboardInterrupt:
        call.cancel()  # the server aborts the request
        if printed:
            print()
        return 130
    except grpc.RpcError as err:
        if printed:
            print()
        return _fail(err, args.server)
    result = completions.as_dict()
    if args.json:
        print(json.dumps(result))
    elif not stream_text:
        for c in result["completions"]:
            body = c["text"] or " ".join(map(str, c["token_ids"]))
            print(f"[{c['index']}] {body}")
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
        return _fail(err, args.server)
    data = message_dict(message)
    if args.json:
        print(json.dumps(data))
    else:
        width = max(map(len, data))
        for key, value in data.items():
            print(f"{key:<{width}}  {value}")
    return 0


def message_dict(message: Any) -> dict[str, Any]:
    """A message's fields as plain JSON values (64-bit integers stay numbers), by proto name.

    Fields without presence are always included; optional ones only when set.
    """
    data: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        if field.is_repeated:
            values = getattr(message, field.name)
            is_message = field.type == _FD.TYPE_MESSAGE
            data[field.name] = [message_dict(v) if is_message else v for v in values]
        elif field.has_presence and not message.HasField(field.name):
            continue
        elif field.type == _FD.TYPE_MESSAGE:
            data[field.name] = message_dict(getattr(message, field.name))
        else:
            data[field.name] = getattr(message, field.name)
    return data


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
            f"expected a JSON object, got {_JSON_TYPE_NAMES.get(type(obj), 'a value')}"
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
    start = time.perf_counter()
    ttft = None
    completions = Completions()
    try:
        async for response in stub.Generate(request, timeout=timeout, metadata=metadata or None):
            if ttft is None and response.token_ids:
                ttft = time.perf_counter() - start
            completions.add(response)
    except grpc.RpcError as err:
        message = _error_text(err, server)
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
) -> int:
    """Run `requests` with at most `concurrency` in flight; print results as they finish.

    `credentials` (TLS, None for plaintext) and `metadata` (e.g. the API key) apply to every
    call.
    """
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


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """Call details with extra metadata (grpc's documented interceptor pattern)."""


class _MetadataInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata (the API key) to every call of a synchronous channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _details(self, details: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(
            details.method,
            details.timeout,
            [*(details.metadata or ()), *self.metadata],
            details.credentials,
            details.wait_for_ready,
            details.compression,
        )

    def intercept_unary_unary(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(
        self, continuation: Callable[..., Any], client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        return continuation(self._details(client_call_details), request)


def connection_from_args(
    args: argparse.Namespace,
) -> tuple[grpc.ChannelCredentials | None, tuple[tuple[str, str], ...]]:
    """(TLS credentials or None for plaintext, metadata for every call) from the flags.

    Raises:
        ValueError: a key that cannot be sent, half a client certificate, an unreadable file.
    """
    key = args.api_key
    source = "--api-key"
    if key is None:
        key, source = api_key_from_env(), f"${API_KEY_ENV}"
    metadata = auth_metadata(check_api_key(key.strip(), source) if key is not None else None)
    use_tls = args.tls or any(x is not None for x in (args.tls_ca, args.tls_cert, args.tls_key))
    credentials = (
        channel_credentials(args.tls_ca, args.tls_cert, args.tls_key) if use_tls else None
    )
    return credentials, metadata


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except KeyboardInterrupt:  # Ctrl-C: calls in flight are cancelled as the channel closes
        return 130


def _run(args: argparse.Namespace) -> int:
    try:
        credentials, metadata = connection_from_args(args)
    except ValueError as exc:
        print(f"moe-client: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "batch":
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
            )
        )
    if args.command == "generate":
        try:
            request = request_from_args(args)
        except ValueError as exc:
            print(f"moe-client generate: error: {exc}", file=sys.stderr)
            return 2
    if credentials is None:
        raw_channel = grpc.insecure_channel(args.server)
    else:
        raw_channel = grpc.secure_channel(args.server, credentials)
    with raw_channel:
        channel = grpc.intercept_channel(raw_channel, _MetadataInterceptor(metadata))
        stub = pb_grpc.MoeEngineStub(channel)
        if args.command == "generate":
            return cmd_generate(args, stub, request)
        if args.command == "health":
            return cmd_health(args, channel, lambda err: _error_text(err, args.server))
        return cmd_show(args, stub)


if __name__ == "__main__":
    sys.exit(main())
