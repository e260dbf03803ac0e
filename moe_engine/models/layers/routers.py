"""The router modules over the routing rules of `layers/routing.py`. They hold the
checkpoint's router names, so a `FusedMoE`'s `gate` attribute *is* the router and
`model.layers.{i}.mlp.gate.weight` / `.gate.e_score_correction_bias` load by name: `weight`
[E, H] (float32 for the grouped routers, as transformers' `_keep_in_fp32_modules_strict` keeps
it), optional `bias` [E], and for the sigmoid router the persistent float32 buffer
`e_score_correction_bias` [E]. Each module's forward takes hidden [T, H] (any float dtype) and
returns (topk_weights [T, k] float32, topk_ids [T, k] int32).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from moe_engine.models.layers.routing import (
    SCORINGS,
    check_sigmoid_group_limits,
    check_v2_routing,
    routing_counts_experts,
    sigmoid_grouped_topk,
    softmax_grouped_topk,
    softmax_topk,
    sparsemixer_top2,
)

if TYPE_CHECKING:
    from kernels.plan import KernelPlan


class _Router(nn.Module):
    """The parameters every router module holds under the checkpoint's names.

    Attributes:
        weight: [E, H] parameter; bias: [E] parameter or None.
    """

    def __init__(
        self, hidden_size: int, num_experts: int, top_k: int, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, {num_experts}]")
        self.hidden_size, self.num_experts, self.top_k = hidden_size, num_experts, top_k
        self.weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False
        )
        self.bias = (
            nn.Parameter(torch.zeros(num_experts, dtype=dtype), requires_grad=False)
            if bias else None
        )
        #: Bound by `bind_kernels`: the rule's one-call kernel (the torch function's
        #: arguments), None: the torch function.
        self.kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None

    #: The name of this router's rule in `KernelPlan.router_topk` (its torch function's).
    ROUTING = ""

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Take the one-call routing of this rule (`KernelPlan.router_topk`), or None: the
        torch function."""
        self.kernel = plan.router_topk(self.weight.device.type, self.ROUTING)

    @property
    def counts_experts(self) -> bool:
        """Whether forward takes ``expert_counts=`` / ``row_weights=`` and counts the expert
        load in its launch (the bound kernel's `COUNTS_EXPERTS`: the Triton routers)."""
        return routing_counts_experts(self.kernel)

    @property
    def in_features(self) -> int:
        """H, as `nn.Linear` names it (for code that reads `mlp.gate.in_features`)."""
        return self.hidden_size

    def router_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, H] -> router_logits [T, E] in the router weight's dtype."""
        return F.linear(hidden.to(self.weight.dtype), self.weight, self.bias)


