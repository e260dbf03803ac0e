"""The sampler's cost with and without the logits processors (issue 44): one call on a batch of
B rows over a V-token vocabulary, greedy or random, with no processors, with logit_bias +
repetition/frequency/presence penalties on every row, on half of the rows, and with min_p.

    python bench/sampler_penalties.py [--rows 64] [--vocab 151936] [--prompt 512] [--output 256]
        [--device cpu|cuda] [--iters 20] [--threads N] [--temperatures 0,1]

Prints the median milliseconds per call of each case: the whole sampler call, and the
processors alone (`apply_logit_bias` + `apply_penalties`, the part this path adds before the
argmax / temperature). Each request has a random prompt and a
random output so far of the given lengths (tokens).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from moe_engine.request import Request
from moe_engine.runner.logits_processors import apply_logit_bias, apply_penalties
from moe_engine.runner.sampler import Sampler
from moe_engine.sampling_params import SamplingParams


def requests(rows: int, vocab: int, prompt: int, output: int, every: int, temperature: float,
             **kw) -> list[Request]:  # fmt: skip
    """`rows` requests at `temperature`; every `every`-th one also gets the params `kw` (0:
    none does)."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i in range(rows):
        extra = kw if every and i % every == 0 else {}
        r = Request(str(i), torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
                    SamplingParams(temperature=temperature, **extra))  # fmt: skip
        for t in torch.randint(0, vocab, (output,), generator=gen).tolist():
            r.append_token(t)
        out.append(r)
    return out


def time_ms(fn, logits: torch.Tensor, iters: int) -> float:
    """Median milliseconds of fn(a fresh copy of logits) over `iters` calls (2 warm-up)."""
    times = []
    for _ in range(iters + 2):
        x = logits.clone()
        if x.is_cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--temperatures", default="0,1",
                   help="comma-separated: 0 greedy steps, 1 random ones (default: both)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    logits = torch.randn(a.rows, a.vocab, device=a.device) * 4
    penalties = {"repetition_penalty": 1.2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
                 "logit_bias": {1: 5.0, 2: -5.0}}  # fmt: skip
    for temp in (float(t) for t in a.temperatures.split(",")):
        cases = {
            "none": {},
            "penalties+bias, all rows": {**penalties},
            "penalties+bias, half the rows": {**penalties, "_every": 2},
            "min_p 0.05, all rows": {"min_p": 0.05},
        }
        for name, kw in cases.items():
            every = kw.pop("_every", 1) if kw else 0
            reqs = requests(a.rows, a.vocab, a.prompt, a.output, every, temp, **kw)
            sampler = Sampler()
            whole = time_ms(lambda x: sampler(x, reqs), logits, a.iters)  # noqa: B023
            alone = time_ms(lambda x: (apply_logit_bias(x, reqs),  # noqa: B023
                                       apply_penalties(x, reqs, sampler.token_cache)),  # noqa: B023
                            logits, a.iters)  # fmt: skip
            kind = "greedy" if temp == 0 else "random"
            print(f"{kind:6s} {name:30s} sampler {whole:8.2f} ms, processors {alone:6.2f} ms "
                  f"per call ({a.rows} rows x {a.vocab})")


if __name__ == "__main__":
    main()
