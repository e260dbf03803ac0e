"""Shared experts: a SwiGLU MLP every token goes through beside the routed experts.

DeepSeek-V2/V3 and GLM-4.5 add `n_shared_experts` always-active experts (DeepSeekMoE's shared
expert isolation, arXiv:2401.06066, sec. 3.2) as one MLP of width `moe_intermediate_size *
n_shared_experts`, ungated (transformers' `DeepseekV3MoE.shared_experts`, a `DeepseekV3MLP`).
Qwen2-MoE has one of width `shared_expert_intermediate_size` whose output is multiplied by
sigmoid(`shared_expert_gate`(x)), a Linear(H, 1) (`Qwen2MoeSparseMoeBlock`).

In `FusedMoE` the module runs on the tokens of the rank that owns them, once, never through
dispatch/combine; its output is added to the combined routed output (timer phase
"shared_experts"). The `ExpertLoadRecorder` counts routed token-expert pairs only: shared
experts are not in the per-expert or per-rank load (every token uses them, on its own rank,
so their work per rank is that rank's token count); their cost shows as the timer phase.

Checkpoint names. `FusedMoE` registers this module as `shared_experts`, so V2/V3/GLM names
load as they are; Qwen2-MoE's names map through `shared_expert_param_name`:

| checkpoint (`model.layers.{i}.mlp.` + ...)  | engine parameter (`model.layers.{i}.mlp.` + ...) |
|---------------------------------------------|--------------------------------------------------|
| `shared_experts.{gate,up,down}_proj.weight` | `shared_experts.{gate,up,down}_proj.weight`      |
| `shared_expert.{gate,up,down}_proj.weight`  | `shared_experts.{gate,up,down}_proj.weight`      |
| `shared_expert_gate.weight` [1, H]          | `shared_experts.expert_gate.weight` [1, H]       |

With `fused_gate_up` the gate and up projections are one checkpoint tensor [2I, H] (gate rows,
then up rows: Granite-MoE-Shared's `shared_mlp.input_linear`), held as one `MergedLinear`
`gate_up_proj` (shards "gate", "up"); the architecture renames the checkpoint's names onto it.

Kernels. Where the plan hands out a fused activation (`KernelPlan.silu_and_mul`: the triton
backend), `bind_kernels` moves gate_proj's and up_proj's weights (and biases) into one
``[2I, H]`` tensor and makes the two parameters views of its halves, so the forward is one
gate_up GEMM, one `silu_and_mul` and the down GEMM (three launches where the separate path
takes five), and a weight copied into either parameter in place is seen by the merged GEMM.
A weight update that replaces a parameter's tensor rebinds the model (`weight_update`), which
merges again. The checkpoint names and parameters are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels.dense.linear import LinearKernel
from kernels.plan import KernelPlan
from moe_engine.models.layers.linear import Linear, MergedLinear

#: Checkpoint-name pieces (under `.mlp.`) -> the engine's (`packed_modules_mapping` style).
SHARED_EXPERT_CHECKPOINT_NAMES = {
    ".mlp.shared_expert_gate.": ".mlp.shared_experts.expert_gate.",
    ".mlp.shared_expert.": ".mlp.shared_experts.",
}


def shared_expert_param_name(checkpoint_name: str) -> str:
    """The engine parameter name of a shared-expert checkpoint tensor (other names unchanged).

    "model.layers.3.mlp.shared_expert.up_proj.weight" -> "model.layers.3.mlp.shared_experts.
    up_proj.weight"; "model.layers.3.mlp.shared_expert_gate.weight" ->
    "model.layers.3.mlp.shared_experts.expert_gate.weight".
    """
    for piece, engine in SHARED_EXPERT_CHECKPOINT_NAMES.items():
        if piece in checkpoint_name:
            return checkpoint_name.replace(piece, engine, 1)
    return checkpoint_name


class SharedExperts(nn.Module):
    """x [T, H] -> down_proj(silu(gate_proj(x)) * up_proj(x)) [T, H], optionally times
    sigmoid(expert_gate(x)) [T, 1].

    Args:
        hidden_size: H.
        intermediate_size: I, the MLP width (`moe_intermediate_size * n_shared_experts` for
            V2/V3/GLM, `shared_expert_intermediate_size` for Qwen2-MoE).
        dtype: parameter dtype.
        gated: hold Qwen2-MoE's sigmoid gate `expert_gate` Linear(H, 1, bias=False).
        bias: the projections have biases (DeepSeek-V2's `mlp_bias`; default none).
        fused_gate_up: hold gate and up as one `MergedLinear` `gate_up_proj` [2I, H].

    Attributes:
        gate_proj, up_proj: Linear(H, I) (None with `fused_gate_up`); gate_up_proj:
            MergedLinear(H, 2I) or None; down_proj: Linear(I, H); expert_gate: Linear(H, 1)
            or None.

    Raises:
        ValueError: a non-positive size.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        dtype: torch.dtype,
        gated: bool = False,
        bias: bool = False,
        fused_gate_up: bool = False,
    ) -> None:
        super().__init__()
        if hidden_size < 1 or intermediate_size < 1:
            raise ValueError(
                f"shared experts need hidden_size ({hidden_size}) and intermediate_size "
                f"({intermediate_size}) >= 1"
            )
        self.intermediate_size = intermediate_size
        self.gate_up_proj: MergedLinear | None = None
        self.gate_proj: Linear | None = None
        self.up_proj: Linear | None = None
        if fused_gate_up:
            self.gate_up_proj = MergedLinear(
                hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias, dtype
            )
        else:
            self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
            self.up_proj = Linear(hidden_size, intermediate_size, bias=bias, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype)
        self.expert_gate = Linear(hidden_size, 1, bias=False, dtype=dtype) if gated else None
        #: Set by `bind_kernels` where the plan fuses the activation: the merged gate_up GEMM
        #: (its kernel, weight [2I, H], bias [2I] or None) and `silu_and_mul`; else None.
        self._gate_up: tuple[LinearKernel, torch.Tensor, torch.Tensor | None] | None = None
        self._silu_and_mul = None

    def bind_kernels(self, plan: KernelPlan) -> None:
        """Merge gate_proj and up_proj into one GEMM where the plan has a fused activation
        (`KernelPlan.silu_and_mul`) and neither projection is 4-bit (`Linear.quantize`); else
        keep the separate path. Call after loading, on the weights' final device (moving the
        module afterwards would part the parameters from the merged tensor); calling again
        merges the current parameters again."""
        self._gate_up = self._silu_and_mul = None
        act = plan.silu_and_mul()
        if self.gate_up_proj is not None:  # one GEMM already; the fused activation if any
            self._silu_and_mul = act
            return
        gate, up = self.gate_proj, self.up_proj
        if act is None or gate.quant_scheme is not None or up.quant_scheme is not None:
            return
        inter = self.intermediate_size
        weight = torch.cat([gate.weight.data, up.weight.data])  # [2I, H]
        gate.weight.data, up.weight.data = weight[:inter], weight[inter:]
        bias = None
        if gate.bias is not None:
            bias = torch.cat([gate.bias.data, up.bias.data])  # [2I]
            gate.bias.data, up.bias.data = bias[:inter], bias[inter:]
        kernel = plan.linear(weight, None)
        kernel.prepack(weight, bias)
        self._gate_up, self._silu_and_mul = (kernel, weight, bias), act

    def reset_packed(self) -> None:
        """The weights changed in place: drop the merged GEMM kernel's packed copy (the merged
        weight itself is the parameters' storage, so it is current)."""
        if self._gate_up is not None:
            self._gate_up[0].reset()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, H], same dtype."""
        if self.gate_up_proj is not None:
            gate_up = self.gate_up_proj(x)
            if self._silu_and_mul is not None:
                out = self.down_proj(self._silu_and_mul(gate_up))
            else:
                gate, up = gate_up.split(self.intermediate_size, dim=-1)
                out = self.down_proj(F.silu(gate) * up)
        elif self._gate_up is not None:
            kernel, weight, bias = self._gate_up
            out = self.down_proj(self._silu_and_mul(kernel(x, weight, bias)))
        else:
            out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        if self.expert_gate is not None:
            out = torch.sigmoid(self.expert_gate(x)) * out
        return out
