"""Routing-load instrumentation: how many tokens each expert of each MoE layer received.

`ExpertLoadRecorder` keeps one counter tensor `[num_moe_layers, num_experts]` (int64, on the
device the model runs on) that each MoE layer adds its `topk_ids` histogram to (one `index_add_`
of ones per layer per step: a bincount without `torch.bincount`'s host sync on CUDA, where it
reads the input's max back to size its output); readers copy it out when they ask. Once per
step the engine calls `take_step_counts()` for that step's counts (the trace file's rows) and
for a ring of the last `window_steps` steps (`window_counts()`, "load over a recent window").
The summaries use the two conventions the field uses: `imbalance_ratio` = max / mean and
`balancedness` = mean / max (DeepSeek EPLB, SGLang's expert-distribution recorder).

Padded batches (CUDA-graph decode, `moe_engine.runner.cuda_graphs`): `set_row_mask(mask)` makes each
token row's pairs count `mask[row]` (1 or 0) instead of 1, so the padding rows of a replayed
graph add nothing; the mask is a static device buffer the graph runner fills per replay, so the
recording stays one `index_add_` with no host sync, capturable.
"""

from __future__ import annotations

import torch


class ExpertLoadRecorder:
    """Accumulates tokens per (MoE layer, expert).

    Args:
        moe_layers: the decoder-layer indices of the MoE layers, in order.
        num_experts: E, experts per MoE layer.
        ep_size: N, ranks whose received tokens `record_rank_tokens` adds up (1: no EP).
        window_steps: steps kept by the recent-window ring (`window_counts`); >= 1.
        device: where the counters live (the model's device; default CPU).
        n_group: the expert-group layout of group-limited routing (DeepSeek-V2/V3, GLM-4.5:
            `n_group` groups of E / n_group contiguous ids), or None when the model has none;
            carried into the trace meta (`layout_meta`) so that reports show per-group load.
            Counts are routed token-expert pairs only: shared experts are never recorded.

    Raises:
        ValueError: window_steps < 1, ep_size < 1, or n_group not dividing num_experts.
    """

    def __init__(
        self,
        moe_layers: list[int],
        num_experts: int,
        ep_size: int = 1,
        window_steps: int = 64,
        device: torch.device | str | None = None,
        n_group: int | None = None,
    ) -> None:
        if window_steps < 1 or ep_size < 1:
            raise ValueError(f"window_steps ({window_steps}) and ep_size ({ep_size}) must be >= 1")
        if n_group is not None and (n_group < 1 or num_experts % n_group):
            raise ValueError(
                f"n_group ({n_group}) must be >= 1 and divide num_experts ({num_experts})"
            )
        self.n_group = n_group
        self.moe_layers = list(moe_layers)
        self.row_of_layer = {layer: row for row, layer in enumerate(self.moe_layers)}
        self.num_experts, self.ep_size, self.window_steps = num_experts, ep_size, window_steps
        num_layers = len(self.moe_layers)
        self.counts = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        #: [num_moe_layers, ep_size] int64 tokens received per rank (see record_rank_tokens).
        self.rank_tokens = torch.zeros(num_layers, ep_size, dtype=torch.int64, device=device)
        self._ones = torch.ones(0, dtype=torch.int64, device=device)
        self._row_mask: torch.Tensor | None = None  # set_row_mask
        self._taken = torch.zeros_like(self.counts)  # counts at the last take_step_counts()
        self._taken_ranks = torch.zeros_like(self.rank_tokens)
        self._window = torch.zeros(window_steps, num_layers, num_experts, dtype=torch.int64,
                                   device=device)
        #: steps taken by take_step_counts() since construction or reset().
        self.num_steps = 0

    def set_row_mask(self, mask: torch.Tensor | None) -> None:
        """Weigh each token row's pairs by `mask` from now on (None: every row counts once).

        Args:
            mask: [P] int64 of 1 (a real row) and 0 (a padding row), on the counters' device,
                P >= the tokens of every step recorded while it is set; read (not copied) by
                each `record`, so refilling it in place changes what later records count.

        Raises:
            ValueError: a mask that is not a 1-D int64 tensor on the counters' device.
        """
        if mask is not None and (
            mask.dim() != 1 or mask.dtype != torch.int64 or mask.device != self.counts.device
        ):
            raise ValueError(
                f"row mask must be [P] int64 on {self.counts.device}, got "
                f"{tuple(mask.shape)} {mask.dtype} on {mask.device}"
            )
        self._row_mask = mask

    def record(self, layer: int, topk_ids: torch.Tensor, *, skip_negative: bool = False) -> None:
        """Add one step's routing of decoder layer `layer`.

        Args:
            topk_ids: [T, k] int32 global expert ids as the router chose them, all in [0, E)
                (with `skip_negative` also -1: a zero-computation expert's slot, not counted).

        Raises:
            ValueError: a row mask is set (`set_row_mask`) with fewer than T rows.
        """
        if skip_negative:
            self._record_valid(layer, topk_ids)
            return
        ids = topk_ids.reshape(-1)
        if self._row_mask is not None:
            t, k = topk_ids.shape
            if t > self._row_mask.numel():
                raise ValueError(f"{t} token rows, but the row mask has {self._row_mask.numel()}")
            weights = self._row_mask[:t, None].expand(t, k).reshape(-1)
        else:
            if self._ones.numel() < ids.numel():  # shapes only: no device sync
                self._ones = torch.ones(
                    max(ids.numel(), 2 * self._ones.numel()), dtype=torch.int64,
                    device=self.counts.device,
                )
            weights = self._ones[: ids.numel()]
        self.counts[self.row_of_layer[layer]].index_add_(0, ids, weights)

    def _record_valid(self, layer: int, topk_ids: torch.Tensor) -> None:
        """`record` of ids where -1 marks a slot that holds no expert (not counted)."""
        t, k = topk_ids.shape
        valid = (topk_ids >= 0).to(torch.int64)
        if self._row_mask is not None:
            if t > self._row_mask.numel():
                raise ValueError(f"{t} token rows, but the row mask has {self._row_mask.numel()}")
            valid = valid * self._row_mask[:t, None]
        self.counts[self.row_of_layer[layer]].index_add_(
            0, topk_ids.clamp_min(0).reshape(-1), valid.reshape(-1).to(self.counts.device)
        )

    def count_target(self, layer: int, num_tokens: int) -> dict[str, torch.Tensor | None]:
        """Where a router that counts in its own launch adds one step's routing of decoder
        layer `layer` (instead of `record`): ``expert_counts`` [E] int64, the layer's row of
        `counts` (a view), and ``row_weights`` [P] int64, the row mask (`set_row_mask`) or
        None (every row counts once). `kernels.moe.router_kernels` takes these keywords.

        Raises:
            ValueError: a row mask is set with fewer than `num_tokens` rows.
        """
        mask = self._row_mask
        if mask is not None and num_tokens > mask.numel():
            raise ValueError(f"{num_tokens} token rows, but the row mask has {mask.numel()}")
        return {"expert_counts": self.counts[self.row_of_layer[layer]], "row_weights": mask}

    def record_layers(self, layers: list[int], topk_ids: torch.Tensor) -> None:
        """Add one step's routing of several decoder layers in one `index_add_` (the native
        decode layers, `moe_engine.models.layers.native_decode.DecodeStep`); as `record` per
        layer, without a row mask.

        Args:
            layers: decoder-layer indices, each an MoE layer of this recorder.
            topk_ids: [len(layers), T, k] int32 global expert ids, all in [0, E).
        """
        rows = torch.tensor([self.row_of_layer[x] for x in layers], dtype=torch.int64)
        flat = (topk_ids.to(torch.int64) + (rows * self.num_experts)[:, None, None]).reshape(-1)
        if self._ones.numel() < flat.numel():
            self._ones = torch.ones(max(flat.numel(), 2 * self._ones.numel()),
                                    dtype=torch.int64, device=self.counts.device)
        self.counts.view(-1).index_add_(0, flat.to(self.counts.device),
                                        self._ones[: flat.numel()])

    def record_rank_tokens(self, layer: int, tokens_per_rank: torch.Tensor) -> None:
        """Add the tokens that decoder layer `layer`'s dispatch delivered to each rank.

        Args:
            tokens_per_rank: [ep_size] integer tokens (a token counts once per rank it reaches).
        """
        self.rank_tokens[self.row_of_layer[layer]] += tokens_per_rank.to(self.rank_tokens.device)

    def layout_meta(self) -> dict[str, int]:
        """The trace-meta keys describing the expert layout: {"n_group": G} when the model
        has expert groups, else {}."""
        return {} if self.n_group is None else {"n_group": self.n_group}

    def group_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """[L, E] pairs per expert (e.g. `snapshot()`) -> [L, n_group] pairs per group.

        Raises:
            ValueError: the recorder has no group layout.
        """
        if self.n_group is None:
            raise ValueError("this recorder has no expert groups (n_group is None)")
        return counts.reshape(counts.shape[0], self.n_group, -1).sum(dim=-1)

    def take_step_counts(self) -> torch.Tensor:
        """The counts since the previous call, i.e. one step's when called once per step.

        Also stores them in the recent-window ring. Device ops only (no host sync).

        Returns:
            [num_moe_layers, num_experts] int64 token-expert pairs, on the counters' device.
        """
        step = self.counts - self._taken
        self._taken.copy_(self.counts)
        self._window[self.num_steps % self.window_steps].copy_(step)
        self.num_steps += 1
        return step

    def take_step_rank_tokens(self) -> torch.Tensor:
        """[num_moe_layers, ep_size] int64 tokens received per rank since the previous call."""
        step = self.rank_tokens - self._taken_ranks
        self._taken_ranks.copy_(self.rank_tokens)
        return step

    def window_counts(self) -> torch.Tensor:
        """[num_moe_layers, num_experts] int64: counts of the last min(num_steps, window_steps)
        steps taken by `take_step_counts` (a copy)."""
        return self._window.sum(dim=0)

    def snapshot(self) -> torch.Tensor:
        """A copy of the counters: [num_moe_layers, num_experts] int64 tokens."""
        return self.counts.clone()

    def reset(self) -> None:
        """Zero every counter, the window and the step count."""
        for t in (self.counts, self.rank_tokens, self._taken, self._taken_ranks, self._window):
            t.zero_()
        self.num_steps = 0


def imbalance_ratio(load: torch.Tensor) -> torch.Tensor:
    """max / mean over the last dimension (1.0 = perfectly balanced); 0 where nothing ran.

    Args:
        load: [..., N] tokens per expert (or per rank).
    """
    load = load.double()
    mean = load.mean(dim=-1)
    return torch.where(mean > 0, load.amax(dim=-1) / mean.clamp_min(1e-12), 0.0)


def balancedness(load: torch.Tensor) -> torch.Tensor:
    """mean / max over the last dimension (1.0 = perfectly balanced); 0 where nothing ran."""
    load = load.double()
    peak = load.amax(dim=-1)
    return torch.where(peak > 0, load.mean(dim=-1) / peak.clamp_min(1e-12), 0.0)
