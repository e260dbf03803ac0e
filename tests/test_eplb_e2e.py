"""Runtime EPLB end to end (issue 45, first "done when" bullet): the skewed-router checkpoint
(tests/skewed_checkpoint.py: experts 0 and 1 take most pairs, both on rank 0 under the
contiguous placement) served at --ep-size 2 and 4 with --enable-eplb, redundant experts
(one per rank), a short window and interval and --eplb-balancedness-threshold 1.0:

- greedy requests stream through gRPC while the server is polled: at least one rebalance is
  committed while some of them are still running (the stats say so mid-stream);
- every greedy output is token-exact with the oracle across the rebalance: transformers
  (float32 greedy generate of the same checkpoint) for float experts; for 4-bit experts the
  engine with EPLB off (the offline `LLM` at ep 1, which tests/test_skewed_checkpoint.py and
  tests/test_quantized_serving.py check against transformers on the dequantized weights),
  and for MXFP4 transformers on the dequantized copy too;
- rank balancedness after the rebalance is higher than before: the controller's record
  (before, predicted and measured after), and independently the pairs each rank's experts
  processed in a batch after the move (`GetExpertLoad`'s per-rank counts) against what the
  contiguous placement would have given them;
- the live placement holds every expert, no expert twice on a rank, replicas of the hot ones.

ep 2 with float experts runs in the fast suite; ep 4 and the 4-bit variants are `slow`.
"""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
import torch
from fixtures import dequantized_experts_copy, hf_greedy
from grpc_helpers import ServerThread, token_ids
from grpc_helpers import request as make_request
from skewed_checkpoint import make_skewed_checkpoint

from moe_engine import LLM, SamplingParams
from moe_engine.eplb.placement import redundant_slots
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    EplbConfig,
    ModelConfig,
    ParallelConfig,
    QuantConfig,
    SchedulerConfig,
)

#: Prompts (lengths) and greedy tokens per request of the batch a rebalance lands in: 8
#: requests over at most 4 sequences per rank and a 32-token budget, so the batch runs ~40
#: steps and the decision at step WINDOW falls while all of them stream.
PROMPT_LENS = [5, 23, 40, 9, 31, 14, 52, 3]
MAX_NEW = [32, 28, 36, 30, 24, 34, 26, 32]
WINDOW = 6
#: The hot experts: both on rank 0 at ep 2 and on ranks 0 and 1 at ep 4, and neither among the
#: redundant slots EPLB starts with (`moe_engine.eplb.placement.redundant_slots`: the experts
#: after each rank's range, 4 and 0 at ep 2; 2, 4, 6 and 0 at ep 4), so the starting placement
#: is skewed and the first rebalance has something to fix.
HOT = (1, 3)
INTERVAL = 6

VARIANTS = [
    pytest.param((2, None), id="ep2"),
    pytest.param((4, None), id="ep4", marks=pytest.mark.slow),
    pytest.param((2, "int4"), id="ep2-int4", marks=pytest.mark.slow),
    pytest.param((2, "mxfp4"), id="ep2-mxfp4", marks=pytest.mark.slow),
    pytest.param((4, "mxfp4"), id="ep4-mxfp4", marks=pytest.mark.slow),
]


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def skewed_ckpt(tmp_path_factory):
    return make_skewed_checkpoint(tmp_path_factory.mktemp("eplb_skewed"), hot_experts=HOT)


def _config(ckpt, ep_size: int, quant: str | None) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(model=str(ckpt), max_model_len=256),
        cache=CacheConfig(num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32),
        parallel=ParallelConfig(ep_size=ep_size, collective_timeout_s=60),
        quant=QuantConfig(method=quant, group_size=32) if quant else QuantConfig(),
        eplb=EplbConfig(enabled=True, window_steps=WINDOW, step_interval=INTERVAL,
                        num_redundant_experts=ep_size, balancedness_threshold=1.0),
    )


def _oracle(ckpt, quant: str | None, prompts: list[list[int]], tmp_path) -> list[list[int]]:
    """Greedy ids of every prompt (MAX_NEW each) from the oracle of the module docstring."""
    if quant is None:
        return [hf_greedy(ckpt, [p], n)[0] for p, n in zip(prompts, MAX_NEW, strict=True)]
    llm = LLM(model=str(ckpt), max_model_len=256, quantization=quant, quant_group_size=32)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_NEW]
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    if quant == "mxfp4":  # exact on CPU: transformers on the dequantized weights agrees
        root = tmp_path / f"oracle-{len(list(tmp_path.iterdir()))}"  # one copy per call
        root.mkdir()
        deq = dequantized_experts_copy(ckpt, root, quant, 32)
        assert got == [hf_greedy(deq, [p], n)[0] for p, n in zip(prompts, MAX_NEW, strict=True)]
    return got


