"""Where a disaggregated request's time to first token goes: the router's three steps timed one
by one against running `moe-serve --disaggregation-mode prefill` and `decode` instances.

    python bench/disagg_phases.py --prefill 127.0.0.1:50072 --decode 127.0.0.1:50073

Sends `--requests` requests one at a time (prompts of 32-256 random ids, 4 greedy tokens, a
pause between them), each as `moe_engine.disagg.pairing.Pairing` does: PrepareDecode on the
decode instance, Generate with its placement on the prefill instance (the prompt, its first
token and the K/V transfer), Generate with the first token on the decode instance up to its
first response. Prints the median and the largest time of each step (ms). Run it on an idle
split for the hand-off's own cost, or beside a load (bench/serve.py) to see which step a load
slows. Not a test: nothing is checked beyond the calls succeeding.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import uuid

import grpc

from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc

STEPS = ("PrepareDecode", "prefill + transfer", "decode's first response")


def one(prefill: pb_grpc.MoeEngineStub, decode: pb_grpc.MoeEngineStub, prompt: list[int]
        ) -> tuple[float, float, float]:
    """The three steps' times for one request (seconds)."""
    req = pb.GenerateRequest(request_id=f"phases-{uuid.uuid4().hex}", max_tokens=4,
                             temperature=0, ignore_eos=True)
    req.prompt_ids.ids.extend(prompt)
    t0 = time.perf_counter()
    placement = decode.PrepareDecode(req, timeout=60)
    t1 = time.perf_counter()
    preq = pb.GenerateRequest()
    preq.CopyFrom(req)
    preq.kv_placement = placement.placement
    first = next(r for r in prefill.Generate(preq, timeout=60) if r.token_ids).token_ids[0]
    t2 = time.perf_counter()
    dreq = pb.GenerateRequest()
    dreq.CopyFrom(req)
    dreq.remote_first_token = first
    stream = decode.Generate(dreq, timeout=60)
    next(stream)
    t3 = time.perf_counter()
    for _ in stream:
        pass
    return t1 - t0, t2 - t1, t3 - t2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill", default="127.0.0.1:50072", help="HOST:PORT")
    p.add_argument("--decode", default="127.0.0.1:50073", help="HOST:PORT")
    p.add_argument("--requests", type=int, default=25)
    p.add_argument("--pause-s", type=float, default=0.3, help="between requests (seconds)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    with grpc.insecure_channel(args.prefill) as pc, grpc.insecure_channel(args.decode) as dc:
        prefill, decode = pb_grpc.MoeEngineStub(pc), pb_grpc.MoeEngineStub(dc)
        rows = []
        for _ in range(args.requests):
            prompt = [rng.randint(3, 8000) for _ in range(rng.randint(32, 256))]
            rows.append(one(prefill, decode, prompt))
            time.sleep(args.pause_s)
    for k, name in enumerate(STEPS):
        values = sorted(r[k] * 1e3 for r in rows)
        print(f"{name}: median {statistics.median(values):.1f} ms, max {values[-1]:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
