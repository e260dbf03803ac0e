"""The one message handler: what an input message does to a core, and what to report.

Both transports call it: the single-process loop (`core_proc.CoreLoop`, ZeroMQ) for each
message as it arrives, and every expert-parallel rank (`rank.LockstepLoop`, broadcast/gather)
for each message of an iteration. `apply` acts on one message and returns a `Report`; the
transport sends the report's outputs, refusals and answers (`reply_for` turns the answers of
one rank, or of every rank, into the front end's reply), and steps the core with `step`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import torch

from moe_engine.core.outputs import CoreStats, EngineCoreOutput, ExpertLoad, ModelInfo, engine_stats
from moe_engine.core.protocol import EngineCoreProtocol
from moe_engine.engine.messages import (
    AbortRequests,
    AddError,
    CoreInput,
    CoreOutput,
    EngineCoreRequest,
    ExpertLoadReply,
    GetExpertLoad,
    GetModelInfo,
    GetStats,
    Heartbeat,
    ModelInfoReply,
    PrepareDecode,
    PrepareDecodeReply,
    Shutdown,
    StatsReply,
)
from moe_engine.engine.role import Role
from moe_engine.instrumentation import balancedness, imbalance_ratio
from moe_engine.weight_update.messages import ControlInput, ControlReply, merge_replies

#: `agree(ok)` -> whether every rank staged its part of a weight update (`RolloutControl`).
Agree = Callable[[bool], bool]
#: One rank's answer to a query, by the query's reply_id.
Answer = CoreStats | ExpertLoad | ModelInfo | ControlReply | PrepareDecodeReply


@dataclass
class Report:
    """What applying messages (and a step) produced, for the transport to send.

    Attributes:
        outputs: request outputs (one EngineCoreOutputs message when sent).
        add_errors: refusals of requests (sent after the outputs).
        replies: answers to queries and control messages, by reply_id (sent last, each turned
            into its reply by `reply_for`).
        stop: a Shutdown was applied.
    """

    outputs: list[EngineCoreOutput] = field(default_factory=list)
    add_errors: list[AddError] = field(default_factory=list)
    replies: dict[int, Answer] = field(default_factory=dict)
    stop: bool = False


def model_info_of(core: EngineCoreProtocol) -> ModelInfo:
    """The core's model info with `has_tokenizer` (whether text prompts can be served) and this
    process's pid."""
    return msgspec.structs.replace(
        core.model_info(), has_tokenizer=core.tokenizer is not None, pid=os.getpid()
    )


def apply(core: Any, role: Role, message: CoreInput, report: Report | None = None, *,
          rank: int | None = None, agree: Agree | None = None) -> Report:
    """Act on one input message; what it produced is added to `report` (a new one if None).

    Args:
        core: the EngineCore (or a test double with its interface and `rollout`).
        role: this instance's role (`role.PlainRole` without a prefill/decode split).
        message: the decoded input.
        rank: this rank under expert parallelism (requests and PrepareDecode addressed to
            another rank are ignored; stats carry the rank), None for one process.
        agree: the ranks' agreement for weight updates (`RolloutControl.update`), None for one.

    Returns:
        `report`, with `stop` set by Shutdown. Heartbeats (they have their own socket) and
        unknown messages change nothing.
    """
    report = Report() if report is None else report
    match message:
        case EngineCoreRequest(rank=target) if rank is None or target == rank:
            outputs, refusal = role.add(message)
            report.outputs.extend(outputs)
            if refusal is not None:
                report.add_errors.append(refusal)
        case PrepareDecode(request=req) if rank is None or req.rank == rank:
            report.replies[message.reply_id] = role.prepare(message)
        case AbortRequests(request_ids=ids):
            role.forget(ids)
            report.outputs.extend(core.abort_requests(ids))
        case GetStats(reply_id=rid):
            stats = core.get_stats()
            report.replies[rid] = (stats if rank is None
                                   else msgspec.structs.replace(stats, rank=rank))
        case GetExpertLoad(reply_id=rid):
            report.replies[rid] = core.get_expert_load()
        case GetModelInfo(reply_id=rid):
            report.replies[rid] = model_info_of(core)
        case _ if isinstance(message, ControlInput):
            reply, outputs = (core.rollout.handle(message) if agree is None
                              else core.rollout.handle(message, agree=agree))
            report.outputs.extend(outputs)
            report.replies[message.reply_id] = reply
        case Shutdown():
            report.stop = True
        case Heartbeat():
            pass
    return report


def step(core: EngineCoreProtocol, role: Role, report: Report | None = None) -> Report:
    """One step of `core`: its outputs, as `role` passes them on, and the refusals of requests
    that failed after it, added to `report` (a new one if None)."""
    report = Report() if report is None else report
    outputs, failed = role.after_step(core.step())
    report.outputs.extend(outputs)
    report.add_errors.extend(failed)
    return report


def reply_for(message: CoreInput, answers: list[Answer]) -> CoreOutput:
    """The front end's reply to `message` from the answers of the ranks that gave one (one
    answer: a single process, or PrepareDecode's target rank; several: every rank's, merged).
    """
    if isinstance(message, PrepareDecode):
        return answers[0]  # type: ignore[return-value]
    if isinstance(message, GetStats):
        return StatsReply(message.reply_id, engine_stats(answers))  # type: ignore[arg-type]
    if isinstance(message, GetExpertLoad):
        load = answers[0] if len(answers) == 1 else merge_expert_load(answers)  # type: ignore
        return ExpertLoadReply(message.reply_id, load)  # type: ignore[arg-type]
    if isinstance(message, GetModelInfo):
        info = answers[0] if len(answers) == 1 else merge_model_info(answers)  # type: ignore
        return ModelInfoReply(message.reply_id, info)  # type: ignore[arg-type]
    return answers[0] if len(answers) == 1 else merge_replies(answers)  # type: ignore


def merge_expert_load(per_rank: list[ExpertLoad]) -> ExpertLoad:
    """Routing counts of all ranks: each rank counted the routing of its own tokens, so the
    engine's counts are the sum; the summaries are recomputed on the sum."""

    def total(tables: list[list[list[int]]]) -> torch.Tensor:
        return torch.tensor(tables, dtype=torch.int64).sum(dim=0)

    counts = total([r.counts for r in per_rank])
    merged = msgspec.structs.replace(
        per_rank[0],
        counts=counts.tolist(),
        window_counts=total([r.window_counts for r in per_rank]).tolist(),
        imbalance_ratio=imbalance_ratio(counts).tolist(),
        balancedness=balancedness(counts).tolist(),
    )
    if all(r.rank_tokens is not None for r in per_rank):
        # each rank filled its own column (token-expert pairs its experts processed)
        rank_tokens = total([r.rank_tokens for r in per_rank])
        merged = msgspec.structs.replace(
            merged,
            rank_tokens=rank_tokens.tolist(),
            rank_imbalance_ratio=imbalance_ratio(rank_tokens).tolist(),
            rank_balancedness=balancedness(rank_tokens).tolist(),
        )
    return merged


def merge_model_info(per_rank: list[ModelInfo]) -> ModelInfo:
    """Rank 0's model info with every rank's experts and pid."""
    return msgspec.structs.replace(
        per_rank[0],
        experts_per_rank=[list(i.local_experts) for i in per_rank],
        rank_pids=[i.pid for i in per_rank],
    )
