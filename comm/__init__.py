"""Expert-parallel communicators: dispatch tokens to the ranks of their experts, combine back."""

from comm.base import Communicator, DispatchResult
from comm.noop import NoopCommunicator

__all__ = ["Communicator", "DispatchResult", "NoopCommunicator"]
