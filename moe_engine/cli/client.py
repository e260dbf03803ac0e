"""`moe-client`: talk to a `moe-serve` server.

    moe-client [--server HOST:PORT] generate (TEXT | --prompt-ids 1,2,3) [--max-tokens N]
               [--min-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
               [--stop S [--stop S ...]] [--ignore-eos] [--include-stop-str-in-output]
               [--[no-]skip-special-tokens] [--logprobs N] [--return-routed-experts] [--json]
    moe-client [--server HOST:PORT] batch FILE.jsonl [--concurrency N]
    moe-client [--server HOST:PORT] stats [--json]
    moe-client [--server HOST:PORT] info [--json]
    moe-client [--server HOST:PORT] health [--wait S] [--service NAME] [--json]
    moe-client [--server HOST:PORT] pause [--mode abort|keep|retract] [--json]
    moe-client [--server HOST:PORT] resume [--json]
    moe-client [--server HOST:PORT] update-weights --from-disk PATH --weight-version V
               [--keep-prefix-cache] [--json]
    moe-client --version

Common flags: --server HOST:PORT (moe-serve's gRPC port, its --grpc-port, not its --port, which
is the OpenAI HTTP API's; the port is required, gRPC would otherwise pick 443; default
127.0.0.1:50051; IPv6 as [::1]:50051), --timeout S (deadline per call, seconds > 0), --api-key
KEY (or $MOE_ENGINE_API_KEY; sent as the metadata "authorization: Bearer KEY"), --tls (TLS with
the system's CAs), --tls-ca PEM (the CA that signed the server's certificate; implies --tls),
--tls-cert PEM --tls-key PEM (a client certificate, for servers started with --tls-ca).

`generate` streams text (token ids when the model has no tokenizer); `--stop` takes exactly one
stop string and is repeated for several (`--stop a --stop b`), so a prompt after it is never
taken for a stop string (`--stop=VALUE` for a value that starts with "-"); with --json it
prints one JSON object (request_id, token_ids, text, finish_reason, usage; with
--return-routed-experts also routed_experts, base64 of int32, and routed_experts_shape; without
--json their shape and first tokens' expert ids follow the text). `batch` reads one
request object per line ("prompt" or "prompt_ids", sampling fields by their proto names), runs
them concurrently and prints one JSON line per finished request (index, token_ids, finish_reason,
usage, ttft_s, e2e_s), then a summary line (wall_s, output_tokens, output_tokens_per_s); a
batch line's "stop" may be one string. `pause`, `resume` and `update-weights` (RL rollouts:
`cli/weights.py`) print the server's answer on one line (weight_version, paused, the requests
the pause aborted / kept / retracted, the tensors, bytes and seconds of an update); `info`
shows the weight_version serving now. On an error status the code and message go to stderr and
the exit status is 1 (when nothing answers at the address, the message says the server may not
be running there); `health` prints SERVING, NOT_SERVING or UNKNOWN (with the server's detail,
e.g. what it is loading) and exits 0 only when SERVING; a bad flag or batch line is one line
per problem on stderr and exit status 2 (nothing is sent); Ctrl-C cancels what is in flight and
exits 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

import grpc
from google.protobuf import descriptor

from moe_engine import __version__
from moe_engine.cli.argtypes import positive_seconds, server_address
from moe_engine.cli.batch import add_batch_parser, cmd_batch
from moe_engine.cli.completions import Completions
from moe_engine.cli.connection import connection_from_args, open_channel
from moe_engine.cli.health import add_health_parser, cmd_health
from moe_engine.cli.request_fields import (
    add_processor_flags,
    build_request,
    int_type,
    parse_ids,
    processor_fields,
    utf8_text,
)
from moe_engine.cli.rpc_errors import error_text, fail
from moe_engine.cli.weights import COMMANDS as WEIGHT_COMMANDS
from moe_engine.cli.weights import add_weight_parsers, cmd_weights
from moe_engine.cli.weights import check_args as check_weight_args
from moe_engine.errors import ParamError
from moe_engine.sampling_params import SamplingParams
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.security import API_KEY_ENV

_FD = descriptor.FieldDescriptor


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): `prog: error: argument --flag: why`."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """moe-client's parser: the common flags (--server, --timeout, --api-key, TLS) and the
    generate, batch, stats, info, health, pause, resume and update-weights subcommands."""
    p = _Parser(prog="moe-client", description="Client for moe-serve.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    _add_connection_flags(p, None)
    sub = p.add_subparsers(dest="command", required=True)

    add_generate_parser(sub)
    add_batch_parser(sub)

    for name, help_text in (("stats", "server statistics"), ("info", "model information")):
        s = sub.add_parser(name, help=help_text)
        s.add_argument("--json", action="store_true", help="print one JSON object")
    add_health_parser(sub)
    add_weight_parsers(sub)
    # The same flags after the subcommand too (`moe-client health --server H:P`): given there,
    # they override the ones before it; absent, they leave them alone (SUPPRESS).
    for subparser in sub.choices.values():
        _add_connection_flags(subparser, argparse.SUPPRESS)
    return p


def _add_connection_flags(p: argparse.ArgumentParser, suppress: str | None) -> None:
    """--server, --timeout, --api-key and the TLS flags on `p`; with `suppress`
    (argparse.SUPPRESS) an absent flag sets nothing (a subcommand's copy of the flags)."""

    def default(value: object) -> object:
        return suppress if suppress is not None else value

    p.add_argument(
        "--server",
        type=server_address,
        default=default("127.0.0.1:50051"),
        metavar="HOST:PORT",
        help="server address: moe-serve's gRPC port (its --grpc-port); the port is required "
        "([::1]:PORT for IPv6) (default: 127.0.0.1:50051)",
    )
    p.add_argument(
        "--timeout",
        type=positive_seconds,
        default=default(None),
        metavar="SECONDS",
        help="deadline per call, seconds > 0 (default: none)",
    )
    p.add_argument(
        "--api-key",
        default=default(None),
        help=f"API key sent with every call (default: ${API_KEY_ENV}, else none)",
    )
    p.add_argument("--tls", action="store_true", default=default(False),
                   help="connect with TLS, the system's CAs (default: off)")
    p.add_argument("--tls-ca", default=default(None),
                   help="PEM CA of the server's certificate, implies TLS (default: none)")
    p.add_argument("--tls-cert", default=default(None),
                   help="PEM client certificate, mutual TLS (default: none)")
    p.add_argument("--tls-key", default=default(None), help="PEM key of --tls-cert (default: none)")


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """The `generate` subcommand; each sampling flag's help gives the default the server
    applies when the flag is not given (`SamplingParams`' defaults, vLLM's)."""
    g = sub.add_parser("generate", help="generate for one prompt, streaming")
    defaults = SamplingParams()
    _add_prompt_flags(g)
    _add_sampling_flags(g, defaults)
    add_processor_flags(g)
    _add_stop_flags(g)
    _add_output_flags(g, defaults)


def _add_prompt_flags(g: argparse.ArgumentParser) -> None:
    """TEXT or --prompt-ids."""
    g.add_argument("text", nargs="?", type=utf8_text, default=None, help="the prompt text")
    g.add_argument(
        "--prompt-ids",
        type=parse_ids,
        default=None,
        metavar="IDS",
        help="the prompt as token ids, 1,2,3, instead of TEXT (default: none)",
    )


def _add_sampling_flags(g: argparse.ArgumentParser, d: SamplingParams) -> None:
    """Length, temperature, nucleus / top-k and seed; `d` gives the defaults in the help."""
    g.add_argument(
        "--max-tokens",
        type=int_type("max_tokens"),
        metavar="N",
        help=f"most tokens to generate (default: {d.max_tokens})",
    )
    g.add_argument(
        "--min-tokens",
        type=int_type("min_tokens"),
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
        type=int_type("top_k"),
        metavar="K",
        help=f"sample among the K most likely tokens, -1 for all (default: {d.top_k})",
    )
    g.add_argument(
        "--seed",
        type=int_type("seed"),
        metavar="S",
        help="per-request seed: the same seed and prompt give the same tokens (default: none)",
    )


def _add_stop_flags(g: argparse.ArgumentParser) -> None:
    """What ends a completion besides --max-tokens: stop strings, stop ids, EOS."""
    g.add_argument(
        "--stop",
        action="append",
        type=utf8_text,
        default=None,
        metavar="S",
        help="a stop string; repeat the flag for several (--stop a --stop b); a newline in "
        "bash: --stop $'\\n'; a value starting with '-': --stop=-x (default: none)",
    )
    g.add_argument(
        "--stop-token-ids",
        type=parse_ids,
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
        "--include-stop-str-in-output",
        action="store_true",
        default=None,
        help="keep the matched stop string at the end of the text (default: cut)",
    )
    g.add_argument(
        "--skip-special-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="leave special tokens' text out of the output; --no-skip-special-tokens keeps "
        "it (default: skip)",
    )


def _add_output_flags(g: argparse.ArgumentParser, d: SamplingParams) -> None:
    """What comes back and how it is printed: logprobs, --n completions, request id, JSON."""
    g.add_argument(
        "--logprobs",
        type=int_type("logprobs"),
        metavar="N",
        help="return the N most likely tokens' logprobs per token (default: none)",
    )
    g.add_argument(
        "--n",
        type=int_type("n"),
        metavar="N",
        help=f"parallel sampling: N completions of the prompt, sharing its KV blocks; with a "
        f"seed, completion i uses seed + i (default: {d.n})",
    )
    g.add_argument(
        "--return-routed-experts",
        action="store_true",
        default=None,
        help="routing replay: also return the top-k expert ids of every MoE layer for every "
        "token the model ran; prints their shape and first rows (needs a server started with "
        "--enable-return-routed-experts) (default: off)",
    )
    g.add_argument(
        "--request-id",
        type=utf8_text,
        default="",
        metavar="ID",
        help="the request's id (default: one the server makes)",
    )
    g.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object at the end (default: stream the text)",
    )


