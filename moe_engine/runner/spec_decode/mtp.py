"""MTP drafts: the checkpoint's multi-token-prediction layer (`models/layers/mtp.py`) proposes
each request's next drafts from the step's hidden states, in two parts per step (vLLM's
`EagleProposer` with `DeepSeekMTP`; SGLang's NextN):

1. **Catch-up**: the MTP layer runs over every position of the step whose next token is now
   known and final: a prompt chunk's positions (the next token is the next prompt token, or
   the sampled one after the prompt's last), a verify step's positions up to the last
   accepted draft (the next tokens are the accepted drafts and the token sampled after
   them). Its KV (MTP layer's own cache, the same slots as the main model's) then holds every
   position before the request's next one, so later drafts attend to the whole context. A
   rejected draft's position is rewritten when the position is computed again.
2. **Chain**: the catch-up's output at a request's last position predicts draft 1; each
   further draft feeds the previous draft's embedding and the MTP layer's own output (in
   place of the main model's hidden state) one position on, writing its KV in the slots the
   scheduler reserved ahead (`num_lookahead_tokens`); a draft whose position has no slot yet
   ends the request's chain.

Drafts are the MTP logits' argmax (a deterministic draft: `rejection.py` verifies them
exactly). With several MTP layers only the first is used, chained (DeepSeek-V3 ships one).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_engine.scheduler import ScheduledRequest

if TYPE_CHECKING:
    from moe_engine.models.base import MoeCausalLM
    from moe_engine.runner.inputs import StepInputBuilder


class MTPDrafter:
    """Runs the MTP passes of each step (module doc) for a `ModelRunner`.

    Args:
        model: the model (it has `mtp_layers`).
        inputs: the runner's step-input builder (`runner.inputs.StepInputBuilder`).
        kv_cache: the first MTP layer's KV cache (the runner's `mtp_kv_caches[0]`).
        num_speculative_tokens: drafts per request and step (K >= 1).
        disable_drafts_at: with this many sampling requests in a step or more, no drafts
            are proposed (the catch-up still runs); 0: never.
    """

    def __init__(
        self,
        model: MoeCausalLM,
        inputs: StepInputBuilder,
        kv_cache: object,
        num_speculative_tokens: int,
        disable_drafts_at: int,
    ) -> None:
        self.model, self.inputs = model, inputs
        self.layer = model.mtp_layers[0]
        self.kv_cache = kv_cache
        self.num_speculative_tokens = num_speculative_tokens
        self.disable_drafts_at = disable_drafts_at

    def propose(
        self,
        ordered: list[ScheduledRequest],
        hidden: torch.Tensor,
        emitted: dict[str, list[int]],
        tables: list[list[list[int]]],
        rows: list[ScheduledRequest],
    ) -> list[list[int]]:
        """Catch up the MTP cache on this step and propose the next drafts.

        Args:
            ordered: the step's scheduled requests in token order (`ModelRunner.execute`).
            hidden: [T, H] the main model's final hidden states of the step's tokens.
            emitted: request id -> the tokens the step emits (accepted drafts + 1), for the
                requests that sampled.
            tables: per KV-cache group, each `ordered` request's block ids.
            rows: the sampling requests, in row order.

        Returns:
            Per row of `rows`, up to num_speculative_tokens drafts ([] when drafts are off).
        """
        catch_up = _catch_up_inputs(ordered, emitted)
        order = sorted(range(len(ordered)), key=lambda i: len(catch_up[i][1]) > 1)
        h_last = self._catch_up(ordered, hidden, catch_up, tables, order)
        wanted = [r.request.request_id for r in rows]
        if not wanted or self.num_speculative_tokens < 1 or (
            self.disable_drafts_at and len(rows) >= self.disable_drafts_at
        ):
            return [[] for _ in rows]
        index = {s.request.request_id: i for i, s in enumerate(ordered)}
        which = [index[rid] for rid in wanted]
        where = {i: k for k, i in enumerate(order)}
        h = h_last[torch.tensor([where[i] for i in which], device=hidden.device)]
        out = [[d] for d in self._argmax(h)]
        # draft k + 1 writes the MTP KV of position p + k (p: the request's next position)
        positions = [ordered[i].start + len(catch_up[i][1]) for i in which]
        limits = [self._slots(ordered[i], tables[0][i]) for i in which]
        for _ in range(1, self.num_speculative_tokens):
            live = [j for j in range(len(which)) if positions[j] < limits[j]]
            if not live:
                break
            idx = torch.tensor(live, device=h.device)
            h_new, drafts = self._chain_step(
                [out[j][-1] for j in live], h[idx], [positions[j] for j in live],
                [[t[which[j]] for j in live] for t in tables],
            )  # fmt: skip
            h = h.clone()
            h[idx] = h_new
            for j, d in zip(live, drafts, strict=True):
                out[j].append(d)
                positions[j] += 1
        return out

    def _slots(self, s: ScheduledRequest, table: list[int]) -> int:
        """Positions below this have a KV slot (the request's blocks, never past its
        prompt + max_tokens - 1 tokens, so never past max_model_len)."""
        req = s.request
        most = req.num_prompt_tokens + req.sampling_params.max_tokens - 1
        return min(len(table) * self.inputs.block_size, most)

    def _catch_up(
        self,
        ordered: list[ScheduledRequest],
        hidden: torch.Tensor,
        catch_up: list[tuple[list[int], list[int]]],
        tables: list[list[list[int]]],
        order: list[int],
    ) -> torch.Tensor:
        """One MTP forward over every request's catch-up positions (single-position requests
        first, as the attention batches want); returns [len(ordered), H] the output at each
        request's last catch-up position, in `order`."""
        model, inputs = self.model, self.inputs
        rows_idx = [r for i in order for r in catch_up[i][0]]
        ids = [t for i in order for t in catch_up[i][1]]
        q_lens = torch.tensor([len(catch_up[i][1]) for i in order], dtype=torch.int64)
        starts = torch.tensor([ordered[i].start for i in order], dtype=torch.int64)
        step = inputs.host_inputs(ids, q_lens, starts, [[t[i] for i in order] for t in tables])
        ends = torch.cumsum(q_lens, 0) - 1
        input_ids, positions, meta, ends = inputs.on_device(step, ends)
        previous = hidden[torch.tensor(rows_idx, device=hidden.device)]
        embeds = model.model.embed_tokens(input_ids)
        h = self.layer.predict(embeds, previous, positions, meta, self.kv_cache)
        return h[ends]

    def _chain_step(
        self,
        tokens: list[int],
        previous: torch.Tensor,
        positions: list[int],
        tables: list[list[list[int]]],
    ) -> tuple[torch.Tensor, list[int]]:
        """One draft more per request: `tokens` (the last drafts) at `positions`, after
        `previous` [B, H] (the MTP outputs before them); returns the new outputs and drafts."""
        model, inputs = self.model, self.inputs
        step = inputs.decode_host_inputs(tokens, positions, tables)
        input_ids, pos, meta, _ = inputs.on_device(step, torch.zeros(0, dtype=torch.int64))
        embeds = model.model.embed_tokens(input_ids)
        h = self.layer.predict(embeds, previous, pos, meta, self.kv_cache)
        return h, self._argmax(h)

    def _argmax(self, h: torch.Tensor) -> list[int]:
        """The greedy next token of each MTP output row [B, H] (the shared LM head)."""
        logits = self.model.compute_logits(self.layer.shared_head.norm(h))
        return logits.argmax(dim=-1).tolist()


def _catch_up_inputs(
    ordered: list[ScheduledRequest], emitted: dict[str, list[int]]
) -> list[tuple[list[int], list[int]]]:
    """Per scheduled request, (its catch-up positions' rows in the step's hidden states, the
    next token at each): positions start .. start + fed - 1 of its fed tokens, then, for a
    verify step, the accepted drafts' positions; a request that sampled ends with the token
    it sampled."""
    out, offset = [], 0
    for s in ordered:
        req, start = s.request, s.start
        fed = s.num_tokens - len(s.draft_token_ids)
        tokens = emitted.get(req.request_id)
        if tokens is None:  # a prompt chunk before the prompt's end: the next one is known
            nxt = req.all_token_ids[start + 1 : start + fed + 1]
        else:
            nxt = req.all_token_ids[start + 1 : start + fed] + list(tokens)
        out.append((list(range(offset, offset + len(nxt))), nxt))
        offset += s.num_tokens
    return out
