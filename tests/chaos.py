"""Chaos over gRPC for the server tests: requests cancelled, timed out or aborted at seeded
random points, interleaved with normal greedy requests whose tokens the tests then compare
(tests/test_overload.py, tests/test_qwen3_next_server.py)."""

from __future__ import annotations

import asyncio
import random

import grpc
from grpc_helpers import request, token_ids

from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc


def check_one_final(responses: list[pb.GenerateResponse], rid: str) -> None:
    """The stream is `rid`'s and ends with exactly one final response."""
    assert responses and all(r.request_id == rid for r in responses)
    assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]


async def chaos_request(stub, rng: random.Random, i: int, *, vocab: int, max_prompt: int,
                        max_tokens: int, kinds: list[str]) -> str:
    """One request of a seeded random kind from `kinds` ("cancel", "timeout", "abort",
    "abort-twice", "normal"), prompt of 1..max_prompt ids, 1..max_tokens tokens; checks what
    the server answered and returns what happened to it."""
    rid = f"chaos-{i}"
    prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(1, max_prompt))]
    n = rng.randint(1, max_tokens)
    req = request(prompt, max_tokens=n, ignore_eos=True, request_id=rid,
                  temperature=rng.choice([0.0, 0.8]), seed=i)  # fmt: skip
    kind = rng.choice(kinds)
    after = rng.randint(0, 6)
    if kind == "timeout":
        try:
            responses = [r async for r in stub.Generate(req, timeout=rng.uniform(0.005, 0.3))]
        except grpc.aio.AioRpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
            return "timed out"
        check_one_final(responses, rid)
        return "finished"
    call = stub.Generate(req, timeout=120)
    responses: list[pb.GenerateResponse] = []
    if kind == "normal":
        responses = [r async for r in call]
        check_one_final(responses, rid)
        assert responses[-1].finish_reason == "length" and len(token_ids(responses)) == n
        return "finished"
    if after == 0:
        await asyncio.sleep(rng.uniform(0, 0.02))
    else:
        async for r in call:
            responses.append(r)
            if len(token_ids(responses)) >= after or r.finished:
                break
    if kind == "cancel":
        call.cancel()
        return "cancelled"
    answers = [await stub.Abort(pb.AbortRequest(request_id=rid))]
    if kind == "abort-twice":
        answers.append(await stub.Abort(pb.AbortRequest(request_id=rid)))
    if not (responses and responses[-1].finished):
        async for r in call:
            responses.append(r)
    check_one_final(responses, rid)
    reason = responses[-1].finish_reason
    assert sum(a.aborted for a in answers) == (reason == "abort"), (answers, reason)
    if reason != "abort":
        assert reason == "length" and len(token_ids(responses)) == n
        assert all(not a.aborted and a.detail for a in answers), answers
    return f"abort -> {reason}"


async def run_with_chaos(address: str, normal: list[pb.GenerateRequest], num_chaos: int, *,
                         in_flight: int, chaos_seed: int, shuffle_seed: int,
                         **chaos: object) -> tuple[list[list[int]], dict[str, int]]:
    """The `normal` greedy requests and `num_chaos` `chaos_request`s (keyword arguments
    `chaos`), shuffled together, at most `in_flight` at once; returns each normal request's
    tokens (in order; each must end with finish_reason "length") and the chaos outcomes."""
    outcomes: dict[str, int] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.MoeEngineStub(channel)
        gate = asyncio.Semaphore(in_flight)
        rng = random.Random(chaos_seed)

        async def normal_one(req: pb.GenerateRequest) -> list[int]:
            async with gate:
                responses = [r async for r in stub.Generate(req, timeout=120)]
            check_one_final(responses, req.request_id)
            assert responses[-1].finish_reason == "length"
            return token_ids(responses)

        async def chaos_one(i: int) -> None:
            async with gate:
                outcome = await chaos_request(stub, rng, i, **chaos)
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        tasks = [normal_one(r) for r in normal]
        jobs = tasks + [chaos_one(i) for i in range(num_chaos)]
        random.Random(shuffle_seed).shuffle(jobs)  # interleave normal and chaos requests
        order = {id(t): k for k, t in enumerate(tasks)}
        results = await asyncio.wait_for(asyncio.gather(*jobs), 240)
        tokens: list[list[int]] = [[] for _ in tasks]
        for job, result in zip(jobs, results, strict=True):
            if id(job) in order:
                tokens[order[id(job)]] = result
        return tokens, outcomes
