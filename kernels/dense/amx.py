"""bfloat16 kernels on Intel AMX (csrc/amx_gemm.cpp, csrc/amx_moe.cpp, csrc/amx_attention.cpp),
or on AVX512-BF16 where the CPU has that but no AMX (csrc/bf16_dot.cpp).

On a CPU with native bfloat16 (AMX-BF16, AVX512-BF16) the engine computes a bfloat16
checkpoint in bfloat16 (`moe_engine.startup.env.compute_dtype`), and the float32 kernels
(bfloat16
widened to float32, FMA) fall 5-30x behind oneDNN's AMX GEMMs from 16 rows up (a [768 x 512]
bf16 weight times 64 rows, one thread: 1208 us native against 87 us for torch). These kernels
multiply bfloat16 pairs with TDPBF16PS on AMX tiles, or with VDPBF16PS on zmm registers where
the CPU has no AMX (AMD Zen 4 and 5, Intel Cooper Lake: twice the products per instruction of
a float32 FMA), float32 sums and one round-to-nearest-even at the end (c10::BFloat16's
rounding), over weights packed once, at bind time, into the VNNI pair layout both
instructions read (`pack_vnni`). Both backends compute the same products and float32 sums;
only the order of the sums differs.

Which backend runs is decided once per process, in `bf16_backend` (CPU features, the OS,
Linux's tile-data permission, `MOE_ENGINE_AMX`; logged once): "amx" where the tiles run, else
"avx512-bf16" where VDPBF16PS does, else none. The layers then use them for batches within
the crossovers measured in bench/NOTES.md ("AMX bf16 kernels"): `LINEAR_MIN_ROWS` to
`LINEAR_MAX_ROWS` rows for a dense linear (torch's GEMM above), and every batch for the fused
MoE (kernels/moe/amx.py). Decode attention's scores use the tiles only
(`uses_tiles`).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.nn.functional as F

from kernels.env import amx_setting
from kernels.moe.tiles import repack_library, value_expert_tiles
from kernels.native.library import NativeUnavailable, check_status, load_native

logger = logging.getLogger(__name__)

#: Output columns per packed tile; K values per tile step (csrc/amx_gemm.h kCols, kDepth).
COLS, DEPTH = 16, 32
#: Rows from which `AmxLinear` beats the AVX2 linear, and above which torch's bf16 GEMM (oneDNN,
#: AMX too) is as fast or faster (bench/NOTES.md, "AMX bf16 kernels").
LINEAR_MIN_ROWS, LINEAR_MAX_ROWS = 1, 256
#: The backends (`bf16_backend`).
TILES, DOT = "amx", "avx512-bf16"

_REASONS = {1: "the CPU lacks AMX-TILE/AMX-BF16",
            3: "the OS does not enable the AMX tile state (XCR0)",
            4: "Linux refused the AMX tile-data permission (arch_prctl ARCH_REQ_XCOMP_PERM)"}
_lock = threading.Lock()
_decided: list[tuple[str | None, str | None]] = []


def bf16_backend() -> str | None:
    """`TILES`, `DOT` or None (why not: `amx_unavailable_reason`); decided (and logged) once."""
    return _decision()[0]


def amx_unavailable_reason() -> str | None:
    """None when this process runs the bfloat16 kernels of this module (on either backend),
    else why not; decided (and logged) once.

    Off when `MOE_ENGINE_AMX=0` (`kernels.env.amx_setting`), when the native library
    does not load, or when neither `moe_amx_available` (csrc/amx_detect.cpp: that check also
    asks Linux for the tile-data state, once per process) nor `moe_bf16_dot_available`
    (csrc/bf16_dot.cpp) says the CPU and OS can. `MOE_ENGINE_AMX=avx512-bf16` never uses the
    tiles.
    """
    return _decision()[1]


def uses_tiles() -> bool:
    """Whether this process's bfloat16 kernels run on AMX tiles (`bf16_backend` is `TILES`)."""
    return bf16_backend() == TILES


def _decision() -> tuple[str | None, str | None]:
    if _decided:
        return _decided[0]
    with _lock:
        if not _decided:
            _decided.append(_decide())
            backend, reason = _decided[0]
            if backend == TILES:
                logger.info("AMX bf16 kernels on: linear at %d-%d rows, fused MoE at every "
                            "batch size, decode attention's scores (bf16 KV cache, blocks of "
                            "a multiple of 16); 4-bit linears at 1-8 rows and 4-bit experts "
                            "on VDPBF16PS",
                            LINEAR_MIN_ROWS, LINEAR_MAX_ROWS)
            elif backend == DOT:
                logger.info("bf16 kernels on AVX512-BF16 (VDPBF16PS; %s): linear at %d-%d "
                            "rows, fused MoE at every batch size, 4-bit linears at 1-8 rows and "
                            "4-bit experts",
                            reason_no_tiles(), LINEAR_MIN_ROWS, LINEAR_MAX_ROWS)
            else:
                logger.info("AMX bf16 kernels off: %s", reason)
    return _decided[0]