class SoftmaxTopKRouter(_Router):
    """Softmax over all experts then top-k (`softmax_topk`): Qwen2-MoE's `Qwen2MoeTopKRouter`
    (weight in the model dtype; `norm_topk_prob`), Qwen3-MoE, Mixtral (renormalised).

    Args:
        hidden_size: H; num_experts: E; top_k: k; norm_topk_prob: renormalise the k weights;
        dtype: the weight's dtype (the model's, as transformers keeps it); bias: a [E] bias.

    Raises:
        ValueError: top_k outside [1, E].
    """

    ROUTING = "softmax_topk"

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        dtype: torch.dtype = torch.float32,
        bias: bool = False,
    ) -> None:
        super().__init__(hidden_size, num_experts, top_k, bias, dtype)
        self.norm_topk_prob = norm_topk_prob

    def forward(
        self, hidden: torch.Tensor, **counts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> topk_weights [T, k] float32, topk_ids [T, k] int32 (`counts`: see
        `counts_experts`)."""
        route = self.kernel or softmax_topk
        return route(self.router_logits(hidden), self.top_k, self.norm_topk_prob, **counts)


class SigmoidGroupedTopKRouter(_Router):
    """DeepSeek-V3 / GLM-4.5 router (`sigmoid_grouped_topk`; transformers'
    `DeepseekV3TopkRouter`, `Glm4MoeTopkRouter`); with n_group = topk_group = 1 the plain
    biased top-k of MiniMax-M2 (sigmoid) and ERNIE-4.5-MoE (`scoring="softmax"`); softmax
    scores with groups or a bias: LongCat-Flash, Mistral-4.

    Args:
        hidden_size: H; num_experts: E (`n_routed_experts`, plus any zero-computation experts
        the router scores: `split_zero_experts`); top_k: `num_experts_per_tok`;
        n_group, topk_group: the group limit; norm_topk_prob; routed_scaling_factor;
        correction_bias: hold the `e_score_correction_bias` buffer (V3 and GLM do);
        bias: a router bias [E] (none of these families has one).
        scoring: "sigmoid" (default), "softmax" or "logits" (`SCORINGS`; "logits": the biased
            logits choose, their sigmoid weighs, Kolibri-1).
        dtype: the weight's dtype; float32 (default) whatever the model dtype, as transformers
            keeps V3's and GLM's (`_keep_in_fp32_modules_strict`: the logits are then
            float32), or the model's where the family's router computes its logits in it
            (MiniMax-M2, Cohere2-MoE, Llama 4's top-k sigmoid).
    The bias buffer is float32; the scores are computed in float32 from the logits.
    With n_group = topk_group = 1 and no correction bias this is plain sigmoid top-k.

    Raises:
        ValueError: see `check_sigmoid_group_limits`; a scoring not in `SCORINGS`.
    """

    ROUTING = "sigmoid_grouped_topk"

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
        correction_bias: bool = True,
        bias: bool = False,
        scoring: str = "sigmoid",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        check_sigmoid_group_limits(num_experts, top_k, n_group, topk_group)
        if scoring not in SCORINGS:
            raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")
        super().__init__(hidden_size, num_experts, top_k, bias, dtype)
        self.n_group, self.topk_group, self.scoring = n_group, topk_group, scoring
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        # persistent (in the state dict), so it loads by name; None when absent
        bias_buffer = torch.zeros(num_experts, dtype=torch.float32) if correction_bias else None
        self.register_buffer("e_score_correction_bias", bias_buffer)

    def forward(
        self, hidden: torch.Tensor, **counts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> topk_weights [T, k] float32, topk_ids [T, k] int32 (`counts`: see
        `counts_experts`)."""
        return (self.kernel or sigmoid_grouped_topk)(
            self.router_logits(hidden), self.top_k, self.e_score_correction_bias,
            self.n_group, self.topk_group, self.norm_topk_prob, self.routed_scaling_factor,
            **self._scoring_arg, **counts,
        )

    @property
    def _scoring_arg(self) -> dict[str, str]:
        """{} for sigmoid (every kernel's default), else the `scoring` keyword."""
        return {} if self.scoring == "sigmoid" else {"scoring": self.scoring}


class SoftmaxGroupedTopKRouter(_Router):
    """DeepSeek-V2 router (`softmax_grouped_topk`; transformers' `DeepseekV2TopkRouter`).

    Args:
        hidden_size: H; num_experts: E; top_k: k; topk_method: "greedy" or
        "group_limited_greedy"; n_group, topk_group: the group limit (may be None for
        "greedy"); routed_scaling_factor; bias: a router bias [E].
    The weight is float32 (transformers' `_keep_in_fp32_modules_strict = ["gate.weight"]`).

    Raises:
        ValueError: an unknown topk_method, or group limits `check_group_limits` refuses.
    """

    ROUTING = "softmax_grouped_topk"

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        topk_method: str,
        n_group: int | None,
        topk_group: int | None,
        routed_scaling_factor: float,
        bias: bool = False,
    ) -> None:
        check_v2_routing(num_experts, top_k, topk_method, n_group, topk_group)
        super().__init__(hidden_size, num_experts, top_k, bias, torch.float32)
        self.topk_method, self.n_group, self.topk_group = topk_method, n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor

    def forward(
        self, hidden: torch.Tensor, **counts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> topk_weights [T, k] float32, topk_ids [T, k] int32 (`counts`: see
        `counts_experts`)."""
        return (self.kernel or softmax_grouped_topk)(
            self.router_logits(hidden), self.top_k, self.topk_method, self.n_group,
            self.topk_group, self.routed_scaling_factor, **counts,
        )


class SparseMixerRouter(_Router):
    """PhiMoE's router (`sparsemixer_top2`; transformers' `PhimoeTopKRouter`, a Linear in the
    model dtype without a bias).

    Args:
        hidden_size: H; num_experts: E; top_k: must be 2 (SparseMixer picks two experts);
        jitter_eps: `router_jitter_noise`; dtype: the weight's dtype.

    Raises:
        ValueError: top_k other than 2, naming num_experts_per_tok; jitter_eps < 0.
    """

    ROUTING = "sparsemixer_top2"

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        jitter_eps: float,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        if top_k != 2:
            raise ValueError(
                f"num_experts_per_tok ({top_k}) must be 2: SparseMixer routing (PhiMoE) selects "
                "exactly two experts"
            )
        if jitter_eps < 0:
            raise ValueError(f"router_jitter_noise ({jitter_eps}) must be >= 0")
        super().__init__(hidden_size, num_experts, top_k, False, dtype)
        self.jitter_eps = jitter_eps

    def forward(
        self, hidden: torch.Tensor, **counts: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] -> topk_weights [T, 2] float32, topk_ids [T, 2] int32 (`counts`: see
        `counts_experts`)."""
        return (self.kernel or sparsemixer_top2)(
            self.router_logits(hidden), self.jitter_eps, **counts
        )
