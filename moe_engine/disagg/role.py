"""A served instance's part in a prefill/decode split: what the engine core process does with
the disaggregation fields of its input messages. Both implement the engine's `Role` interface
(`engine/role.py`); the engine loop (`engine/loop.py`) calls them, and the engine finds
`make_role` through `DisaggConfig.role_factory`.

- `PrefillRole`: an `EngineCoreRequest` with `kv_placement` runs as a prefill
  (`handoff.PrefillHandoff`); when its step has sampled the first token, its blocks are written
  into the decode instance's cache and only then does its one (finished) output leave, so a
  caller that has it knows the K/V is there. A failed write is an UNAVAILABLE refusal
  (`AddError`, field "kv_transfer") instead, and the blocks are freed either way.
- `DecodeRole`: `PrepareDecode` parks a request with its prompt's blocks allocated and
  answers with their placement; an `EngineCoreRequest` with `remote_first_token` continues it.
  A parked request whose K/V has not arrived `timeout_s` after it was placed is dropped (its
  prefill died or its router went away), so no block is held for ever.
"""

from __future__ import annotations

import logging
import time

import msgspec

from moe_engine.core.engine_core import EngineCore
from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.disagg.arithmetic import transfer_table
from moe_engine.disagg.handoff import DecodeHandoff, KVPlacement, PrefillHandoff, kv_transfer_for
from moe_engine.disagg.transfer import TransferError
from moe_engine.engine.messages import (
    AddError,
    EngineCoreRequest,
    PrepareDecode,
    PrepareDecodeReply,
)
from moe_engine.engine.role import BaseRole
from moe_engine.errors import ErrorCode, RequestError
from moe_engine.startup.config import DisaggConfig

logger = logging.getLogger(__name__)