def request_from_args(args: argparse.Namespace) -> pb.GenerateRequest:
    """The GenerateRequest `generate`'s flags describe.

    Raises:
        ValueError: neither or both of TEXT and --prompt-ids, or a bad value.
    """
    if (args.text is None) == (args.prompt_ids is None):
        raise ValueError("give either TEXT or --prompt-ids")
    sampling = {
        "max_tokens": args.max_tokens,
        "min_tokens": args.min_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "stop": args.stop or None,
        "stop_token_ids": args.stop_token_ids,
        "ignore_eos": args.ignore_eos,
        "include_stop_str_in_output": args.include_stop_str_in_output,
        "skip_special_tokens": args.skip_special_tokens,
        "logprobs": args.logprobs,
        "n": args.n,
        "return_routed_experts": args.return_routed_experts,
        **processor_fields(args),
    }
    try:  # the limits that need no model, checked here as the server would
        SamplingParams(**{k: v for k, v in sampling.items() if v is not None})
    except ParamError as exc:
        raise ValueError(f"--{exc.field.replace('_', '-')}: {exc.message}") from None
    return build_request(
        prompt=args.text, prompt_ids=args.prompt_ids, request_id=args.request_id, **sampling
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
        return fail(err, args.server)
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
    if not args.json:
        for line in completions.routed_lines():
            print(line)
    return 0


def cmd_show(args: argparse.Namespace, stub: pb_grpc.MoeEngineStub) -> int:
    """`stats` / `info`: print GetServerStats / GetModelInfo as aligned `field  value` lines
    (or one JSON object with --json); returns the exit status."""
    try:
        if args.command == "stats":
            message = stub.GetServerStats(pb.GetServerStatsRequest(), timeout=args.timeout)
        else:
            message = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=args.timeout)
    except grpc.RpcError as err:
        return fail(err, args.server)
    data = message_dict(message)
    if args.json:
        print(json.dumps(data))
    else:
        width = max(map(len, data))
        for key, value in data.items():
            if isinstance(value, dict):  # a proto map (kernel_backends): sorted k=v pairs
                value = ", ".join(f"{k}={v}" for k, v in sorted(value.items()))
            print(f"{key:<{width}}  {value}")
    return 0


