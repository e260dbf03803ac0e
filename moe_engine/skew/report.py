"""Per-layer routing-skew report: imbalance by expert and by rank, hot experts, straggler cost.

Definitions (DESIGN.md section 7; the two conventions of the field):
- `imbalance_ratio` = max / mean (1.0 = balanced; DeepSeek EPLB's and SGLang's "imbalance"),
  `balancedness` = mean / max (1.0 = balanced; SGLang's expert-distribution recorder).
- By expert: over the E token-expert pair counts of a layer. By rank: over the N ranks' loads,
  a rank's load being the pairs of the experts it holds (an expert's replicas share its pairs
  evenly), under the trace's placement (meta "placement"), the placement a live server serves
  (GetModelInfo.experts_per_rank), a given one, or the contiguous default. A live server's
  measured per-rank load (GetExpertLoad tokens_per_rank), when it sends one for the placement
  it serves, replaces that prediction, so the rank columns equal the server's
  rank_imbalance_ratio / rank_balancedness. A placement whose ranks hold the contiguous
  layout's experts is labelled "contiguous", any other "explicit".
- Straggler rank of a layer: the rank with the largest load.
- Estimated step time lost waiting for it, per layer and step:
      lost_l = t_step * f_moe / L * (1 - balancedness_rank_l)
  where t_step is the mean engine step time (seconds, from the trace's step_time_s / num_steps),
  f_moe the share of a step spent in the MoE blocks (meta "moe_time_share" when the engine
  measured it, else the caller's assumption, `--moe-time-share`), spread evenly over the L MoE
  layers, and balancedness_rank_l the mean over trace rows of that row's rank mean / max (each
  step waits for its own straggler). In a layer whose MoE work takes time proportional to its
  busiest rank's load, a perfectly balanced placement would take mean / max of that time; the
  rest is waiting. It ignores communication overlap and per-expert fixed costs.
- By expert group (models with group-limited routing, `n_group` > 1 from the trace's meta or
  given): pairs per group, the hottest group, group max / mean (`moe_engine/skew/groups.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from moe_engine.skew.groups import GroupLoad, check_n_group
from moe_engine.skew.imbalance import max_over_mean, mean_over_max, rank_loads
from moe_engine.skew.placement import Placement, PlacementError, contiguous_slots
from moe_engine.skew.trace import ExpertTrace

DEFAULT_MOE_TIME_SHARE = 0.5


@dataclass
class LoadData:
    """What a report is made from: a trace, or one GetExpertLoad reply.

    Attributes:
        moe_layers: [L] decoder-layer indices.
        counts: [S, L, E] token-expert pairs per row (S = 1 for a server's totals).
        ep_size: N ranks the rank view assumes.
        placement: the placement the rank view uses (None: contiguous).
        step_time_s: [S] seconds per row, or None when unknown (a server's totals).
        num_steps: [S] engine steps per row, or None.
        rank_tokens: [L, N] measured expert load per rank (token-expert pairs its experts
            processed, whole trace), or None; shown as its own "recv" column.
        rank_load: [L, N] measured expert load per rank that *replaces* the placement's
            prediction in the rank columns (a live server's GetExpertLoad tokens_per_rank), or
            None. With one row (a server's totals) the per-step view uses it too.
        placement_source: where `placement` came from: "trace", "server", "file" (given), or
            None (contiguous default).
        meta: the trace's meta (model, moe_time_share, ...).
        n_group: expert groups of the model (meta "n_group"), or None: no group view.
    """

    moe_layers: list[int]
    counts: np.ndarray
    ep_size: int = 1
    placement: Placement | None = None
    step_time_s: np.ndarray | None = None
    num_steps: np.ndarray | None = None
    rank_tokens: np.ndarray | None = None
    rank_load: np.ndarray | None = None
    placement_source: str | None = None
    meta: dict[str, Any] | None = None
    n_group: int | None = None

    @classmethod
    def from_trace(
        cls,
        trace: ExpertTrace,
        ep_size: int | None = None,
        placement: Placement | None = None,
        n_group: int | None = None,
    ) -> LoadData:
        """Rank view on `ep_size` ranks (default: the trace's meta ep_size, else 1) under
        `placement` (default: the trace's meta placement when its ep_size matches, else
        contiguous); group view on `n_group` groups (default: the trace's meta n_group)."""
        meta = trace.meta
        n = ep_size or int(meta.get("ep_size") or 1)
        source = None if placement is None else "file"
        if placement is None and meta.get("placement"):
            recorded = Placement.from_json(meta["placement"])
            if recorded.ep_size == n:
                placement, source = recorded, "trace"
        rank_tokens = None
        if trace.rank_tokens is not None and trace.rank_tokens.shape[-1] == n:
            rank_tokens = trace.rank_tokens.sum(axis=0, dtype=np.int64)
        return cls(
            moe_layers=[int(x) for x in trace.moe_layers],
            counts=trace.counts,
            ep_size=n,
            placement=placement,
            step_time_s=trace.step_time_s,
            num_steps=trace.num_steps,
            rank_tokens=rank_tokens,
            placement_source=source,
            meta=meta,
            n_group=n_group or meta.get("n_group"),
        )

    def resolved_placement(self) -> Placement:
        """The placement of the rank view (contiguous when none was given)."""
        if self.placement is not None:
            return self.placement
        num_experts = self.counts.shape[-1]
        return Placement(num_experts, contiguous_slots(num_experts, self.ep_size))


def is_contiguous_layout(placement: Placement) -> bool:
    """Whether every slot table of `placement` puts on each rank exactly the contiguous
    layout's experts (slot order within a rank aside; no replicas)."""
    try:
        default = contiguous_slots(placement.num_experts, placement.ep_size)
    except PlacementError:
        return False
    tables = [placement.slots, *placement.layers.values()]
    return all([sorted(row) for row in table] == default for table in tables)


@dataclass
class LayerReport:
    """One MoE layer's numbers (see the module docstring for the definitions)."""

    layer: int
    tokens: int
    expert_imbalance: float
    expert_balancedness: float
    rank_imbalance: float
    rank_balancedness: float
    hottest: list[tuple[int, float]]
    straggler_rank: int
    straggler_share: float
    rank_load: list[float]
    step_rank_balancedness: float
    lost_s_per_step: float | None
    recv_imbalance: float | None = None
    groups: GroupLoad | None = None

    def to_json(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        out["hottest"] = [dict(expert=e, share=s) for e, s in self.hottest]
        out["groups"] = None if self.groups is None else self.groups.to_json()
        return out


@dataclass
class SkewReport:
    """A report: per-layer rows and a summary."""

    layers: list[LayerReport]
    summary: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dict(summary=self.summary, layers=[r.to_json() for r in self.layers])


def build_report(
    data: LoadData, top: int = 3, moe_time_share: float | None = None
) -> SkewReport:
    """Compute the per-layer report.

    Args:
        data: counts and context; top: how many hottest experts per layer to list;
        moe_time_share: f_moe in [0, 1] (default: meta "moe_time_share", else 0.5).

    Raises:
        ValueError: moe_time_share outside [0, 1]; a measured rank load that is not [L, N];
            an n_group that does not divide the experts.
        PlacementError: a placement that does not fit the counts.
    """
    counts = np.asarray(data.counts, dtype=np.float64)
    if counts.ndim == 2:
        counts = counts[None]
    total = counts.sum(axis=0)  # [L, E]
    num_layers, num_experts = total.shape
    meta = data.meta or {}
    share = moe_time_share if moe_time_share is not None else meta.get("moe_time_share")
    share_source = "given" if moe_time_share is not None else "trace"
    if share is None:
        share, share_source = DEFAULT_MOE_TIME_SHARE, "assumed"
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"moe_time_share must be in [0, 1], got {share}")
    if data.n_group is not None:
        check_n_group(num_experts, int(data.n_group))
    placement = data.resolved_placement()
    per_row = rank_loads(counts, placement, data.moe_layers)  # [S, L, N]
    ranks = per_row.sum(axis=0)  # [L, N]
    if data.rank_load is not None:  # measured: replaces the prediction
        measured = np.asarray(data.rank_load, dtype=np.float64)
        if measured.shape != ranks.shape:
            raise ValueError(
                f"the measured rank load has shape {measured.shape}, expected {ranks.shape} "
                "(MoE layers, ep_size)"
            )
        ranks = measured
        if per_row.shape[0] == 1:
            per_row = measured[None]
    row_bal = mean_over_max(per_row)  # [S, L]
    ran = per_row.sum(axis=-1) > 0
    n_ran = ran.sum(axis=0)
    step_bal = np.divide(
        (row_bal * ran).sum(axis=0), n_ran, out=np.ones(num_layers), where=n_ran > 0
    )
    step_time = None
    if data.step_time_s is not None and data.num_steps is not None and data.num_steps.sum() > 0:
        step_time = float(np.sum(data.step_time_s) / np.sum(data.num_steps))
    expert_imb, expert_bal = max_over_mean(total), mean_over_max(total)
    rank_imb, rank_bal = max_over_mean(ranks), mean_over_max(ranks)
    recv_imb = max_over_mean(data.rank_tokens) if data.rank_tokens is not None else None
    rows = []
    for i, layer in enumerate(data.moe_layers):
        tokens = float(total[i].sum())
        order = np.argsort(-total[i], kind="stable")[:top]
        hottest = [(int(e), float(total[i, e] / tokens) if tokens else 0.0) for e in order]
        straggler = int(np.argmax(ranks[i]))
        lost = None
        if step_time is not None:
            lost = step_time * share / num_layers * (1.0 - float(step_bal[i]))
        rows.append(
            LayerReport(
                layer=int(layer),
                tokens=int(tokens),
                expert_imbalance=float(expert_imb[i]),
                expert_balancedness=float(expert_bal[i]),
                rank_imbalance=float(rank_imb[i]),
                rank_balancedness=float(rank_bal[i]),
                hottest=hottest,
                straggler_rank=straggler,
                straggler_share=(
                    float(ranks[i, straggler] / ranks[i].sum()) if ranks[i].sum() else 0.0
                ),
                rank_load=ranks[i].tolist(),
                step_rank_balancedness=float(step_bal[i]),
                lost_s_per_step=lost,
                recv_imbalance=None if recv_imb is None else float(recv_imb[i]),
                groups=None if data.n_group is None else GroupLoad.of(total[i], data.n_group),
            )
        )
    overall = total.sum(axis=0)
    grand = float(overall.sum())
    order = np.argsort(-overall, kind="stable")[:top]
    lost_total = None if step_time is None else float(sum(r.lost_s_per_step for r in rows))
    summary = dict(
        model=meta.get("model"),
        num_moe_layers=num_layers,
        num_experts=num_experts,
        ep_size=data.ep_size,
        placement=(
            "explicit"
            if data.placement is not None and not is_contiguous_layout(data.placement)
            else "contiguous"
        ),
        placement_source=data.placement_source if data.placement is not None else None,
        rank_load_source="measured" if data.rank_load is not None else "predicted",
        num_rows=int(counts.shape[0]),
        num_steps=None if data.num_steps is None else int(np.sum(data.num_steps)),
        mean_step_time_s=step_time,
        moe_time_share=float(share),
        moe_time_share_source=share_source,
        hottest_overall=[
            dict(expert=int(e), share=float(overall[e] / grand) if grand else 0.0) for e in order
        ],
        mean_expert_imbalance=float(expert_imb.mean()),
        mean_rank_imbalance=float(rank_imb.mean()),
        n_group=data.n_group,
        eplb_rebalances=meta.get("eplb_rebalances") if meta.get("eplb_enabled") else None,
        live_slots=(
            [list(row) for row in data.placement.slots]
            if meta.get("eplb_enabled") and data.placement is not None else None
        ),
        mean_group_imbalance=(
            None if data.n_group is None
            else float(np.mean([r.groups.imbalance for r in rows if r.groups is not None]))
        ),
        lost_s_per_step=lost_total,
        lost_fraction_of_step=(
            None if lost_total is None or not step_time else lost_total / step_time
        ),
    )
    return SkewReport(rows, summary)


def report_table(report: SkewReport) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the per-layer table (strings, numbers formatted)."""
    header = [
        "layer",
        "pairs",
        "exp max/mean",
        "exp mean/max",
        "rank max/mean",
        "rank mean/max",
        "hottest experts (share)",
        "straggler",
        "lost ms/step",
    ]
    has_recv = any(r.recv_imbalance is not None for r in report.layers)
    if has_recv:
        header.append("recv max/mean")
    rows = []
    for r in report.layers:
        row = [
            str(r.layer),
            str(r.tokens),
            f"{r.expert_imbalance:.3f}",
            f"{r.expert_balancedness:.3f}",
            f"{r.rank_imbalance:.3f}",
            f"{r.rank_balancedness:.3f}",
            " ".join(f"e{e}:{100 * s:.1f}%" for e, s in r.hottest),
            f"r{r.straggler_rank} ({100 * r.straggler_share:.1f}%)",
            "n/a" if r.lost_s_per_step is None else f"{1e3 * r.lost_s_per_step:.3f}",
        ]
        if has_recv:
            row.append("n/a" if r.recv_imbalance is None else f"{r.recv_imbalance:.3f}")
        rows.append(row)
    return header, rows


def summary_lines(report: SkewReport) -> list[str]:
    """Human-readable summary lines under the table."""
    s = report.summary
    hot = ", ".join(f"e{h['expert']} {100 * h['share']:.1f}%" for h in s["hottest_overall"])
    where = {"trace": ", recorded in the trace", "server": ", served by the server",
             "file": ", from --placement"}.get(s.get("placement_source") or "", "")
    by_rank = (
        "measured by the server" if s.get("rank_load_source") == "measured"
        else "predicted from the placement"
    )
    lines = [
        f"model {s['model'] or '?'}: {s['num_moe_layers']} MoE layers x {s['num_experts']} "
        f"experts, ep_size {s['ep_size']} ({s['placement']} placement{where}), "
        f"{s['num_steps'] if s['num_steps'] is not None else '?'} steps",
        f"hottest experts over all layers: {hot}",
        f"mean imbalance (max/mean): by expert {s['mean_expert_imbalance']:.3f}, "
        f"by rank {s['mean_rank_imbalance']:.3f} ({by_rank})",
    ]
    if s.get("eplb_rebalances") is not None:
        lines.append(
            f"the server rebalances its experts while serving (--enable-eplb): the rank view "
            f"uses the placement it serves now, moved {s['eplb_rebalances']} times since "
            "startup (the counts since startup span every placement it served)")
        if s.get("live_slots"):
            lines.append("live placement: " + "; ".join(
                f"r{r} {row}" for r, row in enumerate(s["live_slots"])))
    if s.get("n_group"):
        lines.append(
            f"mean imbalance by expert group ({s['n_group']} groups of "
            f"{s['num_experts'] // s['n_group']} experts, max/mean): "
            f"{s['mean_group_imbalance']:.3f}"
        )
    if s["lost_s_per_step"] is None:
        lines.append("step time lost to stragglers: n/a (no step times in this source)")
    else:
        lines.append(
            f"step time lost to stragglers: {1e3 * s['lost_s_per_step']:.3f} ms of "
            f"{1e3 * s['mean_step_time_s']:.3f} ms per step "
            f"({100 * s['lost_fraction_of_step']:.1f}%), MoE share of step "
            f"{s['moe_time_share']:.2f} ({s['moe_time_share_source']})"
        )
    return lines


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """A plain, aligned text table (text left-aligned, numbers right-aligned)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def is_number(text: str) -> bool:
        try:
            float(text)
        except ValueError:
            return False
        return True

    def line(cells: list[str]) -> str:
        return "  ".join(
            c.rjust(w) if is_number(c) or c == "n/a" else c.ljust(w)
            for c, w in zip(cells, widths, strict=True)
        ).rstrip()

    out = [line(header), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in rows)
    return "\n".join(out)
