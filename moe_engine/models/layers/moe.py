"""The sparse MoE block: router -> top-k -> dispatch -> local experts -> combine.

The pipeline vLLM names in one comment (router, quantise-dispatch, permute-experts-unpermute,
combine) with the communicator as the seam for expert parallelism (DESIGN.md sections 2 and 6).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from comm import Communicator, NoopCommunicator
from kernels.cpu import fused_moe_cpu
from moe_engine.instrumentation import ExpertLoadRecorder
from moe_engine.models.layers.quantized_experts import QuantizedExperts


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts, then the top-k, optionally renormalised to sum to 1.

    The routing of Qwen3-MoE (`norm_topk_prob`) and Mixtral (always renormalised) in Hugging
    Face `transformers`. Ties go to the lower expert id (stable sort), so identical logits still
    give k distinct experts deterministically.

    Args:
        router_logits: [T, E] any float dtype.
        top_k: experts per token.
        renormalize: divide the k probabilities by their sum.

    Returns:
        topk_weights [T, k] float32, topk_ids [T, k] int32.
    """
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


class FusedMoE(nn.Module):
    """Routed SwiGLU experts stored stacked: w13 [E, 2*I, H] (gate; up) and w2 [E, H, I].

    Args:
        num_experts: E, routed experts in the model.
        top_k: experts per token.
        hidden_size: H; intermediate_size: I (per expert).
        renormalize: renormalise the top-k weights (see `softmax_topk`).
        dtype: parameter dtype.
        communicator: EP seam; `NoopCommunicator` for one rank.
    """

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype,
        communicator: Communicator | None = None,
    ) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size
        self.gate = nn.Linear(hidden_size, num_experts, bias=False, dtype=dtype)
        self.w13 = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype),
            requires_grad=False,
        )
        self.w2 = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype),
            requires_grad=False,
        )
        self.communicator: Communicator = communicator or NoopCommunicator()
        self.quantized: QuantizedExperts | None = None
        self.load_recorder: ExpertLoadRecorder | None = None
        self.layer_index = -1

    def attach_recorder(self, recorder: ExpertLoadRecorder, layer_index: int) -> None:
        """Count this layer's routing into `recorder` under decoder layer `layer_index`."""
        self.load_recorder, self.layer_index = recorder, layer_index

    def quantize(self, method: str, group_size: int) -> None:
        """Replace the float expert weights by a 4-bit copy (see `QuantizedExperts`).

        Raises:
            ValueError: a group size that does not divide the dimension it groups.
        """
        self.quantized = QuantizedExperts(self.w13.data, self.w2.data, method, group_size)
        del self.w13, self.w2

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, H] -> [T, H], same dtype."""
        router_logits = self.gate(hidden)  # [T, E]
        topk_weights, topk_ids = softmax_topk(router_logits, self.top_k, self.renormalize)
        if self.load_recorder is not None:
            self.load_recorder.record(self.layer_index, topk_ids)
        sent = self.communicator.dispatch(hidden, topk_ids, topk_weights)
        if self.quantized is not None:
            expert_out = self.quantized(sent.hidden, sent.topk_weights, sent.topk_ids)
        else:
            expert_out = fused_moe_cpu(
                sent.hidden, self.w13, self.w2, sent.topk_weights, sent.topk_ids
            )
        return self.communicator.combine(expert_out, sent.handle)

    def load_expert_weight(self, expert: int, shard: str, tensor: torch.Tensor) -> None:
        """Copy one checkpoint tensor into the stacked weights.

        Args:
            expert: expert id; shard: "gate" | "up" | "down" (one expert) or
                "gate_up" | "down_all" (all experts, transformers 5 fused layout).
            tensor: gate/up [I, H], down [H, I], gate_up [E, 2I, H], down_all [E, H, I].

        Raises:
            ValueError: on a shape mismatch, naming both shapes.
        """
        size = self.intermediate_size
        targets = {
            "gate": lambda: self.w13.data[expert, :size],
            "up": lambda: self.w13.data[expert, size:],
            "down": lambda: self.w2.data[expert],
            "gate_up": lambda: self.w13.data,
            "down_all": lambda: self.w2.data,
        }
        target = targets[shard]()
        if target.shape != tensor.shape:
            raise ValueError(
                f"expert weight {shard} of expert {expert}: checkpoint shape "
                f"{tuple(tensor.shape)} does not match the model's {tuple(target.shape)}"
            )
        target.copy_(tensor)
