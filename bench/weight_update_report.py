"""The report of `bench/weight_update.py`: the header, the markdown tables of the rows and of
the 1T-parameter arithmetic (what the command prints; `--json-out` has the raw numbers)."""

from __future__ import annotations

from typing import Any

MiB = 1 << 20



def yes_no(flag: bool | None) -> str:
    return {True: "yes", False: "no", None: "-"}[flag]


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| row | experts | seconds | runs (s) | GB/s | read / receive s | stage s | "
             "commit s (requantize, rebind) | other s | trainer s | trainer GB/s | "
             "peak RSS + (first) | outputs equal a fresh start |",
             "|---|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        p = r["phases"]
        moved = p["read"] if r["source"] == "disk" else p["receive"]
        t = r.get("trainer")
        rss = r["peak_rss_over_before_mib_first"]
        lines.append(
            f"| {r['row']} | {r['experts']} | {r['seconds']:.3f} | "
            f"{' / '.join(f'{x:.3f}' for x in r['runs_s'])} | {r['gb_s']:.3f} | "
            f"{moved:.3f} | {p['stage']:.3f} | {p['commit']:.3f} ({p['requantize']:.3f}, "
            f"{p['rebind']:.3f}) | {p['other']:.3f} | {_s(t['transfer_s'] if t else None)} | "
            f"{_s(t['gb_s'] if t else None)} | "
            f"{'-' if rss is None else f'{rss:.0f} MiB'} | {yes_no(r['equal'])} |")
    return "\n".join(lines)


def arithmetic_table(a: dict[str, Any]) -> str:
    tb = a["bytes"] / 1e12
    lines = [f"| rate | GB/s | {a['params'] / 1e12:.0f}T parameters in bf16 ({tb:.1f} TB) |",
             "|---|---:|---:|"]
    for m in a["measured"]:
        lines.append(f"| measured: {m['rate']} | {m['gb_s']:.3f} | {m['seconds']:,.0f} s |")
    for link in a["links"]:
        lines.append(f"| stated link {link['gbit_s']} Gb/s (arithmetic) | {link['gb_s']:.3f} | "
                     f"{link['seconds']:,.0f} s |")
    return "\n".join(lines)


def print_report(res: dict[str, Any]) -> None:
    _print_header(res)
    print()
    print(markdown_table(res["rows"]))
    print()
    print("seconds: the engine's own (ControlReply.seconds); GB/s: bytes taken (as received) / "
          "seconds, decimal; the split by wrapping the engine's functions (monkeypatched): "
          "read = DiskUpdate.tensors, receive = RolloutControl._handshake + _receive (handshake + "
          "broadcasts), stage = StagedWeights.add, commit = StagedWeights.commit (requantize = "
          "_requantized, rebind = staging.rebind); trainer s: pack + broadcast after the "
          "handshake; peak RSS +: VmHWM over VmRSS before the row's first update (the staged "
          "copy, and the checkpoint pages safetensors maps while reading; the rows share this "
          "process, so a later row may reuse memory an earlier one freed)")
    for r in res["rows"]:
        print(f"  {r['row']}: outputs equal a fresh start: {yes_no(r['equal'])} (after the "
              f"update to the perturbed copy, {r['check_version']}; the update changed the "
              f"outputs: {yes_no(r['changed'])})")
    print()
    print("arithmetic, not measured: the same update for a 1T-parameter model at each rate")
    print()
    print(arithmetic_table(res["arithmetic"]))
    print()
    print("  a broadcast sends every byte to every engine rank (under expert parallelism a "
          "rank keeps only its experts but receives every bucket), so the time is bound by "
          "one link's rate, not divided by the number of ranks")


def _print_header(res: dict[str, Any]) -> None:
    """The command, the machine, the checkpoint, how the rows ran, and the group."""
    load, m, c = res["load_average"], res["machine"], res["checkpoint"]
    print(f"command: {res['command']}")
    print(f"{res['date']}; {m['cpu']}, {m['cores']} cores ({m['bf16']}), {m['threads']} torch "
          f"threads, {m['memory_gib']:.0f} GiB, torch {m['torch']}; load average "
          f"{' '.join(f'{x:.2f}' for x in load['start'])} at start, "
          f"{' '.join(f'{x:.2f}' for x in load['end'])} at end; {res['duration_s']:.0f} s")
    print(f"checkpoint {c['path']} ({c['params'] / 1e6:.1f} M parameters, {c['tensors']} "
          f"tensors, {c['bytes'] / 1e6:.0f} MB); perturbed copy {res['perturbed']}; dtype "
          f"{res['dtype']}, int4 group size {res['quant_group_size']}")
    print(f"median of {res['runs']} updates after 1 warm-up, rows taking turns, updates "
          f"alternating between the perturbed copy and the original; page cache warm (both "
          f"folders read in the warm-up round, no cache dropped): 'read' comes out of the "
          f"page cache, not from the disk")
    if res.get("group"):
        g = res["group"]
        print(f"distributed: gloo on loopback, buckets of {g['bucket_bytes'] / MiB:g} MiB "
              f"({g['buckets']} per update); trainer process started with both checkpoints "
              f"in its memory in {g['trainer_ready_s']:.1f} s (loading them "
              f"{g['trainer_load_s']:.1f} s); group formed once in {g['form_s']:.3f} s "
              f"(init_weight_update_group; not in the rows)")

# -- main -----------------------------------------------------------------------------------
