"""Record the Triton launches the engine's launchers make, as the compile inputs a GPU would get.

`record_launches` replaces ``triton.runtime.jit.JITFunction.run`` (what ``kernel[grid](...)``
calls) for the duration of a ``with`` block. Each launch is bound and specialised by Triton's
own launcher code for the target backend (``create_function_from_signature`` with the CUDA
backend's ``specialize_impl``, then ``JITFunction._pack_args``), so the signature (``*bf16``,
``i32``, ``constexpr``), the constexpr values (ints equal to 1 become constexprs), the
``tt.divisibility`` 16 attributes of pointers and ints, and the options (``num_warps``,
``num_stages``) are exactly what a launch on that GPU compiles. Nothing is launched.

Tensors reach the launchers on the meta device (real shapes, strides and dtypes, no memory).
Pointer alignment is taken as a CUDA allocation's: the caching allocator hands out 512-byte
aligned blocks, so a tensor's address is ``512 * n + storage_offset * itemsize`` (views keep
their offset). The launch is then recorded as a `Launch`; `Launch.key` dedupes identical
compiles.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

_ALLOCATION_ALIGN = 512  # bytes: CUDA caching allocator blocks (c10/cuda/CUDACachingAllocator)


class _DevicePointer:
    """What Triton's specialisation reads from a tensor argument: its address and dtype."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.dtype = tensor.dtype
        self._address = _ALLOCATION_ALIGN * 1024 + tensor.storage_offset() * tensor.element_size()

    def data_ptr(self) -> int:
        return self._address


def _as_device(value: Any) -> Any:
    return _DevicePointer(value) if isinstance(value, torch.Tensor) else value


@dataclass
class Launch:
    """One recorded launch, ready for ``triton.compile(ASTSource(fn, signature, constexprs,
    attrs), target, options)``.

    Attributes:
        fn: the ``JITFunction``; kernel: its name.
        signature: parameter name -> Triton type string (``*bf16``, ``i32``, ``constexpr``).
        constexprs: ``{(index,): value}`` as ``_pack_args`` gives them.
        attrs: ``{(index,): [["tt.divisibility", 16]]}``.
        options: the backend's parsed options as a dict (num_warps, num_stages, ...).
        labels: what the driver that made the call says it was (family, op, dtype, ...).
    """

    fn: JITFunction
    kernel: str
    signature: dict[str, str]
    constexprs: dict[tuple[int, ...], Any]
    attrs: dict[tuple[int, ...], Any]
    options: dict[str, Any]
    labels: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Dedupe key: the kernel's source hash (``JITFunction.cache_key``, which covers the
        functions it calls) and everything a compile depends on."""
        text = repr((self.fn.cache_key, self.signature, sorted(self.constexprs.items()),
                     sorted(self.attrs.items()), sorted(self.options.items())))  # fmt: skip
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def constexpr_values(self) -> dict[str, Any]:
        """Constexpr parameters by name (launch-time ints equal to 1 included)."""
        names = list(self.signature)
        return {names[path[0]]: value for path, value in self.constexprs.items()}


@contextlib.contextmanager
def record_launches(target: GPUTarget, labels: dict[str, Any]) -> Iterator[list[Launch]]:
    """Within the block, ``kernel[grid](...)`` records a `Launch` (stamped with a copy of
    ``labels`` as it is at launch time: a driver may update it between calls) instead of
    compiling and running.

    Raises:
        RuntimeError: when Triton's interpreter is on (``TRITON_INTERPRET=1``): launchers then
            call the interpreter, not ``JITFunction.run``, and pick interpreter-only variants.
    """
    import triton

    if bool(triton.knobs.runtime.interpret):
        raise RuntimeError("unset TRITON_INTERPRET: the compile check records compiled launches")
    backend = make_backend(target)
    binders: dict[int, Any] = {}
    launches: list[Launch] = []
    original = JITFunction.run

    def run(self: JITFunction, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        binder = binders.get(id(self))
        if binder is None:
            binder = create_function_from_signature(self.signature, self.params, backend)
            binders[id(self)] = binder
        args = tuple(_as_device(a) for a in args)
        kwargs = {k: _as_device(v) for k, v in kwargs.items()}
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        launches.append(Launch(self, self.__name__, signature, constexprs, attrs,
                               dict(options.__dict__), dict(labels)))  # fmt: skip

    JITFunction.run = run
    try:
        yield launches
    finally:
        JITFunction.run = original
