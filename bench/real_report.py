"""bench/real_scale.py's derived figures and its printed table.

`add_figures` adds to each row: `read_gbps` (bytes per batch-1 token x batch-1 tok/s, GB =
1e9 bytes), `read_vs_stream` (that over the streaming read's median over the sitting's
measurements) and, per mode, `vs_llamacpp` (the row's tok/s over the best llama.cpp row's).
`render` prints the header, the table and the details (agreement, logprob gaps, bytes).
"""

from __future__ import annotations

import json
import statistics

MODES = ("batch1", "batched")


def _rate(row: dict, mode: str) -> float | None:
    return row.get(mode, {}).get("output_tokens_per_s")


def add_figures(result: dict) -> None:
    """Fill in the derived figures of `result` (real_scale's) in place."""
    rows, per_token = result["rows"], result["bytes_per_token"]
    stream = statistics.median(s["median_gbps"] for s in result["stream_read"])
    result["stream_read_median_gbps"] = stream
    for mode in MODES:
        peers = [r for n, r in rows.items() if n.startswith("llama.cpp") and _rate(r, mode)]
        best = max((_rate(r, mode) for r in peers), default=None)
        for row in rows.values():
            if best and _rate(row, mode):
                row[mode]["vs_llamacpp"] = round(_rate(row, mode) / best, 2)
    for name, row in rows.items():
        rate = _rate(row, "batch1")
        if rate and name in per_token:
            row["read_gbps"] = round(per_token[name]["total"] * rate / 1e9, 2)
            row["read_vs_stream"] = round(row["read_gbps"] / stream, 2) if stream else None


def _cell(value, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def table(result: dict) -> str:
    """The rows as a markdown table."""
    head = ["row", "load s", "peak RSS GiB (max / sum)", "batch 1 tok/s", "vs llama.cpp",
            "batched tok/s", "vs llama.cpp", "GB / token", "read GB/s", "of stream"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, row in result["rows"].items():
        if "error" in row:
            lines.append(f"| {name} | failed: {row['error'][:120]} |" + " |" * (len(head) - 2))
            continue
        rss = row.get("peak_rss", {})
        per_token = result["bytes_per_token"].get(name, {}).get("total")
        cells = [name, _cell(row.get("load_s"), "{:.1f}"),
                 f"{_cell(rss.get('max_gib'))} / {_cell(rss.get('sum_gib'))}"]
        for mode in MODES:
            m = row.get(mode, {})
            cells += [_cell(m.get("output_tokens_per_s")) if "error" not in m
                      else f"failed: {m['error'][:80]}", _cell(m.get("vs_llamacpp"), "{:.2f}x")]
        cells += [_cell(per_token and per_token / 1e9, "{:.3f}"), _cell(row.get("read_gbps")),
                  _cell(row.get("read_vs_stream"), "{:.0%}")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(result: dict) -> str:
    """The whole printed report."""
    load = result["load_average"]
    resident = ("all rows up at once, after " + f"{result['warmup']} warm-up rounds"
                if result.get("resident") == "all" else "each row restarted every round")
    out = [f"{result['checkpoint']} ({result['date']}); median of {result['runs']} runs, rows "
           f"alternating, {resident}; batch 1: {result['batch1']['requests']}"
           f" x (32 -> {result['batch1']['output_len']}) one at a time; batched: "
           f"{result['batched']['requests']} x (32 -> {result['batched']['output_len']}); load "
           f"average {load['start'][0]:.2f} at start, {load['end'][0]:.2f} at end",
           f"command: {result['command']}",
           f"streaming read (torch.sum, {result['stream_read'][0]['gib']} GiB, "
           f"{result['stream_read'][0]['threads']} threads): "
           + ", ".join(f"median {s['median_gbps']} best {s['best_gbps']} GB/s"
                       for s in result["stream_read"]) + " (before / after the rows)", "",
           table(result), ""]
    for name, row in result["rows"].items():
        runs = "; ".join(f"{m} {row[m]['runs_s']} s" for m in MODES if row.get(m, {}).get(
            "runs_s"))
        runs += f"; load {row.get('load_runs_s')} s"
        out.append(f"  {name}: {runs}  {json.dumps(row.get('info', {}))}")
    for pair, gap in result["logprob_gap"].items():
        if "error" in gap:
            out.append(f"  first-token logprob gap {pair}: failed: {gap['error'][:200]}")
            continue
        out.append(f"  first-token logprob gap {pair}: max {gap['max_abs']}, mean "
                   f"{gap['mean_abs']}, argmax agree {gap['argmax_agree']}")
    for name, parts in result["bytes_per_token"].items():
        out.append(f"  bytes per token {name}: " + ", ".join(
            f"{k} {v / 1e9:.3f} GB" for k, v in parts.items()))
    agree = result.get("agreement")
    if agree and "error" not in agree:
        out.append(f"  greedy agreement with transformers (float32, {agree['checkpoint']}): "
                   f"{agree['identical']}/{agree['prompts']} identical over "
                   f"{agree['output_len']} tokens, matching prefix "
                   f"{agree['matching_prefix_fraction']:.1%}")
    elif agree:
        out.append(f"  greedy agreement with transformers failed: {agree['error'][-500:]}")
    return "\n".join(out)
