"""Persistent device buffers for one step's small input tensors (CUDA), filled in place.

The ModelRunner builds each step's ids, positions, slot mappings, block tables and attention
gather indices on the host, vectorised, as on a CPU. On a CUDA device `StepInputBuffers.put`
copies each into a buffer that persists between steps (a device tensor and its pinned host
staging twin, vLLM's `CpuGpuBuffer`): one asynchronous host-to-device copy per tensor per
step, no host sync, and fixed addresses for as long as a buffer is not outgrown (`reserve`
sizes one up front; what a CUDA-graph capture needs). On a CPU the runner uses the host
tensors as they are and makes no `StepInputBuffers` at all.

Pinned staging memory is rewritten every step, so `begin_step` first waits for the previous
step's copies (an event recorded after them; normally long finished, since the step's sampled
ids were read back since).
"""

from __future__ import annotations

import torch


class StepInputBuffers:
    """Named persistent (pinned host, device) buffer pairs.

    Args:
        device: the engine's device (CUDA; a CPU device only in tests, which exercise the
            staged path on a machine without a GPU: the runner itself never stages for a CPU).
        pin_memory: stage through pinned host memory; None: on CUDA.
    """

    def __init__(self, device: torch.device, pin_memory: bool | None = None) -> None:
        self.device = device
        self.pin_memory = device.type == "cuda" if pin_memory is None else pin_memory
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None

    def reserve(self, name: str, numel: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """Make (or keep, when large enough) buffer `name` of at least `numel` elements;
        returns the whole device buffer [capacity]."""
        buf = self._device.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype:
            capacity = max(numel, 2 * (buf.numel() if buf is not None else 0), 16)
            self._host[name] = torch.empty(capacity, dtype=dtype, pin_memory=self.pin_memory)
            self._device[name] = torch.empty(capacity, dtype=dtype, device=self.device)
        return self._device[name]

    def begin_step(self) -> None:
        """Wait until the previous step's copies have left the pinned buffers."""
        if self._copied is not None:
            self._copied.synchronize()

    def end_step(self) -> None:
        """Mark this step's copies (after the last `put`)."""
        if self.device.type != "cuda":
            return
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()

    def put(self, name: str, host: torch.Tensor) -> torch.Tensor:
        """Copy host tensor `host` into buffer `name` (staged through pinned memory, copied
        asynchronously); returns the device view with `host`'s shape and dtype."""
        n = host.numel()
        buf = self.reserve(name, n, host.dtype)
        pinned = self._host[name][:n]
        pinned.copy_(host.reshape(-1))
        view = buf[:n]
        view.copy_(pinned, non_blocking=True)
        return view.view(host.shape)

    def put_many(self, name: str, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Several int64 host tensors through one buffer and one copy; returns their device
        views, shapes as given."""
        flat = torch.cat([t.reshape(-1) for t in tensors]) if tensors else torch.empty(0)
        dev = self.put(name, flat.to(torch.int64))
        out, offset = [], 0
        for t in tensors:
            out.append(dev[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        return out