class Served:
    """The server of one variant and what its first batch saw."""

    def __init__(self, handle: ServerThread, ep_size: int, quant: str | None) -> None:
        self.handle, self.ep_size, self.quant = handle, ep_size, quant
        self.engine = handle.server.engine

    def stats(self) -> Any:
        return self.handle.run(self.engine.get_stats())

    def eplb(self) -> Any:
        return self.stats().total.eplb

    def expert_load(self) -> Any:
        return self.handle.run(self.engine.get_expert_load())

    def stream(self, prompts: list[list[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """Stream every prompt at once (greedy, MAX_NEW); meanwhile poll the EPLB stats.

        Returns:
            the token ids per prompt, and the polls: (rebalances committed, requests
            finished) at each poll, in time order.
        """
        done = [0]
        lock = threading.Lock()
        with grpc.insecure_channel(self.handle.address) as channel:
            stub = pb_grpc.MoeEngineStub(channel)

            def one(i: int) -> list[int]:
                req = make_request(prompts[i], max_tokens=MAX_NEW[i], temperature=0.0,
                                   ignore_eos=True)
                out = token_ids(list(stub.Generate(req, timeout=180)))
                with lock:
                    done[0] += 1
                return out

            polls: list[tuple[int, int]] = []
            with ThreadPoolExecutor(len(prompts)) as pool:
                futures = [pool.submit(one, i) for i in range(len(prompts))]
                while not all(f.done() for f in futures):
                    with lock:
                        finished = done[0]
                    polls.append((self.eplb().num_rebalances, finished))
                    time.sleep(0.02)
                got = [f.result() for f in futures]
        return got, polls


@pytest.fixture(scope="module", params=VARIANTS)
def served(request, skewed_ckpt):
    ep_size, quant = request.param
    handle = ServerThread(_config(skewed_ckpt, ep_size, quant), ServerOptions(port=0),
                          startup_timeout_s=300)
    try:
        yield Served(handle, ep_size, quant)
    finally:
        handle.close()


def test_rebalance_while_streaming_stays_token_exact(served, skewed_ckpt, tmp_path):
    prompts = _prompts(seed=45)
    expected = _oracle(skewed_ckpt, served.quant, prompts, tmp_path)
    assert served.eplb().num_rebalances == 0
    got, polls = served.stream(prompts)
    assert got == expected
    # a rebalance was committed while requests of the batch were still streaming
    assert any(r >= 1 and finished < len(prompts) for r, finished in polls), polls
    eplb = served.eplb()
    assert eplb.num_rebalances >= 1 and eplb.experts_moved > 0 and eplb.bytes_received > 0
    assert eplb.bytes_sent == eplb.bytes_received
    record = eplb.rebalances[0]
    assert record.committed_step > record.step and record.move_steps >= 1
    # a second batch after the move: still token-exact
    prompts2 = _prompts(seed=46)
    got2, _ = served.stream(prompts2)
    assert got2 == _oracle(skewed_ckpt, served.quant, prompts2, tmp_path)


def test_rank_balancedness_rises(served):
    """After test_rebalance_while_streaming_stays_token_exact, one more batch: the first
    rebalance's record says the placement it replaced was less balanced than the one it
    served (predicted), the median balancedness measured after the rebalances is higher than
    before the first one, and the batch spread its pairs over the ranks more evenly than the
    starting placement would have (`GetExpertLoad`'s per-rank counts, differenced)."""
    before = served.expert_load()
    served.stream(_prompts(seed=47))
    after = served.expert_load()
    eplb = served.eplb()
    if eplb.num_rebalances == 0:
        pytest.fail("no rebalance happened (see the test before)")
    first = eplb.rebalances[0]
    assert first.balancedness_before < first.balancedness_after_predicted
    # measured on the window_steps (6) steps after the swap: few tokens, so single windows
    # are lumpy (at threshold 1.0 later moves follow every interval); the first move's
    # window and the median over the moves must beat the placement the first one replaced
    assert first.balancedness_after_measured > first.balancedness_before, first
    measured = [r.balancedness_after_measured for r in eplb.rebalances
                if r.balancedness_after_measured >= 0]
    assert measured and statistics.median(measured) > first.balancedness_before, (
        eplb.rebalances)
    ran = [[b - a for a, b in zip(la, lb, strict=True)]
           for la, lb in zip(before.rank_tokens, after.rank_tokens, strict=True)]
    counts = [[b - a for a, b in zip(la, lb, strict=True)]
              for la, lb in zip(before.counts, after.counts, strict=True)]
    start = redundant_slots(len(counts[0]), served.ep_size, served.ep_size)
    predicted_start = [_rank_pairs(layer, start) for layer in counts]
    assert _balancedness(ran) > _balancedness(predicted_start) + 0.05, (ran, predicted_start)
    for layer_ran, layer_counts in zip(ran, counts, strict=True):
        assert sum(layer_ran) == sum(layer_counts)  # every pair processed once


def test_live_placement_is_valid_with_hot_replicas(served):
    info = served.handle.run(served.engine.get_model_info())  # live, asked afresh
    assert info.eplb_enabled and info.eplb_rebalances >= 1
    slots = info.experts_per_rank
    assert len(slots) == served.ep_size
    num_experts = info.num_experts
    assert all(len(rank) == num_experts // served.ep_size + 1 for rank in slots)
    assert all(len(set(rank)) == len(rank) for rank in slots)  # no expert twice on a rank
    held = [e for rank in slots for e in rank]
    assert set(held) == set(range(num_experts))
    replicated = {e for e in held if held.count(e) > 1}
    assert replicated & set(HOT), slots  # a hot expert got a replica


def _rank_pairs(per_expert: list[int], slots: list[list[int]]) -> list[float]:
    """Pairs per rank when each expert's pairs are shared evenly by its replicas."""
    replicas = [sum(rank.count(e) for rank in slots) for e in range(len(per_expert))]
    return [sum(per_expert[e] / replicas[e] for e in rank) for rank in slots]


def _balancedness(rank_pairs: list[list[int]]) -> float:
    """Mean over layers that ran tokens of mean / max pairs per rank ([layers][ranks])."""
    per_layer = [statistics.fmean(r) / max(r) for r in rank_pairs if max(r) > 0]
    return statistics.fmean(per_layer)