def reason_no_tiles() -> str:
    """Why the tiles do not run here ("" where they do)."""
    if amx_setting() == DOT:
        return f"MOE_ENGINE_AMX={DOT}"
    try:
        status = load_native("linear_cpu").moe_amx_available()
    except NativeUnavailable as exc:
        return f"the native library is unavailable: {exc}"
    return "" if status == 0 else _REASONS.get(status, f"moe_amx_available: {status}")


def dot_available() -> bool:
    """Whether this CPU and OS run the AVX512-BF16 backend (whatever `MOE_ENGINE_AMX` says)."""
    try:
        return load_native("linear_cpu").moe_bf16_dot_available() == 0
    except NativeUnavailable:
        return False


def _decide() -> tuple[str | None, str | None]:
    setting = amx_setting()
    if setting == "0":
        return None, "disabled by MOE_ENGINE_AMX=0"
    try:
        load_native("linear_cpu")
    except NativeUnavailable as exc:
        return None, f"the native library is unavailable: {exc}"
    no_tiles = reason_no_tiles()
    if not no_tiles:
        return TILES, None
    if dot_available():
        return DOT, None
    return None, f"{no_tiles}, and it lacks AVX512-BF16"


def require_amx() -> None:
    """Make sure this process may run the bfloat16 kernels (the first call asks Linux for the
    tile-data state; a tile instruction without it kills the process with SIGILL).

    Raises:
        RuntimeError: they cannot run here (the reason inside).
    """
    reason = amx_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"the AMX kernels cannot run here: {reason}")


def tiles_flag(tiles: bool | None) -> int:
    """The kernels' `tiles` argument: this process's backend (None), or the one asked for.

    Raises:
        RuntimeError: the backend asked for cannot run here.
    """
    if tiles is None:
        require_amx()
        return int(uses_tiles())
    if tiles and reason_no_tiles():
        raise RuntimeError(f"the AMX tiles cannot run here: {reason_no_tiles()}")
    if not tiles and not dot_available():
        raise RuntimeError("the AVX512-BF16 kernels cannot run here: the CPU lacks it")
    return int(tiles)


def amx_fits(weight: torch.Tensor) -> bool:
    """Whether a weight [..., N, K] can run on these kernels here: bfloat16, K % 32 == 0
    (the models' dimensions are), and a backend available."""
    return (weight.dtype == torch.bfloat16 and weight.shape[-1] % DEPTH == 0
            and weight.device.type == "cpu" and amx_unavailable_reason() is None)


