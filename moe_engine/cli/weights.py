"""`moe-client pause | resume | update-weights`: the RL rollout RPCs from a shell.

    moe-client pause [--mode abort|keep|retract] [--json]
    moe-client resume [--json]
    moe-client update-weights --from-disk PATH --weight-version V [--keep-prefix-cache] [--json]

Each prints the server's WeightControlResponse on one line (`field=value` pairs after what was
done), or one JSON object with --json; a refusal (e.g. a tensor of the wrong shape: the server
keeps serving its previous weights) is the status code and message on stderr, exit status 1.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import grpc

from moe_engine.cli.request_fields import utf8_text
from moe_engine.cli.rpc_errors import fail
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.weight_update.messages import DEFAULT_PAUSE_MODE, PAUSE_MODES

#: The subcommands of this module.
COMMANDS = ("pause", "resume", "update-weights")
#: The response fields each subcommand prints, in order.
_SHOWN = {
    "pause": ("weight_version", "paused", "num_aborted", "num_kept", "num_retracted"),
    "resume": ("weight_version", "paused"),
    "update-weights": ("weight_version", "paused", "num_tensors", "num_bytes", "seconds"),
}


def add_weight_parsers(sub: argparse._SubParsersAction) -> None:
    """The pause, resume and update-weights subcommands."""
    p = sub.add_parser("pause", help="pause generation (RL weight updates)")
    p.add_argument(
        "--mode",
        choices=PAUSE_MODES,
        default=DEFAULT_PAUSE_MODE,
        help="what happens to requests in flight: abort them (finish_reason abort), keep them "
        "(their KV cache stays; they continue after resume), or retract them (recomputed "
        "after resume, on the weights serving then) (default: keep)",
    )
    sub.add_parser("resume", help="resume generation after pause")
    u = sub.add_parser("update-weights", help="serve new weights from a checkpoint folder")
    u.add_argument(
        "--from-disk",
        required=True,
        type=utf8_text,
        metavar="PATH",
        help="checkpoint folder on the server's machine, same architecture (all tensors or "
        "some)",
    )
    u.add_argument(
        "--weight-version",
        required=True,
        type=utf8_text,
        metavar="V",
        help="the version every later response carries (required, non-empty)",
    )
    u.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="keep the prefix cache, whose blocks hold the old weights' K/V (default: flushed)",
    )
    for name in COMMANDS:
        sub.choices[name].add_argument("--json", action="store_true",
                                       help="print one JSON object (default: one line)")


def check_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the flags of `args.command`, or None."""
    if args.command == "update-weights" and not args.weight_version:
        return "--weight-version: must not be empty"
    if args.command == "update-weights" and not args.from_disk:
        return "--from-disk: must not be empty"
    return None


def cmd_weights(args: argparse.Namespace, stub: pb_grpc.MoeEngineStub) -> int:
    """Run one pause / resume / update-weights call and print its answer; the exit status."""
    call: Callable[..., pb.WeightControlResponse]
    if args.command == "pause":
        call, request = stub.PauseGeneration, pb.PauseGenerationRequest(mode=args.mode)
        done = f"paused (mode {args.mode})"
    elif args.command == "resume":
        call, request, done = stub.ResumeGeneration, pb.ResumeGenerationRequest(), "resumed"
    else:
        call = stub.UpdateWeights
        request = pb.UpdateWeightsRequest(
            weight_version=args.weight_version,
            from_disk=pb.UpdateWeightsFromDisk(path=args.from_disk),
            flush_cache=not args.keep_prefix_cache,
        )
        done = "weights updated" + (" (prefix cache kept)" if args.keep_prefix_cache else "")
    try:
        response = call(request, timeout=args.timeout)
    except grpc.RpcError as err:
        return fail(err, args.server)
    fields = {name: getattr(response, name) for name in _SHOWN[args.command]}
    if args.json:
        print(json.dumps(fields))
    else:
        print(f"{done}: " + " ".join(f"{k}={_show(v)}" for k, v in fields.items()))
    return 0


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value) if value != "" else "''"
