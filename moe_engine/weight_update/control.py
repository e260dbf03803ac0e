"""RL rollout control of one rank: pause and resume generation, new weights without a restart.

Semantics (SGLang's `pause_generation` / `update_weights_from_*`, vLLM's RLHF examples):
- `pause(mode)`: the rank stops stepping. "abort" ends every live request with finish_reason
  "abort"; "keep" leaves them as they are (their KV cache stays; after the resume they decode
  on whatever weights serve then, attending to K/V the old weights computed); "retract" sends
  the running ones back to the queue with their KV freed (a preemption: after the resume they
  are recomputed, prompt and tokens so far, on the weights serving then, so every later token
  is exactly what the new weights give for that prefix). New requests are accepted meanwhile
  and wait.
- `update_weights`: every tensor is checked (name, dtype, shape) before any is read, received
  into a staged copy, and swapped in only when all arrived (`staging.StagedWeights`); a
  refused or failed update changes nothing. The prefix cache is flushed (its blocks hold the
  old weights' K/V; `KVCacheManager.new_weights`) and `weight_version` changes; every output
  after it carries the new version. Updating without a pause is allowed: the update runs
  between two steps.
- Labels: each completion lists the versions that sampled its output tokens with the index
  each begins at (`Request.weight_versions`), and `kv_from_other_weights` says when a step
  ran it on other weights than K/V it read ("keep", no pause, or `--keep-prefix-cache` hits;
  never after "retract", whose recompute reads only the new weights' K/V).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import torch

from moe_engine.errors import ErrorCode
from moe_engine.weight_update.buckets import (
    Bucket,
    bucket_layout,
    default_bucket_bytes,
    unpack,
)
from moe_engine.weight_update.disk import DiskUpdate
from moe_engine.weight_update.group import WeightGroup
from moe_engine.weight_update.messages import (
    PAUSE_MODES,
    WEIGHT_SOURCES,
    ControlInput,
    ControlReply,
    DestroyWeightUpdateGroup,
    InitWeightUpdateGroup,
    PauseGeneration,
    ResumeGeneration,
    UpdateWeights,
    weight_version_problem,
)
from moe_engine.weight_update.staging import StagedWeights
from moe_engine.weight_update.targets import Skip, Target, WeightUpdateError, resolve_targets

logger = logging.getLogger(__name__)

#: `agree(ok)` -> whether every rank staged its part (expert parallelism; one rank: ok).
Agree = Callable[[bool], bool]


class TransferError(WeightUpdateError):
    """The trainer or the group failed mid-transfer (UNAVAILABLE); nothing changed."""


class RolloutControl:
    """Pause state, weight version and weight-update groups of one rank's `EngineCore`.

    Args:
        core: the EngineCore (its model, kernels, dtypes, scheduler, KV cache, abort).
        weight_version: the version serving at startup (`--weight-version`).
    """

    def __init__(self, core, weight_version: str) -> None:
        self.core = core
        self.weight_version = weight_version
        self.paused = False
        self.groups: dict[str, WeightGroup] = {}
        self.ep_rank = core.rank_context.rank if core.rank_context is not None else 0
        #: Commit by copying into the serving tensors (a GPU model: `StagedWeights.commit`)
        #: rather than swapping the staged host tensors in (a CPU model).
        self.in_place = core.device.type != "cpu"
        field = type(core.model).mtp_layers_field
        #: MTP layers config.json declares (their tensors are skipped when not run).
        self.checkpoint_mtp_layers = int(core.config.model.hf_config().get(field) or 0) if (
            field) else 0

    def handle(self, msg: ControlInput, agree: Agree | None = None
               ) -> tuple[ControlReply, list]:
        """Act on one control message; (its reply, outputs of requests it ended)."""
        match msg:
            case PauseGeneration():
                return self.pause(msg)
            case ResumeGeneration():
                return self.resume(msg), []
            case InitWeightUpdateGroup():
                return self.init_group(msg), []
            case DestroyWeightUpdateGroup():
                return self.destroy_group(msg), []
            case UpdateWeights():
                return self.update(msg, agree), []
        raise TypeError(f"not a control message: {type(msg).__name__}")

    def reply(self, reply_id: int, **fields) -> ControlReply:
        return ControlReply(reply_id, weight_version=self.weight_version, paused=self.paused,
                            **fields)

    # ------------------------------------------------------------------ pause and resume

    def pause(self, msg: PauseGeneration) -> tuple[ControlReply, list]:
        """Stop stepping; (the reply, the outputs of the requests it aborted)."""
        if msg.mode not in PAUSE_MODES:
            return self.reply(msg.reply_id, code=ErrorCode.INVALID_ARGUMENT, field="mode",
                              message=f"mode: {msg.mode!r} is not one of "
                                      f"{', '.join(PAUSE_MODES)}"), []
        core = self.core
        sched = core.scheduler
        outputs, counts = [], {}
        if msg.mode == "abort":
            ids = list(dict.fromkeys(r.external_id for r in sched.requests.values()))
            outputs = core.abort_requests(ids)
            counts["num_aborted"] = len(outputs)
        elif msg.mode == "retract":
            counts["num_retracted"] = sched.retract_running()
            counts["num_kept"] = len(sched.waiting) - counts["num_retracted"]
        else:
            counts["num_kept"] = sched.num_unfinished
        self.paused = True
        logger.info("generation paused (%s): %s", msg.mode,
                    ", ".join(f"{k.removeprefix('num_')} {v}" for k, v in counts.items()))
        return self.reply(msg.reply_id, **counts), outputs

    def resume(self, msg: ResumeGeneration) -> ControlReply:
        if self.paused:
            logger.info("generation resumed (weight version %s)", self.weight_version)
        self.paused = False
        return self.reply(msg.reply_id)

    # ------------------------------------------------------------------ groups

    def init_group(self, msg: InitWeightUpdateGroup) -> ControlReply:
        """Join the trainer's group (blocks until every member joined, up to timeout_s)."""
        if msg.backend == "nccl" and self.core.device.type != "cuda":
            return self.reply(msg.reply_id, code=ErrorCode.INVALID_ARGUMENT, field="backend",
                              message=f"backend: nccl needs an engine on a GPU; this one runs "
                                      f"on {self.core.device.type}: use gloo")
        stale = self.groups.pop(msg.group_name, None)
        if stale is not None:  # a trainer that restarted without leaving: its group is dead
            stale.close()
            logger.warning("weight-update group %r joined again: the previous one is left",
                           msg.group_name)
        device = self.core.device if msg.backend == "nccl" else torch.device("cpu")
        try:
            group = WeightGroup(
                msg.master_address, msg.master_port, msg.rank_offset + self.ep_rank,
                msg.world_size, msg.backend, msg.group_name, msg.timeout_s, device,
            )
        except ValueError as exc:
            return self.reply(msg.reply_id, code=ErrorCode.INVALID_ARGUMENT, field="group",
                              message=f"weight-update group: {exc}")
        except Exception as exc:  # noqa: BLE001 - the store or a peer did not answer
            return self.reply(msg.reply_id, code=ErrorCode.UNAVAILABLE, field="group",
                              message=f"weight-update group {msg.group_name!r} at "
                                      f"{msg.master_address}:{msg.master_port}: {exc}")
        self.groups[msg.group_name] = group
        logger.info("joined weight-update group %r as rank %d of %d (%s)", msg.group_name,
                    group.rank, group.world_size, msg.backend)
        return self.reply(msg.reply_id)

    def destroy_group(self, msg: DestroyWeightUpdateGroup) -> ControlReply:
        group = self.groups.pop(msg.group_name, None)
        if group is not None:
            group.close()
            logger.info("left weight-update group %r", msg.group_name)
        return self.reply(msg.reply_id)

    # ------------------------------------------------------------------ updates

    def update(self, msg: UpdateWeights, agree: Agree | None = None) -> ControlReply:
        """Stage, agree (every rank staged), commit, flush; the reply says what happened."""
        start = time.perf_counter()
        try:
            staged, num_tensors = self._stage(msg)
            staged.prepare()
        except Exception as exc:  # noqa: BLE001 - nothing changed yet: refuse, keep serving
            if agree is not None:
                agree(False)
            return self._refusal(msg, _as_update_error(exc))
        if agree is not None and not agree(True):
            return self.reply(msg.reply_id, code=ErrorCode.INVALID_ARGUMENT, field="ranks",
                              message="update refused by another rank; nothing changed")
        try:
            staged.commit(self.core.kernels, in_place=self.in_place)
        except Exception as exc:
            if self.in_place:  # a device error part-way through the copies: not recoverable
                raise
            return self._refusal(msg, _as_update_error(exc))  # swapped back
        self.core.recapture_graphs()
        dropped = self.core.kv.new_weights(flush=msg.flush_cache)
        old, self.weight_version = self.weight_version, msg.weight_version
        seconds = time.perf_counter() - start
        logger.info(
            "weights updated from %s: version %s -> %s, %d tensors, %.1f MiB on this rank in "
            "%.2f s (%.2f GB/s); prefix cache %s", msg.source, old, msg.weight_version,
            num_tensors, staged.num_bytes / 2**20, seconds, staged.num_bytes / seconds / 1e9,
            f"flushed ({dropped} blocks)" if msg.flush_cache else "kept",
        )
        return self.reply(msg.reply_id, num_tensors=num_tensors, num_bytes=staged.num_bytes,
                          seconds=seconds)

    def _refusal(self, msg: UpdateWeights, exc: WeightUpdateError) -> ControlReply:
        code = ErrorCode.UNAVAILABLE if isinstance(exc, TransferError) else (
            ErrorCode.INVALID_ARGUMENT)
        logger.warning("weight update to version %s refused: %s (version %s keeps serving)",
                       msg.weight_version, exc.message, self.weight_version)
        return self.reply(msg.reply_id, code=code, field=exc.field,
                          message=f"{exc.message}; nothing changed, weight version "
                                  f"{self.weight_version} keeps serving")

    def _stage(self, msg: UpdateWeights) -> tuple[StagedWeights, int]:
        """Every tensor of the update, checked and staged; (staged, tensors named).

        Raises:
            WeightUpdateError: a refusal before any transfer; TransferError: a transfer that
                failed part-way (the group is left: the trainer must make a new one).
        """
        if msg.source not in WEIGHT_SOURCES:
            raise WeightUpdateError("source", f"source: {msg.source!r} is not one of "
                                              f"{', '.join(WEIGHT_SOURCES)}")
        core = self.core
        staged = StagedWeights(core.model, core.weight_dtype, core.dtype)
        if msg.source == "disk":
            _check_version(msg)
            disk = DiskUpdate(msg.path, core.architecture)
            targets = resolve_targets(core.model, disk.metas, self.checkpoint_mtp_layers)
            index = {m.name: i for i, m in enumerate(disk.metas)}
            wanted = {m.name for m, t in zip(disk.metas, targets, strict=True)
                      if not isinstance(t, Skip)}
            for name, tensor in disk.tensors(wanted):
                _check_finite(name, tensor)
                staged.add(targets[index[name]], tensor)
            return staged, len(disk.metas)
        group, targets, layout = self._handshake(msg)
        bad: WeightUpdateError | None = None
        for i, tensor in self._receive(msg, group, layout):  # every bucket, even after a bad one
            try:
                _check_finite(msg.tensors[i].name, tensor)
            except WeightUpdateError as exc:
                bad = bad or exc
            if bad is None:
                staged.add(targets[i], tensor, owned=True)  # views into our own buckets
        if bad is not None:
            raise bad
        return staged, len(msg.tensors)

    def _handshake(self, msg: UpdateWeights) -> tuple[WeightGroup, list[Target], list[Bucket]]:
        """Check the trainer's list and tell the group whether this rank takes it (every
        member answers, so a refusal sends nothing); (the group, the targets, the buckets).

        Raises:
            WeightUpdateError: no such group, a refused list, or another member refused.
        """
        group = self.groups.get(msg.group_name)
        if group is None:
            raise WeightUpdateError("group_name", f"group_name: no weight-update group "
                                                  f"{msg.group_name!r} is joined "
                                                  f"(InitWeightUpdateGroup first)")
        try:
            _check_version(msg)
            targets = resolve_targets(self.core.model, msg.tensors, self.checkpoint_mtp_layers)
            layout = bucket_layout(msg.tensors,
                                   msg.bucket_bytes or default_bucket_bytes(group.backend))
        except (WeightUpdateError, ValueError) as exc:
            self._transfer(msg, group, lambda: group.agree(True))
            if isinstance(exc, WeightUpdateError):
                raise
            raise WeightUpdateError("tensors", f"tensors: {exc}") from None
        if not self._transfer(msg, group, lambda: group.agree(False)):
            raise WeightUpdateError("tensors", "another member of the group refused the update")
        return group, targets, layout

    def _receive(self, msg: UpdateWeights, group: WeightGroup, layout: list[Bucket]
                 ) -> Iterator[tuple[int, torch.Tensor]]:
        """Each bucket the trainer broadcasts, unpacked: (index in the update, tensor)."""
        for k, bucket in enumerate(layout):
            buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=group.device)
            self._transfer(msg, group, lambda b=buf: group.broadcast(b),
                           f" after {k} of {len(layout)} buckets")
            yield from unpack(bucket, buf, msg.tensors)

    def _transfer(self, msg: UpdateWeights, group: WeightGroup, call, where: str = ""):
        """`call()`; a failure leaves the group (it is unusable) and raises TransferError."""
        try:
            return call()
        except Exception as exc:  # noqa: BLE001 - gloo/NCCL report a lost peer as RuntimeError
            self.groups.pop(msg.group_name, None)
            group.close()
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise TransferError(
                "group", f"weight transfer over group {msg.group_name!r} failed{where}: "
                f"{first[:300]} (the group is left; InitWeightUpdateGroup again)",
            ) from None



def _as_update_error(exc: Exception) -> WeightUpdateError:
    """`exc` as the refusal the reply carries (an unexpected error is logged in full)."""
    if isinstance(exc, WeightUpdateError):
        return exc
    logger.error("weight update failed", exc_info=exc)
    return WeightUpdateError("update", f"update failed: {type(exc).__name__}: {exc}")


def _check_finite(name: str, tensor: torch.Tensor) -> None:
    """Refuse a floating tensor holding Inf or NaN (a diverged trainer step) by name."""
    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
        raise WeightUpdateError(name, f"tensor {name!r} holds Inf or NaN values")


def _check_version(msg: UpdateWeights) -> None:
    problem = weight_version_problem(msg.weight_version)
    if problem is not None:
        raise WeightUpdateError("weight_version", problem)
