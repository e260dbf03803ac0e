"""Decode tok/s with and without n-gram (prompt-lookup) speculation on repetitive workloads.

Checkpoint `bench-qwen3-moe` (bench/workload.py; random weights, made once into the cache
directory) unless `--model` names another. Every row is one `moe_engine.LLM` (loaded once,
untimed) whose `EngineCore` this script steps itself: `off` (no speculation) and one per K
(`speculative_method="ngram"`, `num_speculative_tokens=K`, n-grams `--ngram-min..--ngram-max`,
`speculative_disable_by_batch_size=--disable-by`, default 0 = never disabled, so that every
batch size measures the speculation itself). A run submits the first `batch` requests of the
workload at once (greedy, ignore EOS, `min_tokens = max_tokens = --output-len`) and steps until
all are done.

Figures per (workload, batch, K), median over `--runs` timed rounds after `--warmup` untimed
ones, the rows taking turns round after round (so that load from elsewhere hits them alike):
  - decode tok/s: the output tokens generated after the step in which the last request of the
    batch got its first token (every prefill done), over the wall time of the steps after it;
    prefill steps, and the decodes that ran beside them, are not counted;
  - e2e tok/s: all output tokens over the whole stepping (prefill included);
  - from `EngineCore.drafter.stats` (this run's counters): mean acceptance length (tokens a
    verifying request-step emits, accepted drafts + 1), drafts per verifying step, and per
    draft position the share of verifying steps that accepted it;
  - greedy mismatches: requests whose tokens differ from the `off` row's of the same batch and
    round (they must be 0: greedy output is the same with and without speculation).

Workloads (`--workloads`), request i seeded from `--seed` and i, token ids in [3, vocab):
  - `spans`: a prompt of `randint(*--prompt-len)` tokens made of one random span of 16-64
    tokens repeated; the model's own greedy continuation (nothing forces it to copy the
    prompt: the acceptance measured is what this model does);
  - `echo`: a prefix P, its greedy continuation G (`--output-len` tokens, made first by the
    `off` row, untimed), then P again: prompt = P + G + P with len(P) chosen so that the prompt
    is `randint(*--prompt-len)` tokens. If the model continued the second P with G again,
    every lookup of P's suffix would draft G; whether it does depends on the whole context,
    so the report measures it (`echo agreement`: mean common prefix of the continuation and G,
    as a share of the output) instead of assuming it.

    python bench/spec_decode.py                       # the table (several minutes on 2 cores)
    python bench/spec_decode.py --runs 1 --warmup 0 --workloads spans
    python bench/spec_decode.py --ks 2,4,8 --batches 1 --large-batches ""
    python bench/spec_decode.py --quick               # seconds: demo checkpoint, few tokens
    python bench/spec_decode.py --json
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workload import add_greedy_requests, apply_quick_defaults  # noqa: E402

import moe_engine  # noqa: E402, F401  (first: it sets OMP_WAIT_POLICY before torch loads)

logger = logging.getLogger("bench.spec_decode")

WORKLOADS = ("spans", "echo")
OFF = "off"
#: Span lengths of the `spans` workload (tokens).
SPAN_LEN = (16, 64)


@dataclass
class RunOut:
    """One run of one batch on one row.

    token_ids: per request; decode_tokens / decode_s / decode_steps: after every prefill was
    done; total_s: the whole stepping; stats: this run's drafter counters (None for `off`).
    """

    token_ids: list[list[int]]
    decode_tokens: int
    decode_s: float
    total_s: float
    decode_steps: int = 0
    stats: dict[str, Any] | None = None


@dataclass
class Row:
    """A loaded engine: `off` or K drafts per step."""

    name: str
    k: int | None
    llm: Any
    counter: int = 0
    info: dict[str, Any] = field(default_factory=dict)


def parse_ks(text: str) -> list[int | None]:
    """`off,2,4` -> [None, 2, 4] (duplicates dropped, order kept).

    Raises:
        ValueError: an entry that is neither `off` nor a positive integer.
    """
    out: list[int | None] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        k = None if item == OFF else int(item)
        if k is not None and k < 1:
            raise ValueError(f"K must be off or >= 1, got {item!r}")
        if k not in out:
            out.append(k)
    return out


def parse_ints(text: str) -> list[int]:
    """`1,8` -> [1, 8]; empty text -> []."""
    return [int(s) for s in text.split(",") if s.strip()]


def row_name(k: int | None) -> str:
    return OFF if k is None else f"K={k}"


def spans_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    """`length` tokens: one random span of SPAN_LEN tokens repeated (the last copy cut)."""
    span = [rng.randint(3, vocab - 1) for _ in range(rng.randint(*SPAN_LEN))]
    return (span * (length // len(span) + 1))[:length]


def echo_prefix_len(prompt_len: int, output_len: int) -> int:
    """len(P) so that P + G + P is about `prompt_len` tokens (at least 1)."""
    return max(1, (prompt_len - output_len) // 2)


def echo_prompt(prefix: list[int], continuation: list[int]) -> list[int]:
    """P + G + P."""
    return [*prefix, *continuation, *prefix]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def mismatches(ref: list[list[int]], got: list[list[int]]) -> list[int]:
    """Indices of the requests whose tokens differ."""
    return [i for i, (a, b) in enumerate(zip(ref, got, strict=True)) if a != b]


def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One run's counters from two snapshots of `SpecDecodeStats`, with the derived figures:
    mean acceptance length, drafts per verifying step, acceptance rate, and per position the
    share of verifying steps whose draft there was accepted."""
    d = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens",
                                          "num_accepted_tokens")}
    per_pos = [a - b for a, b in zip(after["accepted_per_pos"], before["accepted_per_pos"],
                                     strict=True)]
    n = d["num_drafts"]
    d["accepted_per_pos"] = per_pos
    d["mean_acceptance_length"] = round(1 + d["num_accepted_tokens"] / n, 3) if n else 0.0
    d["drafts_per_step"] = round(d["num_draft_tokens"] / n, 3) if n else 0.0
    d["acceptance_rate"] = (round(d["num_accepted_tokens"] / d["num_draft_tokens"], 3)
                            if d["num_draft_tokens"] else 0.0)
    d["accepted_per_pos_rate"] = [round(a / n, 3) if n else 0.0 for a in per_pos]
    return d


