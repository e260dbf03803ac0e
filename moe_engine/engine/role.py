"""An instance's part in a prefill/decode split, as the engine loop (`loop.apply`) calls it.

The engine defines the interface (`Role`) and the plain instance's role (`PlainRole`: no split,
and the split's message fields refused); disaggregation (`moe_engine.disagg.role`) implements
the prefill and decode roles. The engine never imports them: `role_for` resolves the factory
the disaggregation config names (`DisaggConfig.role_factory`, "module:attribute") at runtime.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

from moe_engine.core.outputs import EngineCoreOutput
from moe_engine.core.protocol import EngineCoreProtocol
from moe_engine.engine.messages import (
    AddError,
    EngineCoreRequest,
    PrepareDecode,
    PrepareDecodeReply,
)
from moe_engine.errors import ErrorCode, ParamError, RequestError
from moe_engine.startup.config import DisaggConfig


@runtime_checkable
class Role(Protocol):
    """What the engine loop calls on an instance's role, for each message and step.

    Attributes:
        mode: "none", "prefill" or "decode" (`DisaggConfig.mode`).
    """

    mode: str

    def add(self, message: EngineCoreRequest) -> tuple[list[EngineCoreOutput], AddError | None]:
        """Take a new request; (outputs it produced at once, the refusal or None)."""
        ...

    def prepare(self, message: PrepareDecode) -> PrepareDecodeReply:
        """Answer PrepareDecode (a placement, or the refusal)."""
        ...

    def after_step(self, outputs: list[EngineCoreOutput]
                   ) -> tuple[list[EngineCoreOutput], list[AddError]]:
        """A step's outputs: (those to send, refusals of requests that failed after it)."""
        ...

    def tick(self) -> None:
        """Once per loop iteration, after the step (if any)."""
        ...

    def forget(self, request_ids: list[str]) -> None:
        """Aborted requests: drop what the role holds for them."""
        ...


class BaseRole:
    """The defaults of a role: PrepareDecode refused, a step's outputs passed on as they are,
    nothing to do per iteration or on an abort. Subclasses define `mode` and `add`."""

    mode = "none"

    def add(self, message: EngineCoreRequest) -> tuple[list[EngineCoreOutput], AddError | None]:
        raise NotImplementedError

    def prepare(self, message: PrepareDecode) -> PrepareDecodeReply:
        """The refusal of an instance that is not a decode instance."""
        return PrepareDecodeReply(
            message.reply_id, b"", ErrorCode.INVALID_ARGUMENT, "disaggregation_mode",
            "disaggregation_mode: PrepareDecode needs an instance started with "
            "--disaggregation-mode decode")

    def after_step(self, outputs: list[EngineCoreOutput]
                   ) -> tuple[list[EngineCoreOutput], list[AddError]]:
        return outputs, []

    def tick(self) -> None:
        return None

    def forget(self, request_ids: list[str]) -> None:
        return None


class PlainRole(BaseRole):
    """A plain instance (no split): requests go to the core; the split's fields are refused.

    Args:
        core: the engine core (or a test double with its interface).
    """

    mode = "none"

    def __init__(self, core: EngineCoreProtocol) -> None:
        self.core = core

    def add(self, message: EngineCoreRequest) -> tuple[list[EngineCoreOutput], AddError | None]:
        if message.kv_placement is not None or message.remote_first_token is not None:
            return [], AddError(message.request_id, ErrorCode.INVALID_ARGUMENT,
                                "disaggregation_mode",
                                "disaggregation_mode: kv_placement / remote_first_token need an "
                                "instance started with --disaggregation-mode prefill or decode")
        return [], add_request(self.core, message)


def add_request(core: EngineCoreProtocol, msg: EngineCoreRequest) -> AddError | None:
    """Hand one EngineCoreRequest to `core`; None when it was queued, else the refusal."""
    try:
        core.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params,
                         msg.arrival_time)
    except RequestError as exc:
        return AddError(msg.request_id, exc.code, exc.field, exc.message)
    except ParamError as exc:
        return AddError(msg.request_id, ErrorCode.INVALID_ARGUMENT, exc.field, exc.message)
    except (ValueError, TypeError) as exc:
        return AddError(msg.request_id, ErrorCode.INVALID_ARGUMENT, "request", f"request: {exc}")
    return None


def import_attribute(spec: str, what: str = "factory") -> Any:
    """Import "module:attribute" and return the attribute (a class or a callable).

    Raises:
        ValueError: `spec` has no ":attribute" part (`what` names the setting).
        ImportError, AttributeError: no such module or attribute.
    """
    module_name, _, attr = spec.partition(":")
    if not attr:
        raise ValueError(f"{what} must look like 'module:attribute', got {spec!r}")
    return getattr(importlib.import_module(module_name), attr)


def role_for(core: EngineCoreProtocol, config: DisaggConfig) -> Role:
    """This instance's role: `PlainRole` for mode "none", else what the factory
    `config.role_factory` ("module:attribute", called as factory(core, config)) builds."""
    if config.mode == "none":
        return PlainRole(core)
    return import_attribute(config.role_factory, "role factory")(core, config)
