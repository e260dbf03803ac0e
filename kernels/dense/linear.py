"""`LinearKernel`: what runs a dense projection, chosen once by the registry
(`KernelPlan.linear`), with the per-batch fallbacks it may take declared beside it.

On native-cpu a float32/bfloat16 layer runs batches of up to `NATIVE_MAX_ROWS` rows
(`NARROW_MAX_ROWS` for layers of fewer than `NATIVE_MIN_OUT_FEATURES` outputs, a router)
through a packed copy of its weight (kernels/dense/native_linear.py; bfloat16 when exact: half
the bytes a decode step reads); larger batches run torch's GEMM. Where the CPU has AMX-BF16 or
AVX512-BF16 (`amx.amx_unavailable_reason`), a bfloat16 layer's batches of
`amx.LINEAR_MIN_ROWS` to `amx.LINEAR_MAX_ROWS` rows run the bf16 kernel instead (`AmxLinear`),
and larger ones torch's GEMM (oneDNN's AMX kernel, as fast there). A 4-bit layer
(`--quantized-layers all`: int4 group-wise or MXFP4 codes, kernels/dense/native_linear_q4.py)
runs every batch of up to `NATIVE_MAX_ROWS` rows on the 4-bit kernel and larger ones (and every
batch on another backend) torch's GEMM over the dequantized values, so the layer computes with
the same weights whatever the batch. The measurements behind the thresholds are in
bench/NOTES.md ("AMX bf16 kernels", `python bench/cpu_kernels.py --only linear`).

The kernel holds the packed copies, made on first use from the weight the layer passes and
dropped by `reset` (after the weight changes in place), never the weight itself: the layer
owns its parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.dense import amx
from kernels.dense.amx import AmxLinear
from kernels.dense.native_linear import PackedLinear
from kernels.dense.native_linear_q4 import PackedQuantLinear

#: Rows above which torch's GEMM is as fast as the native kernel (bench/NOTES.md).
NATIVE_MAX_ROWS = 1024
#: Narrower layers (a router of 32 experts) are too small to split over threads: the native
#: kernel runs them on the calling thread (csrc/linear_cpu.cpp kMinParallelBytes), 3x faster
#: than torch's bfloat16 GEMM at 1-8 rows ([1, 512] x [512, 32]: 5.4 vs 17 us on one core,
#: `python bench/cpu_kernels.py --only linear`), and slower beyond.
NATIVE_MIN_OUT_FEATURES = 64
#: Rows up to which a narrow layer runs the native kernel.
NARROW_MAX_ROWS = 8

#: (method, group size, scale dtype) of a layer's 4-bit weights, or None for float weights.
QuantScheme = tuple[str, int, torch.dtype]



def native_fallbacks() -> tuple[str, ...]:
    """The routes a native-cpu linear takes per batch besides its packed kernel, as the
    startup plan prints them (with this process's bf16 kernel: `amx.bf16_backend`)."""
    bf16 = amx.bf16_backend()
    bf16_route = (
        f"bfloat16 layers: the bf16 kernel on {bf16} at {amx.LINEAR_MIN_ROWS}-"
        f"{amx.LINEAR_MAX_ROWS} rows, torch above"
        if bf16 is not None
        else f"bfloat16 layers: the packed kernel as float32 ones (no bf16 kernel here: "
        f"{amx.amx_unavailable_reason()})"
    )
    return (
        f"batches over {NATIVE_MAX_ROWS} rows ({NARROW_MAX_ROWS} for layers of fewer than "
        f"{NATIVE_MIN_OUT_FEATURES} outputs) and float16 layers: torch",
        bf16_route,
        f"4-bit layers (--quantized-layers all): the 4-bit kernel up to {NATIVE_MAX_ROWS} "
        f"rows (1-8 bfloat16 rows on the bf16 kernel where there is one), torch over the "
        f"dequantized weights above",
    )


class LinearKernel:
    """x [..., in] -> x @ weight.T + bias [..., out] for one layer, by the route chosen once.

    Args:
        native_max_rows: batches of up to this many rows run the native packed kernel
            (0: never).
        amx: bfloat16 batches run the bf16 kernel (`amx.amx_fits`).
        q4: a 4-bit layer runs the native 4-bit kernel up to `NATIVE_MAX_ROWS` rows.
        quant_scheme: the layer's 4-bit weights (`QuantScheme`), None for float weights.
    """

    def __init__(
        self, native_max_rows: int, amx: bool, q4: bool, quant_scheme: QuantScheme | None
    ) -> None:
        self.native_max_rows, self.amx, self.q4 = native_max_rows, amx, q4
        self.quant_scheme = quant_scheme
        self.reset()

    @classmethod
    def torch(cls, quant_scheme: QuantScheme | None = None) -> LinearKernel:
        """torch's GEMM for every batch (over the dequantized weights when 4-bit)."""
        return cls(0, False, False, quant_scheme)

    @classmethod
    def native(cls, weight: torch.Tensor, quant_scheme: QuantScheme | None) -> LinearKernel:
        """The native-cpu routes that fit `weight` [out, in] (module docstring)."""
        fits = weight.dtype in (torch.float32, torch.bfloat16)
        wide = weight.shape[0] >= NATIVE_MIN_OUT_FEATURES
        max_rows = (NATIVE_MAX_ROWS if wide else NARROW_MAX_ROWS) if fits else 0
        return cls(max_rows, amx.amx_fits(weight) and quant_scheme is None,
                   quant_scheme is not None, quant_scheme)

    def reset(self) -> None:
        """Forget the packed copies (call after changing the weight in place)."""
        self.packed: PackedLinear | None = None
        self._amx_packed: AmxLinear | None = None
        self._q4_packed: PackedQuantLinear | None = None
        self._q4_dense: torch.Tensor | None = None

    @property
    def amx_copy(self) -> AmxLinear | None:
        """The bf16 kernel's packed copy, once a batch has made it (else None)."""
        return self._amx_packed

    def q4_packed(self, weight: torch.Tensor, bias: torch.Tensor | None) -> PackedQuantLinear:
        """The 4-bit weights, made on first use and kept until `reset`.

        Raises:
            ValueError: not a 4-bit layer; an unknown method or a group size that does not
                divide in_features (`PackedQuantLinear.quantize`).
        """
        if self._q4_packed is None:
            if self.quant_scheme is None:
                raise ValueError("q4_packed: the layer is not quantized (Linear.quantize)")
            method, group, scale_dtype = self.quant_scheme
            self._q4_packed = PackedQuantLinear.quantize(weight, bias, method, group,
                                                         scale_dtype)
        return self._q4_packed

    def prepack(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Make now the copy the layer's decode batches will read (the 4-bit weights, the bf16
        kernel's tiles, or the packed kernel's), so that it is made while loading, with the
        other weights' temporaries, and not at the first forward beside the KV cache and the
        activations (`moe_engine.startup.host_memory`). Nothing for torch layers."""
        if self.quant_scheme is not None:
            self.q4_packed(weight, bias)
        elif self.amx:
            self.amx_packed(weight, bias)
        elif self.native_max_rows and self.packed is None:
            self.packed = PackedLinear.pack(weight, bias)

    def amx_packed(self, weight: torch.Tensor, bias: torch.Tensor | None) -> AmxLinear:
        """The weight (and bias) packed for the bf16 kernel, made on first use."""
        if self._amx_packed is None:
            self._amx_packed = AmxLinear.pack(weight, bias)
        return self._amx_packed

    def quantized_copy_bytes(self, weight: torch.Tensor, bias: torch.Tensor | None) -> int:
        """Bytes of the 4-bit copies beside the weight: codes and scales, and the dequantized
        weight kept off the CPU once a batch beyond the 4-bit kernel has made it; 0 for a float
        layer."""
        if self.quant_scheme is None:
            return 0
        size = self.q4_packed(weight, bias).nbytes
        if self._q4_dense is not None:
            size += self._q4_dense.numel() * self._q4_dense.element_size()
        return size

    def __call__(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """x: [..., in] -> [..., out] in x's dtype."""
        rows = x.numel() // max(1, x.shape[-1])
        if self.quant_scheme is not None:
            if self.q4 and rows <= NATIVE_MAX_ROWS:
                return self.q4_packed(weight, bias)(x)
            if self._q4_dense is not None:
                return nn.functional.linear(x, self._q4_dense, bias)
            dense = self.q4_packed(weight, bias).dequantized.to(weight.device, x.dtype)
            if weight.device.type != "cpu":  # a device: every batch comes here, keep it
                self._q4_dense = dense
            # on a CPU only batches over the 4-bit kernel's rows do (prefill chunks): the
            # dequantized copy lives for this call, not beside the 4-bit one and the weight
            # (a third copy the startup plan does not hold room for)
            return nn.functional.linear(x, dense, bias)
        if rows > NATIVE_MAX_ROWS:
            return nn.functional.linear(x, weight, bias)
        if self.amx and x.dtype == torch.bfloat16 and rows >= amx.LINEAR_MIN_ROWS:
            if rows > amx.LINEAR_MAX_ROWS:  # oneDNN's AMX GEMM is as fast from here
                return nn.functional.linear(x, weight, bias)
            return self.amx_packed(weight, bias)(x)
        if rows <= self.native_max_rows:
            if self.packed is None:
                self.packed = PackedLinear.pack(weight, bias)
            return self.packed(x)
        return nn.functional.linear(x, weight, bias)
