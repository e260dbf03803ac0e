"""Expert-parallel communicators: dispatch tokens to the ranks of their experts, combine back."""

from comm.base import Communicator, DispatchResult
from comm.deepep import DeepEPCommunicator, deepep_unavailable_reason
from comm.factory import make_communicator
from comm.noop import NoopCommunicator
from comm.placement import ExpertPlacement
from comm.stats import CommCounts, CommStats
from comm.torch_a2a import TorchAllToAll

__all__ = [
    "CommCounts",
    "CommStats",
    "Communicator",
    "DeepEPCommunicator",
    "DispatchResult",
    "ExpertPlacement",
    "NoopCommunicator",
    "TorchAllToAll",
    "deepep_unavailable_reason",
    "make_communicator",
]