def merge_stats(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Counters summed over runs, the derived figures recomputed."""
    zero = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
            "accepted_per_pos": [0] * len(runs[0]["accepted_per_pos"])}
    total = dict(zero)
    for r in runs:
        total = {k: (v + r[k] if k != "accepted_per_pos"
                     else [a + b for a, b in zip(v, r[k], strict=True)])
                 for k, v in total.items()}
    return stats_delta(zero, total)


def _snapshot(row: Row) -> dict[str, Any] | None:
    drafter = row.llm.engine.drafter
    if drafter is None:
        return None
    s = drafter.stats
    return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "accepted_per_pos": list(s.accepted_per_pos)}


def run_batch(row: Row, prompts: list[list[int]], output_len: int) -> RunOut:
    """All `prompts` submitted at once to the row's engine, stepped until done.

    Raises:
        RuntimeError: a request produced a number of tokens other than `output_len`.
    """
    engine = row.llm.engine
    ids = add_greedy_requests(row, prompts, output_len)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    before = _snapshot(row)
    t_decode = None
    tokens_at_decode = steps = 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        deltas = engine.step()
        for d in deltas:
            out[d.request_id].extend(d.new_token_ids)
        if t_decode is not None:
            steps += 1
        elif all(out[rid] for rid in ids):
            t_decode = time.perf_counter()
            tokens_at_decode = sum(len(t) for t in out.values())
    t_end = time.perf_counter()
    token_ids = [out[rid] for rid in ids]
    for i, t in enumerate(token_ids):
        if len(t) != output_len:
            raise RuntimeError(f"{row.name}: request {i}: {len(t)} tokens, expected {output_len}")
    after = _snapshot(row)
    total = sum(len(t) for t in token_ids)
    assert t_decode is not None
    return RunOut(token_ids, total - tokens_at_decode, t_end - t_decode, t_end - t0, steps,
                  stats_delta(before, after) if before is not None and after is not None
                  else None)


def load_rows(ckpt: str, ks: list[int | None], args: argparse.Namespace, max_batch: int
              ) -> dict[int | None, Row]:
    from moe_engine import LLM

    rows = {}
    for k in [None, *[k for k in ks if k is not None]]:
        spec = ({} if k is None else dict(
            speculative_method="ngram", num_speculative_tokens=k, ngram_min=args.ngram_min,
            ngram_max=args.ngram_max, speculative_disable_by_batch_size=args.disable_by))
        llm = LLM(model=ckpt, dtype=args.dtype, max_model_len=args.max_model_len,
                  max_num_seqs=max(max_batch, 1),
                  max_num_batched_tokens=args.max_num_batched_tokens,
                  kv_cache_memory=args.kv_cache_memory, kernel_backend=args.kernel_backend,
                  **spec)
        rows[k] = Row(row_name(k), k, llm, info={
            "compute_dtype": str(llm.engine.dtype).removeprefix("torch."), **spec})
    return rows


def make_requests(workload: str, n: int, args: argparse.Namespace, vocab: int,
                  off: Row | None) -> tuple[list[list[int]], dict[str, Any]]:
    """The workload's first `n` prompts and what the report says about them (for `echo`:
    the continuations G, made by the `off` row in one untimed batch).

    Raises:
        ValueError: unknown workload.
    """
    rngs = [random.Random(f"{args.seed}-{workload}-{i}") for i in range(n)]
    lengths = [rng.randint(*args.prompt_len) for rng in rngs]
    if workload == "spans":
        prompts = [spans_prompt(rng, length, vocab) for rng, length in
                   zip(rngs, lengths, strict=True)]
        return prompts, {}
    if workload != "echo":
        raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")
    assert off is not None
    prefixes = [[rng.randint(3, vocab - 1)
                 for _ in range(echo_prefix_len(length, args.output_len))]
                for rng, length in zip(rngs, lengths, strict=True)]
    conts = run_batch(off, prefixes, args.output_len).token_ids
    return ([echo_prompt(p, g) for p, g in zip(prefixes, conts, strict=True)],
            {"continuations": conts})


def measure(rows: dict[int | None, Row], workload: str, prompts: list[list[int]],
            plan: list[tuple[int, list[int | None]]], args: argparse.Namespace,
            extra: dict[str, Any]) -> list[dict[str, Any]]:
    """`plan`: (batch, the Ks run at it; off always). Rounds of every (batch, K) in order."""
    tasks = [(b, k) for b, ks in plan for k in [None, *[k for k in ks if k is not None]]]
    runs: dict[tuple[int, int | None], list[RunOut]] = {t: [] for t in tasks}
    mism: dict[tuple[int, int | None], list[int]] = {t: [] for t in tasks}
    for rnd in range(args.warmup + args.runs):
        timed = rnd >= args.warmup
        ref: dict[int, list[list[int]]] = {}
        for b, k in tasks:
            res = run_batch(rows[k], prompts[:b], args.output_len)
            if k is None:
                ref[b] = res.token_ids
            else:
                mism[(b, k)] += [i for i in mismatches(ref[b], res.token_ids)
                                 if i not in mism[(b, k)]]
            logger.info("%s batch %d %s: %s%.1f decode tok/s (%d tokens in %.2f s), %.2f s in all",
                        workload, b, row_name(k), "" if timed else "warm-up: ",
                        res.decode_tokens / max(res.decode_s, 1e-9), res.decode_tokens,
                        res.decode_s, res.total_s)
            if timed:
                runs[(b, k)].append(res)
    out = []
    for b, k in tasks:
        rs = runs[(b, k)]
        decode = statistics.median(r.decode_tokens / max(r.decode_s, 1e-9) for r in rs)
        e2e = statistics.median(sum(map(len, r.token_ids)) / r.total_s for r in rs)
        entry: dict[str, Any] = {
            "workload": workload, "batch": b, "k": row_name(k),
            "decode_tok_s": round(decode, 1), "e2e_tok_s": round(e2e, 1),
            "decode_runs_s": [round(r.decode_s, 3) for r in rs],
            "decode_tokens": rs[0].decode_tokens, "decode_steps": rs[-1].decode_steps,
            "ms_per_step": round(1e3 * statistics.median(
                r.decode_s / max(r.decode_steps, 1) for r in rs), 2),
            "greedy_mismatches": None if k is None else len(mism[(b, k)]),
            "mismatched_requests": None if k is None else sorted(mism[(b, k)]),
        }
        if k is not None:
            entry["spec"] = merge_stats([r.stats for r in rs if r.stats is not None])
            ref_ids = runs[(b, None)][-1].token_ids
            entry["first_divergence"] = [common_prefix(ref_ids[i], rs[-1].token_ids[i])
                                         for i in mismatches(ref_ids, rs[-1].token_ids)]
        if k is None and "continuations" in extra:
            conts = extra["continuations"][:b]
            entry["echo_agreement"] = round(statistics.mean(
                common_prefix(c, g) / max(len(g), 1)
                for c, g in zip(rs[-1].token_ids, conts, strict=True)), 3)
        out.append(entry)
    offs = {e["batch"]: e["decode_tok_s"] for e in out if e["k"] == OFF}
    for e in out:
        e["ratio_vs_off"] = round(e["decode_tok_s"] / offs[e["batch"]], 3) if offs[e["batch"]] \
            else None
    return out


def markdown_table(rows: list[dict[str, Any]]) -> str:
    head = ["workload", "batch", "K", "decode tok/s", "vs off", "e2e tok/s", "ms/step",
            "mean acceptance length", "drafts/step", "accepted per position",
            "greedy mismatches"]
    lines = ["| " + " | ".join(head) + " |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|---:|"]
    for e in rows:
        spec = e.get("spec")
        cells = [e["workload"], str(e["batch"]), e["k"], f"{e['decode_tok_s']:.1f}",
                 f"{e['ratio_vs_off']:.2f}x" if e["ratio_vs_off"] else "-",
                 f"{e['e2e_tok_s']:.1f}", f"{e['ms_per_step']:.2f}",
                 f"{spec['mean_acceptance_length']:.2f}" if spec and spec["num_drafts"] else "-",
                 f"{spec['drafts_per_step']:.2f}" if spec else "-",
                 " / ".join(f"{a:.2f}" for a in spec["accepted_per_pos_rate"]) if spec else "-",
                 "-" if e["greedy_mismatches"] is None else str(e["greedy_mismatches"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def crossover(rows: list[dict[str, Any]]) -> dict[str, int | None]:
    """Per workload and K, the smallest batch from which speculation is no faster than off
    (ratio <= 1.0) at every larger batch measured too; None where it pays at the largest."""
    ratios: dict[str, list[tuple[int, float]]] = {}
    for e in rows:
        if e["k"] != OFF and e["ratio_vs_off"] is not None:
            ratios.setdefault(f"{e['workload']} {e['k']}", []).append(
                (e["batch"], e["ratio_vs_off"]))
    out: dict[str, int | None] = {}
    for key, pairs in ratios.items():
        first = None
        for batch, ratio in sorted(pairs, reverse=True):
            if ratio > 1.0:
                break
            first = batch
        out[key] = first
    return out


def print_report(result: dict[str, Any]) -> None:
    load = result["load_average"]
    print(f"speculative decoding (n-gram {result['ngram']}, disable_by_batch_size "
          f"{result['disable_by']}) on {result['checkpoint']}; dtype {result['dtype']}, "
          f"{result['threads']} threads; prompts {result['prompt_len'][0]}-"
          f"{result['prompt_len'][1]} tokens, {result['output_len']} output tokens, greedy, "
          f"ignore EOS; median of {result['runs']} runs after {result['warmup']} warm-up, rows "
          f"alternating; {result['date']}; load average {load['start'][0]:.2f} "
          f"{load['start'][1]:.2f} {load['start'][2]:.2f} at start, {load['end'][0]:.2f} "
          f"{load['end'][1]:.2f} {load['end'][2]:.2f} at end")
    print(f"command: {result['command']}")
    print("decode tok/s: output tokens after every prefill of the batch was done / wall time "
          "of those steps (ms/step: per such step); e2e: all output tokens / the whole run "
          "(prefill included)")
    print()
    print(markdown_table(result["rows"]))
    print()
    for e in result["rows"]:
        if "echo_agreement" in e:
            print(f"  echo agreement ({e['workload']}, batch {e['batch']}): the continuation "
                  f"after P + G + P repeats G for {e['echo_agreement']:.1%} of its tokens "
                  "(common prefix, mean)")
    for e in result["rows"]:
        if e.get("greedy_mismatches"):
            print(f"  MISMATCH {e['workload']} batch {e['batch']} {e['k']}: requests "
                  f"{e['mismatched_requests']} differ from off (first divergence at tokens "
                  f"{e['first_divergence']} in the last round)")
    if result["greedy_mismatches"] and result["dtype"] != "float32":
        print("  (bfloat16: the verify step computes a token's logits in another batch shape "
              "than a decode step; a near-tied argmax can round the other way. float32 runs "
              "must show 0 mismatches: --dtype float32)")
    print("  speculation no longer pays (ratio <= 1.00 there and at every larger batch) "
          "from batch: " + ", ".join(
        f"{k}: {v if v is not None else 'never in this run'}"
        for k, v in result["crossover"].items()))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from moe_engine.startup.demo import default_cache_dir

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: bench-qwen3-moe; with --quick the demo "
                        "checkpoint)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated of {','.join(WORKLOADS)} (default both)")
    p.add_argument("--ks", default="off,2,4", help="K per step at --batches (off = none)")
    p.add_argument("--batches", default="1,8", help="batch sizes for every K of --ks")
    p.add_argument("--large-ks", default="4", help="K at --large-batches (against off)")
    p.add_argument("--large-batches", default="16,32,64",
                   help="batch sizes where verification cost is measured (empty: none)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[256, 512], metavar=("MIN", "MAX"))
    p.add_argument("--ngram-min", type=int, default=1)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument("--disable-by", type=int, default=0,
                   help="speculative_disable_by_batch_size of the K rows (default 0: never)")
    p.add_argument("--runs", type=int, default=3, help="timed rounds (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds before them")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="bfloat16")
    p.add_argument("--kernel-backend", default="auto", metavar="SPEC")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="512MiB",
                   help="per row (bytes or text such as 1GiB; every row holds its own)")
    p.add_argument("--cache-dir", type=Path, default=default_cache_dir(),
                   help="where bench-qwen3-moe is made once")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run in seconds: demo checkpoint (unless --model), batches 1,2, "
                        "K off,2, large batch 4, prompts of 24-48 tokens, 8 output tokens, "
                        "float32, one run, no warm-up (each can still be given)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--json-out", type=Path, default=None, help="also write it to this file")
    args = p.parse_args(argv)
    if args.quick:
        apply_quick_defaults(args, argv, {
            "--batches": "1,2", "--ks": "off,2", "--large-batches": "4", "--large-ks": "2",
            "--prompt-len": [24, 48], "--output-len": 8, "--runs": 1, "--warmup": 0,
            "--kv-cache-memory": "64MiB", "--max-model-len": 256, "--dtype": "float32",
        })
    try:
        args.ks_list = parse_ks(args.ks)
        args.large_ks_list = parse_ks(args.large_ks)
        args.batch_list = parse_ints(args.batches)
        args.large_batch_list = parse_ints(args.large_batches)
    except ValueError as exc:
        p.error(str(exc))
    args.workload_list = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := [w for w in args.workload_list if w not in WORKLOADS]:
        p.error(f"--workloads: unknown {unknown}; choose from {WORKLOADS}")
    if args.runs < 1 or args.warmup < 0:
        p.error("--runs must be >= 1 and --warmup >= 0")
    if args.output_len < 1 or not 1 <= args.prompt_len[0] <= args.prompt_len[1]:
        p.error("--output-len must be >= 1 and 1 <= --prompt-len MIN <= MAX")
    if any(b < 1 for b in args.batch_list + args.large_batch_list) or not (
            args.batch_list or args.large_batch_list):
        p.error("batch sizes must be >= 1, and at least one given")
    need = args.prompt_len[1] + args.output_len + max(
        [k or 0 for k in args.ks_list + args.large_ks_list] + [0])
    if need > args.max_model_len:
        p.error(f"--max-model-len {args.max_model_len} is below the longest request ({need})")
    return args


def vocab_size(ckpt: str) -> int:
    return int(json.loads((Path(ckpt) / "config.json").read_text())["vocab_size"])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s: %(message)s")
    import torch

    if args.model:
        ckpt = args.model
    elif args.quick:
        from moe_engine.startup.demo import ensure_demo_checkpoint

        ckpt = str(ensure_demo_checkpoint(str(args.cache_dir)))
    else:
        from workload import ensure_bench_checkpoint

        ckpt = str(ensure_bench_checkpoint(args.cache_dir))
    plan = [(b, args.ks_list) for b in args.batch_list]
    plan += [(b, args.large_ks_list) for b in args.large_batch_list if b not in args.batch_list]
    max_batch = max(b for b, _ in plan)
    load_start = os.getloadavg()
    rows = load_rows(ckpt, args.ks_list + args.large_ks_list, args, max_batch)
    vocab = vocab_size(ckpt)
    table: list[dict[str, Any]] = []
    for workload in args.workload_list:
        prompts, extra = make_requests(workload, max_batch, args, vocab, rows[None])
        table += measure(rows, workload, prompts, plan, args, extra)
    result = {
        "command": " ".join(["python", "bench/spec_decode.py",
                             *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "load_average": {"start": load_start, "end": os.getloadavg()},
        "checkpoint": ckpt, "dtype": args.dtype, "threads": torch.get_num_threads(),
        "ngram": f"{args.ngram_min}..{args.ngram_max}", "disable_by": args.disable_by,
        "prompt_len": list(args.prompt_len), "output_len": args.output_len,
        "runs": args.runs, "warmup": args.warmup,
        "rows_info": {r.name: r.info for r in rows.values()},
        "rows": table, "crossover": crossover(table),
        "greedy_mismatches": sum(e["greedy_mismatches"] or 0 for e in table),
    }
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    # In float32 the verify forward gives the decode forward's argmax exactly; in bfloat16 a
    # near-tie can flip with the step's shape (bench/NOTES.md section 18), so only float32
    # mismatches are an error.
    return 1 if result["greedy_mismatches"] and args.dtype == "float32" else 0


if __name__ == "__main__":
    sys.exit(main())
