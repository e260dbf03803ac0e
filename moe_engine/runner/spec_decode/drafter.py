"""Drafter: after each step, the draft tokens every running request carries into the next one,
and the counters of what the verification accepted (vLLM's `SpecDecodingStats`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_engine.request import Request
from moe_engine.runner.spec_decode.ngram import NgramProposer
from moe_engine.startup.spec_config import SpeculativeConfig


@dataclass
class SpecDecodeStats:
    """Counters since startup.

    Attributes:
        num_drafts: request-steps that verified drafts.
        num_draft_tokens: drafts verified; num_accepted_tokens: drafts accepted (tokens).
        accepted_per_pos: [num_speculative_tokens] drafts accepted at each position (the
            first draft of a step at 0); position i counts only steps that reached it.
    """

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verifying request-step emits on average (accepted drafts + 1); 0 before
        any (vLLM's mean acceptance length)."""
        if not self.num_drafts:
            return 0.0
        return 1.0 + self.num_accepted_tokens / self.num_drafts


#: Steps a request proposes no drafts after one draft was proposed and rejected.
DRAFT_COOLDOWN_STEPS = 4


class Drafter:
    """Proposes each running request's drafts for the next step.

    A request gets drafts when it decodes next (its prompt is done), has no grammar nor logits
    processors (penalties, min_p, logit_bias: `_may_draft`), and the
    batch is below `disable_by_batch_size`; at most `num_speculative_tokens`, and never more
    than its `max_tokens` leaves room for (a step emits the accepted drafts and one more), so
    its KV never grows past prompt + max_tokens - 1 tokens.

    Each request's draft length adapts to what its verifications accept (additive increase,
    cut on rejection): after m of k drafts were accepted it may propose m + 1 next time, one
    more after all were accepted (up to `num_speculative_tokens`); when its single draft is
    rejected it proposes none for `DRAFT_COOLDOWN_STEPS` steps. A verified draft costs a row of
    the step's forward whether or not it is accepted (about 1.4x the step at K = 4 here,
    bench/NOTES.md section 18), so a request whose drafts keep failing stops paying for them,
    whatever the batch size. Outputs never depend on it (only which tokens are verified when).

    Args:
        config: the speculative config (enabled).
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        #: The n-gram proposer; None for MTP drafts, which the model runner proposes
        #: (`spec_decode/mtp.py`) and `propose` receives.
        self.proposer = (
            NgramProposer(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
            if config.method == "ngram" else None
        )
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(
        self, running: list[Request], proposals: dict[str, list[int]] | None = None
    ) -> None:
        """Set `spec_token_ids` of the running requests (cleared for those without).

        Args:
            running: the running requests after the step.
            proposals: with MTP drafts, request id -> the drafts the step's MTP passes
                proposed (trimmed here as n-gram drafts are).
        """
        limit = self.config.disable_by_batch_size
        off = limit > 0 and len(running) >= limit
        eligible = []
        for req in [] if off else running:
            if not _may_draft(req):
                continue
            if req.draft_cooldown:  # resting after a rejected draft: one step less
                req.draft_cooldown -= 1
            else:
                eligible.append(req)
        for req in running:
            req.spec_token_ids = []
        if not eligible:
            return
        k = self.config.num_speculative_tokens
        room = [min(r.sampling_params.max_tokens - r.num_output_tokens - 1,
                    k if r.draft_limit is None else r.draft_limit) for r in eligible]
        if self.proposer is None:
            got = proposals or {}
            drafts = [got.get(r.request_id, [])[: max(n, 0)] for r, n in zip(eligible, room,
                                                                             strict=True)]
        else:
            drafts = self.proposer.propose([r.all_token_ids for r in eligible], room)
        for req, d in zip(eligible, drafts, strict=True):
            req.spec_token_ids = d

    def record(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Count one request-step that verified `num_drafts` drafts and accepted the first
        `num_accepted` of them, and set the request's next draft limit (class docstring)."""
        k = self.config.num_speculative_tokens
        if num_accepted == num_drafts:
            request.draft_limit = min(k, num_drafts + 1)
        else:
            request.draft_limit = num_accepted + 1
            if num_drafts == 1:  # its one draft failed: rest a few steps
                request.draft_cooldown = DRAFT_COOLDOWN_STEPS
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.accepted_per_pos[pos] += 1


def _may_draft(req: Request) -> bool:
    """Decoding next (every token but the last computed), unfinished, without a grammar and
    without logits processors (penalties, min_p, logit_bias: the plain sampler applies them
    to the one token such a request samples per step, so its tokens are exactly those it
    gets with speculation off; the draft verification does not apply them)."""
    return (
        not req.is_finished
        and req.grammar is None
        and not req.sampling_params.has_logits_processors
        and req.num_tokens - req.num_computed_tokens == 1
    )
