"""`moe-skew`: the routing-skew profiler (DESIGN.md section 7).

    moe-skew report (TRACE | --server HOST:PORT) [--ep-size N] [--placement FILE] [--top K]
                    [--moe-time-share F] [--n-group G] [--json]
    moe-skew plot (TRACE | --server HOST:PORT) -o FILE.png [--ep-size N] [--placement FILE]
    moe-skew plan TRACE --ep-size N --num-redundant-experts R [-o placement.json]
                  [--per-layer] [--json]

TRACE is a trace file written by `moe-serve --expert-trace PATH` (docs/trace_format.md).
`--server HOST:PORT` (port required) reads a live server's totals since startup through gRPC
`GetExpertLoad`, and its ep_size and the placement it serves (`experts_per_rank`) through
`GetModelInfo`; without --placement (and with --ep-size absent or the server's) the rank view
is that served placement, and the server's measured per-rank load (`tokens_per_rank`) fills
the rank columns when sent, so they equal the server's rank_imbalance_ratio; another --ep-size
or a --placement is a what-if, predicted from the counts. A server gives no step times: the
time lost is n/a.
`report` prints one row per MoE layer (imbalance by expert and by rank, hottest experts with
their share of the layer's token-expert pairs, the straggler rank, the estimated step time lost
waiting for it; definitions in `moe_engine/skew/report.py`) and a summary; for a model with
expert groups (group-limited routing: the trace's meta n_group, or `--n-group G`, which a live
server needs) a second table gives per layer the pairs per group, the hottest group and the
group max/mean (`moe_engine/skew/groups.py`). `plan` replicates hot
experts and packs them onto ranks (EPLB-style greedy, `moe_engine/skew/planner.py`), prints the
predicted rank imbalance (max / mean) per layer before (the trace's placement, else
contiguous) and after, and writes the placement JSON; the plan is never predicted worse than
"before" on either printed view (when nothing beats it, it says so and keeps the baseline,
with replicas only where they help). Columns: "max/mean" over the pairs summed over the whole
trace (what the plan minimises, mean over layers); "step max/mean" the mean over trace rows
(engine steps) of each row's max / mean, the per-step straggler view. `--per-layer` adds a
per-layer plan (written under "layers", which moe-serve ignores) as an extra column. Exit
status: 0 ok; 1 a bad trace, placement or server error (one line on stderr); 2 a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

import numpy as np

from moe_engine.cli.argtypes import int_at_least, positive_seconds, server_address
from moe_engine.skew.groups import group_table
from moe_engine.skew.imbalance import replay
from moe_engine.skew.placement import Placement, PlacementError
from moe_engine.skew.planner import PlanChoice, plan_placement_result
from moe_engine.skew.report import LoadData, build_report, format_table, report_table, summary_lines
from moe_engine.skew.trace import TraceFormatError, read_trace


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _plan_legend(base: str | None = None) -> str:
    """What `plan`'s columns mean (printed above the table and in `plan --help`)."""
    before = f"the {base}" if base else (
        "the trace's placement (when recorded for this ep_size),\n    else contiguous"
    )
    return (
        "rank load = the token-expert pairs a rank's experts process (an expert's replicas "
        "share its\n  pairs evenly); max/mean = the busiest rank's load / the mean over ranks "
        "(1.0 = balanced).\n"
        f"  before = {before}; after = the plan.\n"
        "  max/mean columns: loads summed over the whole trace; the plan minimises their mean "
        "over layers.\n"
        "  step max/mean columns: each trace row's (engine step's) max/mean, averaged over "
        "rows:\n    what each step waits for.\n"
        "  The plan is never predicted worse than before on either column's mean (a single "
        "layer may\n    move either way); when no plan improves on before, before is kept "
        "(with replicas only\n    where they help)."
    )


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1], got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="moe-skew", description="Routing-skew profiler for moe-engine traces.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def source(q: argparse.ArgumentParser) -> None:
        q.add_argument("trace", nargs="?", help="trace file (moe-serve --expert-trace)")
        q.add_argument(
            "--server", metavar="HOST:PORT", type=server_address,
            help="read a live server instead (the port is required)",
        )
        q.add_argument(
            "--timeout", type=positive_seconds, default=10.0,
            help="gRPC deadline, seconds > 0 (default %(default)s)",
        )
        q.add_argument(
            "--ep-size", type=int_at_least(1),
            help="ranks of the rank view (default: the trace's or the server's)",
        )
        q.add_argument(
            "--placement", metavar="FILE", help="placement JSON for the rank view (default: the "
            "trace's or the one the server serves, else contiguous)"
        )

    rep = sub.add_parser("report", help="per-layer skew tables")
    source(rep)
    rep.add_argument("--top", type=int_at_least(1), default=3, help="hottest experts per layer")
    rep.add_argument(
        "--moe-time-share", type=_fraction, help="share of a step spent in MoE blocks, for the "
        "time-lost estimate (default: the trace's measured value, else 0.5)"
    )
    rep.add_argument(
        "--n-group", type=int_at_least(1), metavar="G", help="expert groups of the model "
        "(contiguous ids, as DeepSeek-V3's n_group) for the per-group table (default: the "
        "trace's meta n_group; a live server's report needs it given)"
    )
    rep.add_argument("--json", action="store_true", help="one JSON object")

    plot = sub.add_parser("plot", help="heat map and per-rank load bars (PNG)")
    source(plot)
    plot.add_argument("-o", "--output", required=True, metavar="FILE.png")

    plan = sub.add_parser(
        "plan",
        help="recommend a placement (replicate and pack hot experts)",
        description="Recommend a placement: replicate hot experts and pack them onto ranks,\n"
        "then print the predicted rank imbalance per MoE layer before and after.\n\n"
        + _plan_legend(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument("trace", help="trace file")
    plan.add_argument("--ep-size", type=int_at_least(1), required=True)
    plan.add_argument(
        "--num-redundant-experts", type=int_at_least(0), required=True, metavar="R",
        help="extra expert replicas at most (R + experts must be a multiple of --ep-size); "
        "fewer are used when more do not lower the imbalance",
    )
    plan.add_argument("-o", "--output", metavar="placement.json", help="write the placement")
    plan.add_argument(
        "--per-layer", action="store_true",
        help="also plan every layer on its own load (written under \"layers\")",
    )
    plan.add_argument("--json", action="store_true", help="one JSON object")
    return p


def load_from_server(server: str, timeout: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model info, expert load) of a live server as plain dicts.

    The info dict has the ModelInfo fields by proto name, `experts_per_rank` as N lists of
    expert ids; the load dict has `ep_size` and `layers`, each with `layer`, `counts` ([E]
    token-expert pairs per expert), `tokens_per_rank` ([N] measured pairs per rank, [] when the
    server sends none) and `rank_imbalance_ratio`.

    Raises:
        grpc.RpcError: the server is unreachable or answers with an error status.
    """
    import grpc
    from google.protobuf.json_format import MessageToDict

    from moe_engine.server.pb import moe_engine_pb2 as pb
    from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

    with grpc.insecure_channel(server) as channel:
        stub = pb_grpc.MoeEngineStub(channel)
        info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout)
        load = stub.GetExpertLoad(pb.GetExpertLoadRequest(), timeout=timeout)
    layers = [
        dict(
            layer=int(x.layer),
            counts=[int(c) for c in x.tokens_per_expert],
            tokens_per_rank=[int(c) for c in x.tokens_per_rank],
            rank_imbalance_ratio=float(x.rank_imbalance_ratio),
        )
        for x in load.layers
    ]
    info_dict = MessageToDict(info, preserving_proto_field_name=True)
    info_dict["experts_per_rank"] = [[int(e) for e in r.experts] for r in info.experts_per_rank]
    return info_dict, dict(ep_size=int(load.ep_size), layers=layers)


def served_placement(info: dict[str, Any], num_experts: int, server: str) -> Placement | None:
    """The placement a server serves (GetModelInfo experts_per_rank), None when it sends none.

    Raises:
        PlacementError: a table that is not a valid placement of `num_experts` experts on
            the server's ep_size ranks.
    """
    table = info.get("experts_per_rank") or []
    if not any(table):
        return None
    ep_size = int(info.get("ep_size") or 1)
    obj = dict(version=1, num_experts=num_experts, ep_size=ep_size, slots=table)
    return Placement.from_json(obj, source=f"server {server}: experts_per_rank")


def _load_data(args: argparse.Namespace) -> LoadData:
    if (args.trace is None) == (args.server is None):
        raise _UsageError("give exactly one of TRACE or --server HOST:PORT")
    placement = Placement.load(args.placement) if args.placement else None
    n_group = getattr(args, "n_group", None)  # report only
    if args.trace is not None:
        data = LoadData.from_trace(read_trace(args.trace), args.ep_size, placement, n_group)
    else:
        info, load = load_from_server(args.server, args.timeout)
        if not load["layers"]:
            raise TraceFormatError(f"server {args.server} reports no MoE layers")
        counts = np.array([x["counts"] for x in load["layers"]], dtype=np.int64)
        server_ep = int(info.get("ep_size") or load.get("ep_size") or 1)
        ep_size = args.ep_size or server_ep
        source = "file" if placement is not None else None
        measured = None
        if placement is None and ep_size == server_ep:  # the rank view the server runs
            placement = served_placement(info, counts.shape[1], args.server)
            source = "server" if placement is not None else None
            per_rank = [x["tokens_per_rank"] for x in load["layers"]]
            if all(len(r) == ep_size for r in per_rank):
                measured = np.array(per_rank, dtype=np.int64)
        data = LoadData(
            moe_layers=[x["layer"] for x in load["layers"]],
            counts=counts[None],
            ep_size=ep_size,
            placement=placement,
            rank_load=measured,
            placement_source=source,
            meta=dict(model=info.get("model"), eplb_enabled=bool(info.get("eplb_enabled")),
                      eplb_rebalances=int(info.get("eplb_rebalances") or 0)),
            n_group=n_group,
        )
    if data.placement is not None and data.placement.ep_size != data.ep_size:
        if args.ep_size is None:
            data.ep_size = data.placement.ep_size
        else:
            raise PlacementError(
                f"--placement has {data.placement.ep_size} ranks but --ep-size is {data.ep_size}"
            )
    return data


class _UsageError(Exception):
    pass


def _print_table(header: list[str], rows: list[list[str]], title: str | None = None) -> None:
    """A rich table on a terminal when rich is installed, else an aligned plain table."""
    if sys.stdout.isatty():
        try:
            from rich.console import Console
            from rich.table import Table
        except ImportError:
            pass
        else:
            table = Table(title=title)
            for h in header:
                left = "hottest" in h or h == "straggler"
                table.add_column(h, justify="left" if left else "right")
            for r in rows:
                table.add_row(*r)
            Console().print(table)
            return
    if title:
        print(title)
    print(format_table(header, rows))


def cmd_report(args: argparse.Namespace) -> int:
    data = _load_data(args)
    report = build_report(data, top=args.top, moe_time_share=args.moe_time_share)
    if args.json:
        print(json.dumps(report.to_json()))
        return 0
    header, rows = report_table(report)
    _print_table(header, rows, "routing skew per MoE layer")
    groups = [r.groups for r in report.layers if r.groups is not None]
    if groups and groups[0].n_group > 1:
        print()
        g_header, g_rows = group_table([r.layer for r in report.layers], groups)
        _print_table(g_header, g_rows, "token-expert pairs per expert group per MoE layer")
    print()
    print("\n".join(summary_lines(report)))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from moe_engine.skew.plot import plot_load

    data = _load_data(args)
    title = f"expert load per layer: {args.trace or args.server}"
    plot_load(data, args.output, title=title)
    print(f"wrote {args.output}")
    return 0


def _plan_outcome(choice: PlanChoice, base: str) -> str:
    """One line: what the plan did, with the mean imbalances before and after."""
    numbers = f"mean max/mean {choice.imbalance_before:.4f} -> {choice.imbalance_after:.4f}"
    if choice.step_imbalance_before is not None:
        numbers += (
            f", mean step max/mean {choice.step_imbalance_before:.4f} -> "
            f"{choice.step_imbalance_after:.4f}"
        )
    requested = choice.num_redundant_requested
    if not choice.improved:
        return (
            f"no plan with up to {requested} redundant experts lowers the predicted imbalance "
            f"of the {base} without raising the per-step one; keeping the {base} unchanged "
            f"({numbers})"
        )
    if choice.kind == "replicate-and-pack":
        used = f"{choice.num_redundant} redundant experts"
        if choice.num_redundant < requested:
            used += f" (of {requested} allowed; more predicted no better)"
        return f"plan: replicate-and-pack with {used} ({numbers})"
    return (
        f"plan: replicate-and-pack did not beat the {base}; keeping it and adding "
        f"{choice.num_redundant} replicas where they help ({numbers})"
    )


def cmd_plan(args: argparse.Namespace) -> int:
    trace = read_trace(args.trace)
    layers = [int(x) for x in trace.moe_layers]
    before = None
    if trace.meta.get("placement"):
        recorded = Placement.from_json(trace.meta["placement"])
        if recorded.ep_size == args.ep_size:
            before = Placement(recorded.num_experts, recorded.slots)  # moe-serve serves "slots"
    planned = plan_placement_result(
        trace.total_counts(), args.ep_size, args.num_redundant_experts, layers, args.per_layer,
        baseline=before, rows=trace.counts,
    )
    placement = planned.placement
    shared = Placement(placement.num_experts, placement.slots)  # what moe-serve serves
    result = replay(trace.counts, layers, shared, before)
    per_layer = replay(trace.counts, layers, placement, before) if args.per_layer else None
    if args.output:
        placement.save(args.output)
    replicated = {
        e: n for e, n in enumerate(np.bincount(
            [e for s in placement.slots for e in s], minlength=placement.num_experts
        ).tolist()) if n > 1
    }
    base = "trace placement" if before is not None else "contiguous placement"
    outcome = _plan_outcome(planned.shared, base)

    def choice_json(choice: PlanChoice) -> dict[str, Any]:
        out = choice.to_json()
        del out["slots"]  # they are in "placement"
        return out

    if args.json:
        out = dict(
            placement=placement.to_json(),
            before="trace placement" if before is not None else "contiguous",
            plan=choice_json(planned.shared),
            plan_per_layer={str(k): choice_json(v) for k, v in planned.layers.items()} or None,
            outcome=outcome,
            replay=result.to_json(),
            replay_per_layer=None if per_layer is None else per_layer.to_json(),
            output=args.output,
        )
        print(json.dumps(out))
        return 0
    header = [
        "layer", "before max/mean", "after max/mean", "before step max/mean",
        "after step max/mean",
    ]
    columns = [
        result.imbalance_before,
        result.imbalance_after,
        result.step_imbalance_before,
        result.step_imbalance_after,
    ]
    if per_layer is not None:
        header.append("per-layer plan max/mean")
        columns.append(per_layer.imbalance_after)
    rows = [
        [str(layer), *(f"{c[i]:.4f}" for c in columns)]
        for i, layer in enumerate(result.moe_layers)
    ]
    rows.append(["mean", *(f"{c.mean():.4f}" for c in columns)])
    print(_plan_legend(base))
    print()
    _print_table(
        header, rows,
        f"predicted rank imbalance (max/mean), before = {base}, after = plan "
        f"(ep_size {args.ep_size}, up to {args.num_redundant_experts} redundant"
        f"{', per layer' if args.per_layer else ''})",
    )
    print(outcome)
    if per_layer is not None:
        print('per-layer plans are written under "layers"; moe-serve serves "slots" (after)')
    reps = ", ".join(f"e{e} x{n}" for e, n in replicated.items()) or "none"
    print(f"replicated experts (shared plan): {reps}")
    for r, s in enumerate(placement.slots):
        print(f"rank {r}: {s}")
    if args.output:
        print(f"wrote {args.output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    commands = dict(report=cmd_report, plot=cmd_plot, plan=cmd_plan)
    try:
        return commands[args.command](args)
    except _UsageError as exc:
        print(f"moe-skew {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (TraceFormatError, PlacementError, ValueError, OSError) as exc:
        print(f"moe-skew {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # grpc.RpcError without importing grpc up front
        code = getattr(exc, "code", None)
        if callable(code) and hasattr(exc, "details"):
            print(
                f"moe-skew {args.command}: error: {args.server}: {code().name}: {exc.details()}",
                file=sys.stderr,
            )
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
