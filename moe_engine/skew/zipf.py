"""Synthetic routing skew: Zipf-distributed expert choice, for tests and benchmarks.

Expert popularity follows Zipf's law: the expert of popularity rank i (1-based) is chosen with
probability proportional to 1 / i**s (s = 0: uniform; s around 1 to 1.5 resembles the skew
reported for real MoE routers). Which expert holds which rank is a random permutation per MoE
layer (or one shared by all layers), drawn from the seed. Each token picks k *distinct* experts
by sampling without replacement (`torch.multinomial(..., replacement=False)`, i.e. successive
draws renormalised over the experts not yet taken), so per-expert loads are Zipf-like but
flattened at the top: an expert can take at most one of a token's k slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moe_engine.skew.trace import ExpertTrace


def zipf_probs(num_experts: int, s: float) -> torch.Tensor:
    """[E] float64 probabilities of popularity ranks 1..E: p_i = i**-s / sum_j j**-s.

    Raises:
        ValueError: num_experts < 1 or s < 0.
    """
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if s < 0:
        raise ValueError(f"the Zipf exponent s must be >= 0, got {s}")
    weights = torch.arange(1, num_experts + 1, dtype=torch.float64) ** -s
    return weights / weights.sum()


@dataclass
class ZipfRouter:
    """Draws `topk_ids` with Zipf skew; `hot_order[l]` lists layer l's experts, hottest first.

    Args:
        num_experts: E.
        top_k: k distinct experts per token (k <= E).
        s: Zipf exponent (>= 0).
        num_layers: MoE layers L (each gets its own permutation unless `shared_hot`).
        seed: seeds the permutations and every draw.
        shared_hot: one permutation for all layers (the same experts are hot everywhere).

    Raises:
        ValueError: k > E, k < 1, or a bad E / s.
    """

    num_experts: int
    top_k: int
    s: float
    num_layers: int = 1
    seed: int = 0
    shared_hot: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in [1, {self.num_experts}], got {self.top_k}")
        self.generator = torch.Generator().manual_seed(self.seed)
        probs = zipf_probs(self.num_experts, self.s)
        rows = 1 if self.shared_hot else self.num_layers
        perms = [torch.randperm(self.num_experts, generator=self.generator) for _ in range(rows)]
        if self.shared_hot:
            perms = perms * self.num_layers
        #: [L, E] int64: hot_order[l, i] is the expert of popularity rank i+1 in layer l.
        self.hot_order = torch.stack(perms)
        #: [L, E] float64: the probability weight of each expert (by expert id) in each layer.
        self.expert_probs = torch.empty(self.num_layers, self.num_experts, dtype=torch.float64)
        self.expert_probs.scatter_(1, self.hot_order, probs.expand(self.num_layers, -1))

    def topk_ids(self, num_tokens: int, layer: int = 0) -> torch.Tensor:
        """[T, k] int32 distinct expert ids per token for MoE layer `layer` (row of hot_order)."""
        if num_tokens == 0:
            return torch.empty(0, self.top_k, dtype=torch.int32)
        weights = self.expert_probs[layer].expand(num_tokens, -1)
        ids = torch.multinomial(weights, self.top_k, replacement=False, generator=self.generator)
        return ids.to(torch.int32)

    def step_counts(self, num_tokens: int) -> torch.Tensor:
        """[L, E] int64 token-expert pairs of one step of `num_tokens` tokens in every layer."""
        return torch.stack(
            [
                torch.bincount(
                    self.topk_ids(num_tokens, layer).reshape(-1).long(),
                    minlength=self.num_experts,
                )
                for layer in range(self.num_layers)
            ]
        )


def zipf_trace(
    num_steps: int,
    num_layers: int,
    num_experts: int,
    top_k: int,
    s: float,
    tokens_per_step: int = 64,
    seed: int = 0,
    shared_hot: bool = False,
    step_time_s: float = 0.05,
    ep_size: int = 1,
    n_group: int | None = None,
) -> tuple[ExpertTrace, ZipfRouter]:
    """A whole synthetic trace: `num_steps` rows of `tokens_per_step` tokens through L layers.

    Args:
        n_group: recorded as meta "n_group" (the expert-group layout a report groups by);
            the draws themselves ignore groups.

    Returns:
        (trace, router): trace.counts [S, L, E] int32, moe_layers 0..L-1, step_time_s constant,
        meta {"model": "synthetic-zipf", "zipf_s", "seed", "top_k", "ep_size", "num_experts"}
        (+ "n_group" when given); router.hot_order gives each layer's experts hottest first.
    """
    router = ZipfRouter(num_experts, top_k, s, num_layers, seed, shared_hot)
    counts = np.stack([router.step_counts(tokens_per_step).numpy() for _ in range(num_steps)])
    trace = ExpertTrace(
        moe_layers=np.arange(num_layers, dtype=np.int64),
        counts=counts.astype(np.int32).reshape(num_steps, num_layers, num_experts),
        step_time_s=np.full(num_steps, step_time_s, dtype=np.float64),
        num_tokens=np.full(num_steps, tokens_per_step, dtype=np.int64),
        num_steps=np.ones(num_steps, dtype=np.int64),
        meta=dict(
            model="synthetic-zipf",
            zipf_s=s,
            seed=seed,
            top_k=top_k,
            ep_size=ep_size,
            num_experts=num_experts,
            shared_hot=shared_hot,
            **({} if n_group is None else dict(n_group=n_group)),
        ),
    )
    trace.validate()
    return trace, router