def pack_vnni(w: torch.Tensor, *, native: bool | None = None) -> torch.Tensor:
    """[E, N, K] bfloat16 -> [E, ceil(N/16), ceil(K/32) * 16, 16, 2]: per 16-column tile, K in
    pairs, row p holding (w[n, 2p], w[n, 2p + 1]) for the tile's 16 columns n (the B operand
    of TDPBF16PS, Intel SDM vol. 2). N is zero-padded to a multiple of 16, K to one of 32.

    With K a multiple of 32 (every model linear) the native repack writes it in one pass
    (`kernels.moe.tiles.value_expert_tiles` on the rows' 32-bit pairs: the same bytes as the
    torch path, which pads, then permutes pairs of bfloat16 element by element).

    Unpacking: `packed.permute(0, 1, 3, 2, 4).reshape(E, -1, Kp)[:, :N, :K]` gives `w` back.

    Args:
        native: True the native repack, False the torch path, None (default) the native one
            where K allows and the library loads.

    Raises:
        ValueError: `w` not 3-D bfloat16, or `native=True` with K not a multiple of 32.
        RuntimeError: `native=True` where the native library is unavailable.
    """
    if w.dim() != 3 or w.dtype != torch.bfloat16:
        raise ValueError(f"w must be bfloat16 [E, N, K], got {w.dtype} {tuple(w.shape)}")
    e, n, k = w.shape
    n_pad, k_pad = -(-n // COLS) * COLS, -(-k // DEPTH) * DEPTH
    if native and k != k_pad:
        raise ValueError(f"native pack_vnni needs K % {DEPTH} == 0, got K = {k}")
    lib = repack_library() if native is not False and k == k_pad else None
    if native and lib is None:
        raise RuntimeError("the native repack is unavailable (kernels/native/library.py)")
    if lib is not None:
        pairs = w.detach().contiguous().view(torch.int32)  # [E, N, K/2]: (w[n, 2p], w[n, 2p+1])
        tiles = value_expert_tiles(pairs.unbind(0), lib)  # [E, Np/16, K/2, 16] int32
        return tiles.view(torch.bfloat16).view(e, n_pad // COLS, k_pad // 2, COLS, 2)
    if (n_pad, k_pad) != (n, k):
        w = F.pad(w.detach(), (0, k_pad - k, 0, n_pad - n))
    return w.reshape(e, n_pad // COLS, COLS, k_pad // 2, 2).permute(0, 1, 3, 2, 4).contiguous()


@dataclass(frozen=True, eq=False)
class AmxLinear:
    """A bfloat16 linear layer's weight packed for the AMX kernel (csrc/amx_gemm.cpp).

    Attributes:
        weight: [ceil(N/16), K/2, 16, 2] bfloat16 (`pack_vnni`).
        bias: [N] float32 (added before the one rounding, as torch's bf16 addmm does), or an
            empty tensor.
        out_features: N; in_features: K (a multiple of 32).
    """

    weight: torch.Tensor
    bias: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes of the packed weight and bias."""
        return sum(t.numel() * t.element_size() for t in (self.weight, self.bias))

    @classmethod
    def pack(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> AmxLinear:
        """Pack `weight` [N, K] (any float dtype, rounded to bfloat16) and `bias` [N].

        Raises:
            ValueError: a weight not 2-D, K not a multiple of 32, or a bias not [N].
        """
        if weight.dim() != 2 or weight.shape[1] % DEPTH:
            raise ValueError(f"weight must be [N, K] with K % 32 == 0, got "
                             f"{tuple(weight.shape)}")
        n, k = weight.shape
        if bias is not None and bias.shape != (n,):
            raise ValueError(f"bias must be [{n}], got {tuple(bias.shape)}")
        packed = pack_vnni(weight.detach().to(torch.bfloat16).unsqueeze(0))[0]
        b = torch.empty(0) if bias is None else bias.detach().float().contiguous()
        return cls(packed, b, n, k)

    def __call__(self, x: torch.Tensor, *, tiles: bool | None = None) -> torch.Tensor:
        """x [..., K] bfloat16 -> [..., N] bfloat16 (float32 sums and bias, rounded once);
        `tiles`: this process's backend (None), AMX tiles (True) or AVX512-BF16 (False).

        Raises:
            RuntimeError: x not bfloat16 [..., K], a backend that cannot run here, or the
                kernel rejects the call.
        """
        n, k, shape = self.out_features, self.in_features, x.shape
        if x.dtype != torch.bfloat16 or not shape or shape[-1] != k:
            raise RuntimeError(f"x must be bfloat16 [..., {k}], got {x.dtype} {tuple(shape)}")
        lib = load_native("linear_cpu")
        w_ptr, bias_ptr = self.weight_args
        xc = x.contiguous()
        y = x.new_empty((*shape[:-1], n))
        rows = xc.numel() // k if k else 0
        check_status(lib.moe_amx_linear(xc.data_ptr(), rows, k, w_ptr, n, bias_ptr,
                                        y.data_ptr(), 1, tiles_flag(tiles),
                                        torch.get_num_threads()), "amx linear")
        return y

    @cached_property
    def weight_args(self) -> tuple[int, int | None]:
        """(weight pointer, bias pointer or None), checked once.

        Raises:
            RuntimeError: a weight or bias the kernel does not take, or no AMX here.
        """
        require_amx()
        w, n, k, bias = self.weight, self.out_features, self.in_features, self.bias
        want = (-(-n // COLS), k // 2, COLS, 2)
        if tuple(w.shape) != want or w.dtype != torch.bfloat16 or not w.is_contiguous():
            raise RuntimeError(f"weight must be packed bfloat16 {list(want)}, got {w.dtype} "
                               f"{tuple(w.shape)}")
        if bias.numel() and (bias.shape != (n,) or bias.dtype != torch.float32
                             or not bias.is_contiguous()):
            raise RuntimeError(f"bias must be float32 [{n}], got {bias.dtype} "
                               f"{tuple(bias.shape)}")
        return w.data_ptr(), bias.data_ptr() if bias.numel() else None
