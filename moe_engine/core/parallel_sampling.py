"""Parallel sampling (`SamplingParams.n > 1`): one request, n completions over one prompt.

As in vLLM v1 (`vllm/v1/engine/parallel_sampling.py`, `ParentRequest`), each completion is a
child `Request` of its own with `n = 1`, id `f"{index}_{request_id}"` and, when the parent has a
seed, seed `seed + index`, so completions differ from each other and repeat from run to run.

The prompt is computed once: the children share its full KV blocks through the prefix-cache
map (`KVCacheManager`). With prefix caching on they use it as any request does; with it off
they carry a `cache_salt` unique to the parent, so that only siblings find each other's blocks,
and the map forgets those blocks when the last child ends. Completion 0 (the lead) prefills
the prompt; the scheduler admits the others after it (in the same step, or once its last
prefill chunk is scheduled), and each of them computes only the tokens after the last full
block it shares (at least one token: the token before the first sampled one is always
recomputed, as with a prefix hit). A preempted child finds its siblings' blocks again.
"""

from __future__ import annotations

from dataclasses import replace

from moe_engine.request import Request
from moe_engine.sampling_params import SamplingParams


class ParentRequest:
    """The n child Requests of one request and how many of them have finished.

    Args:
        request_id: the client's id for the whole request.
        params: its sampling parameters (`params.n` children are made).
    """

    def __init__(self, request_id: str, params: SamplingParams) -> None:
        self.request_id = request_id
        self.params = params
        self.children: list[Request] = []
        self.num_finished = 0

    @property
    def n(self) -> int:
        return self.params.n

    @property
    def lead(self) -> Request:
        """Completion 0: the child that prefills the prompt for all."""
        return self.children[0]

    @property
    def finished(self) -> bool:
        """True once every child has finished (by stop, length or abort)."""
        return self.num_finished >= self.n

    @staticmethod
    def child_id(request_id: str, index: int) -> str:
        """The engine's id of completion `index` (vLLM's `f"{index}_{request_id}"`)."""
        return f"{index}_{request_id}"

    def child_params(self, index: int) -> SamplingParams:
        """The parent's parameters with n = 1 and, when seeded, seed + index."""
        seed = self.params.seed
        return replace(self.params, n=1, seed=None if seed is None else seed + index)

    def make_children(
        self,
        prompt_token_ids: list[int],
        eos_token_ids: frozenset[int],
        arrival_time: float,
        cache_salt: str | None,
    ) -> list[Request]:
        """Create the n child Requests (kept in `children`, index order).

        Args:
            prompt_token_ids: the shared prompt.
            eos_token_ids: the model's EOS ids.
            arrival_time: the parent's arrival (seconds, monotonic).
            cache_salt: the prefix-cache salt of the children (None with prefix caching on).
        """
        self.children = [
            Request(
                self.child_id(self.request_id, i),
                prompt_token_ids,
                self.child_params(i),
                eos_token_ids,
                arrival_time,
                parent=self,
                index=i,
                cache_salt=cache_salt,
            )
            for i in range(self.n)
        ]
        return self.children