class PrefillRole(BaseRole):
    """The prefill instance's core-side handling (see the module docstring)."""

    mode = "prefill"

    def __init__(self, core: EngineCore, config: DisaggConfig):
        transfer, cache = kv_transfer_for(core, config.host, config.backend, config.timeout_s)
        self.handoff = PrefillHandoff(core, transfer, cache)
        self._placements: dict[str, KVPlacement] = {}

    def add(self, msg: EngineCoreRequest) -> tuple[list[EngineCoreOutput], AddError | None]:
        """Queue a prefill (or, without `kv_placement`, refuse: this instance only prefills);
        (no outputs, the refusal or None)."""
        return [], self._add(msg)

    def _add(self, msg: EngineCoreRequest) -> AddError | None:
        if msg.kv_placement is None:
            return AddError(msg.request_id, ErrorCode.INVALID_ARGUMENT, "kv_placement",
                            "kv_placement: this instance runs with --disaggregation-mode "
                            "prefill and takes only requests a router placed on a decode "
                            "instance")
        try:
            placement = msgspec.msgpack.decode(msg.kv_placement, type=KVPlacement)
            self.handoff.add(msg.request_id, msg.prompt_token_ids, msg.sampling_params)
        except msgspec.DecodeError as exc:
            return AddError(msg.request_id, ErrorCode.INVALID_ARGUMENT, "kv_placement",
                            f"kv_placement: not a placement from a decode instance ({exc})")
        except RequestError as exc:
            return AddError(msg.request_id, exc.code, exc.field, exc.message)
        self._placements[msg.request_id] = placement
        return None

    def after_step(self, outputs: list[EngineCoreOutput]
                   ) -> tuple[list[EngineCoreOutput], list[AddError]]:
        """Send the K/V of every prefill that finished this step; (outputs to pass on,
        refusals for the prefills whose transfer failed)."""
        passed, failed = [], []
        for out in outputs:
            placement = self._placements.get(out.request_id)
            if placement is None or not out.finished:
                passed.append(out)
                continue
            del self._placements[out.request_id]
            if out.request_id not in self.handoff.core.scheduler.held:  # aborted: no K/V
                passed.append(out)
                continue
            try:
                self.handoff.send(out.request_id, placement)
                passed.append(out)
            except (TransferError, ValueError) as exc:
                failed.append(AddError(out.request_id, ErrorCode.UNAVAILABLE, "kv_transfer",
                                       f"kv_transfer: {exc}"))
        return passed, failed

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests: drop their placements and any held blocks."""
        for rid in request_ids:
            self._placements.pop(rid, None)
            self.handoff.release(rid)


class DecodeRole(BaseRole):
    """The decode instance's core-side handling (see the module docstring)."""

    mode = "decode"

    def __init__(self, core: EngineCore, config: DisaggConfig):
        # kept: the transfer engine listens (and peers write) only while it lives
        self.transfer, cache = kv_transfer_for(core, config.host, config.backend,
                                               config.timeout_s)
        self.handoff = DecodeHandoff(core, cache)
        self.timeout_s = config.timeout_s
        self._parked_at: dict[str, float] = {}

    def prepare(self, msg: PrepareDecode) -> PrepareDecodeReply:
        """Park the request and answer with its placement (or the refusal)."""
        req = msg.request
        try:
            placement = self.handoff.park(req.request_id, req.prompt_token_ids,
                                          req.sampling_params)
        except RequestError as exc:
            return PrepareDecodeReply(msg.reply_id, b"", str(exc.code), exc.field, exc.message)
        self._parked_at[req.request_id] = time.monotonic()
        return PrepareDecodeReply(msg.reply_id, msgspec.msgpack.encode(placement))

    def add(self, msg: EngineCoreRequest) -> tuple[list[EngineCoreOutput], AddError | None]:
        """Continue a parked request from its first token (or refuse)."""
        if msg.remote_first_token is None:
            return [], AddError(msg.request_id, ErrorCode.INVALID_ARGUMENT,
                                "remote_first_token",
                                "remote_first_token: this instance runs with "
                                "--disaggregation-mode decode and continues only requests "
                                "PrepareDecode placed; send it through the router")
        self._parked_at.pop(msg.request_id, None)
        try:
            return self.handoff.arrived(msg.request_id, msg.remote_first_token,
                                        msg.remote_first_logprobs), None
        except KeyError:
            return [], AddError(msg.request_id, ErrorCode.UNAVAILABLE, "remote_first_token",
                                f"remote_first_token: request {msg.request_id!r} is not "
                                "waiting for its K/V here (never placed, aborted, or dropped "
                                f"after {self.timeout_s:g} s)")

    def tick(self) -> None:
        """Once per loop iteration: drop parked requests whose K/V is late (`expire`)."""
        self.expire()

    def expire(self) -> None:
        """Drop parked requests whose K/V has not come within timeout_s."""
        now = time.monotonic()
        late = [rid for rid, t in self._parked_at.items() if now - t > self.timeout_s]
        for rid in late:
            del self._parked_at[rid]
            logger.warning("disaggregation: request %s dropped, its K/V did not arrive within "
                           "%g s", rid, self.timeout_s)
            self.handoff.abort(rid)

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self._parked_at.pop(rid, None)


def make_role(core: EngineCore, config: DisaggConfig) -> PrefillRole | DecodeRole | None:
    """The role `config.mode` asks for (None for "none"); logs the transfer arithmetic."""
    if config.mode == "none":
        return None
    role = PrefillRole(core, config) if config.mode == "prefill" else DecodeRole(core, config)
    logger.info("disaggregation: %s instance, %s", config.mode, transfer_line(core))
    return role


def transfer_line(core: EngineCore, prompt_len: int = 1024) -> str:
    """The startup plan's line: KV bytes per prompt token and what a `prompt_len`-token
    prompt moves, at each default link rate (`disagg.arithmetic`; `moe-disagg plan` for
    more)."""
    specs = [g.spec for g in core.runner.kv_groups]
    (row,) = transfer_table(specs, [prompt_len])
    links = " / ".join(f"{s * 1e3:.2f}" for s in row.link_s.values())
    rates = " / ".join(f"{g:g}" for g in row.link_s)
    return (f"{sum(s.bytes_per_token for s in specs)} B of KV per prompt token; a "
            f"{prompt_len}-token prompt moves {row.num_bytes / 2**20:.2f} MiB: {links} ms at "
            f"{rates} Gb/s (line rate; moe-disagg plan --model ... for other lengths)")