def message_dict(message: Any) -> dict[str, Any]:
    """A message's fields as plain JSON values (64-bit integers stay numbers), by proto name.

    Fields without presence are always included; optional ones only when set.
    """
    data: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        entry = field.message_type
        if entry is not None and entry.GetOptions().map_entry:  # map<string, string>
            data[field.name] = dict(getattr(message, field.name))
        elif field.is_repeated:
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


def main(argv: list[str] | None = None) -> int:
    """Run `moe-client` with `argv` (default sys.argv[1:]); returns the exit status."""
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
        return cmd_batch(args, credentials, metadata)
    if args.command == "generate":
        try:
            request = request_from_args(args)
        except ValueError as exc:
            print(f"moe-client generate: error: {exc}", file=sys.stderr)
            return 2
    if args.command in WEIGHT_COMMANDS:
        problem = check_weight_args(args)
        if problem is not None:
            print(f"moe-client {args.command}: error: {problem}", file=sys.stderr)
            return 2
    with open_channel(args.server, credentials, metadata) as channel:
        stub = pb_grpc.MoeEngineStub(channel)
        if args.command == "generate":
            return cmd_generate(args, stub, request)
        if args.command == "health":
            return cmd_health(args, channel, lambda err: error_text(err, args.server))
        if args.command in WEIGHT_COMMANDS:
            return cmd_weights(args, stub)
        return cmd_show(args, stub)


if __name__ == "__main__":
    sys.exit(main())
