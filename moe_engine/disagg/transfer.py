"""The KV transfer engine: Mooncake's `TransferEngine` over TCP (RDMA where a cluster has it).

One `KVTransfer` per instance registers the paged KV cache's tensors once at startup and
writes a request's blocks straight into a peer's registered cache (one-sided: the receiver's
CPU does not copy). Mooncake (kvcache-ai/Mooncake, `mooncake-transfer-engine-non-cuda` on
PyPI; needs Debian's libibverbs1 and libnuma1 even for TCP) is initialised peer to peer
("P2PHANDSHAKE": no metadata server): a peer is addressed as "host:rpc_port", and the receiver
refuses writes outside the buffers it registered.

Failures come back from Mooncake as -1 without an exception; `write` turns them into
`TransferError`. A peer that is alive but hung fails a write after `MC_TRANSFER_TIMEOUT`
seconds (set from `timeout_s`, at least 5; Mooncake reads it once per process).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

#: Transfer backends `--kv-transfer-backend` accepts (the protocol Mooncake runs).
BACKENDS = ("mooncake-tcp", "mooncake-rdma")


class TransferError(RuntimeError):
    """A transfer failed (peer gone, hung past the timeout, or an address it refused)."""


def mooncake_unavailable_reason() -> str | None:
    """None when `mooncake.engine` imports; else why not (the install line to fix it)."""
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return (f"Mooncake's transfer engine does not import ({exc}); install it with `pip "
                "install mooncake-transfer-engine-non-cuda` and Debian's `libibverbs1 "
                "librdmacm1 libnuma1`")
    return None


class KVTransfer:
    """This instance's end of the transfer engine.

    Args:
        tensors: the cache tensors peers may write into (`kv_layout.slot_tensors`), CPU
            (contiguous) or GPU memory; registered once, for the process's life.
        hostname: the address peers reach this instance at (not 0.0.0.0).
        backend: one of BACKENDS.
        timeout_s: how long a write to a hung peer may take before it fails (>= 5).

    Raises:
        RuntimeError: Mooncake is not installed, or it refused to start or to register.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], hostname: str = "127.0.0.1",
                 backend: str = "mooncake-tcp", timeout_s: float = 30.0) -> None:
        reason = mooncake_unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        if backend not in BACKENDS:
            raise ValueError(f"kv transfer backend must be one of {', '.join(BACKENDS)}, "
                             f"got {backend!r}")
        os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(max(5, round(timeout_s))))
        os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
        from mooncake.engine import TransferEngine

        self._engine = TransferEngine()
        protocol = backend.removeprefix("mooncake-")
        rc = self._engine.initialize(hostname, "P2PHANDSHAKE", protocol, "")
        if rc != 0:
            raise RuntimeError(f"Mooncake TransferEngine.initialize({hostname!r}, {protocol}) "
                               f"failed with {rc}")
        self.session = f"{hostname}:{self._engine.get_rpc_port()}"
        self._tensors = list(tensors)  # kept alive while registered
        addrs = [t.data_ptr() for t in self._tensors]
        sizes = [t.numel() * t.element_size() for t in self._tensors]
        rc = self._engine.batch_register_memory(addrs, sizes)
        if rc != 0:
            raise RuntimeError(f"Mooncake could not register the KV cache ({rc})")
        logger.info("KV transfer: %s over %s, %d tensors (%.1f MiB) registered", self.session,
                    protocol, len(addrs), sum(sizes) / 2**20)

    def write(self, peer: str, srcs: list[int], dsts: list[int], lengths: list[int]) -> float:
        """Write local [srcs[i], srcs[i] + lengths[i]) to the peer's dsts[i]; returns seconds.

        Raises:
            TransferError: the peer is unreachable, hung past the timeout, or refused an
                address; the destination may then hold part of the data.
        """
        if not srcs:
            return 0.0
        t0 = time.perf_counter()
        rc = self._engine.batch_transfer_sync_write(peer, srcs, dsts, lengths)
        if rc != 0:
            raise TransferError(f"KV transfer to {peer} failed ({rc}) after "
                                f"{time.perf_counter() - t0:.3f} s: {sum(lengths)} bytes in "
                                f"{len(srcs)} runs")
        return time.perf_counter() - t0
