// bfloat16 GEMM blocks on Intel AMX (Advanced Matrix Extensions: AMX-TILE + AMX-BF16), for the
// translation units compiled with -mamx-tile -mamx-bf16 (amx_gemm.cpp, amx_moe.cpp;
// kernels/native/build.py SOURCE_FLAGS) on top of the library's AVX2 flags. Nothing here may run
// before moe_amx_available() (amx_detect.cpp) said yes in this process: that call also asks
// Linux for the tile data state (arch_prctl ARCH_REQ_XCOMP_PERM), without which the first tile
// instruction faults.
//
// Source: Intel 64 and IA-32 Architectures Software Developer's Manual, vol. 1 ch. 18 and
// vol. 2 (LDTILECFG, TILELOADD, TDPBF16PS, TILESTORED); Intel Optimization Reference Manual,
// "Intel AMX" chapter (the 2 x 2 tile blocking).
//
// Operands, for one column tile of 16 output columns:
//   A: 16 rows x 32 bfloat16 (one 64-byte row per activation row, `lda` elements apart).
//   B: the packed weights in the VNNI pair layout TDPBF16PS reads: [K/2][16][2], row p holding
//      (W[n][2p], W[n][2p+1]) for the 16 columns n of the tile; a 32-deep slice of K is 16 such
//      rows (1 KiB, 64 bytes apart). kernels/dense/amx.py `pack_vnni` makes it.
//   C: 16 x 16 float32 accumulators, C[m][n] += sum_k A[m][k] * W[n][k] (products exact, sums
//      float32; TDPBF16PS flushes denormal inputs and outputs to zero).
// Tiles: tmm0-3 accumulators, tmm4-5 A, tmm5-7 B; every tile is configured 16 rows x 64 bytes
// (a block of fewer rows is padded by the caller: rows are independent, padding rows' results
// are discarded).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "bf16_dot.h"
#include "cpu_common.h"

#define MOE_AMX_INLINE inline __attribute__((always_inline))

namespace moe_engine::amx {

using moe_engine::f32_to_bf16;

constexpr int64_t kRows = 16;   // rows of an A or C tile
constexpr int64_t kCols = 16;   // output columns of a B or C tile
constexpr int64_t kDepth = 32;  // bfloat16 values of K per tile step
constexpr int kMaxColTiles = 4;

// LDTILECFG's 64-byte operand, palette 1.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 64 bytes wide; the B tiles (tmm5-7) 16 rows, tmm0-4 (the C tiles and block_1xn's
// A tile) `m` rows, 1 <= m <= 16: a 1 x n block of m < 16 real rows then loads, multiplies and
// stores only those (each row's sums are the same whatever m: rows are independent). block_2xn
// needs m = 16 (its second A tile is tmm5). Loaded at the start of each work item: the thread
// may have run a oneDNN AMX kernel (another configuration, or released tiles) since then.
MOE_AMX_INLINE void configure_tiles(int m = kRows) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = t <= 4 ? m : 16;
  }
  _tile_loadconfig(&cfg);
}

// C tiles of `rows` 16-row tiles (1 or 2: A rows a0, a1) times `n` (<= 4, <= 2 when rows is
// 2) column tiles b[0..n): c[r * 16 + m][j * 16 + col] (ldc floats per row), overwritten.
// a0/a1: [16][K] bfloat16 with `lda` elements per row; b[j]: packed tile [K/2][16][2].
MOE_AMX_INLINE void block_1xn(const uint16_t* a0, int64_t lda, const uint16_t* const* b, int n,
                              int64_t K, float* c, int64_t ldc) {
  const int64_t sa = lda * 2, sc = ldc * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  // One row tile: bound by streaming the weights, which the hardware prefetchers fetch
  // alone (n sequential streams); a software prefetch of each tile's slice 2-8 k steps ahead
  // measured 10-20% slower here (bench/NOTES.md section 9, "small batches").
  for (int64_t k = 0; k < K; k += kDepth) {
    _tile_loadd(4, a0 + k, sa);
    _tile_loadd(5, b[0] + k * 16, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (n > 1) {
      _tile_loadd(6, b[1] + k * 16, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (n > 2) {
      _tile_loadd(7, b[2] + k * 16, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (n > 3) {
      _tile_loadd(5, b[3] + k * 16, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, sc);
  if (n > 1) _tile_stored(1, c + 16, sc);
  if (n > 2) _tile_stored(2, c + 32, sc);
  if (n > 3) _tile_stored(3, c + 48, sc);
}

MOE_AMX_INLINE void block_2xn(const uint16_t* a0, const uint16_t* a1, int64_t lda,
                              const uint16_t* const* b, int n, int64_t K, float* c,
                              int64_t ldc) {
  const int64_t sa = lda * 2, sc = ldc * 4;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k = 0; k < K; k += kDepth) {
    _tile_loadd(4, a0 + k, sa);
    _tile_loadd(6, b[0] + k * 16, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_loadd(5, a1 + k, sa);
    _tile_dpbf16ps(2, 5, 6);
    if (n > 1) {
      _tile_loadd(7, b[1] + k * 16, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c, sc);
  _tile_stored(2, c + 16 * ldc, sc);
  if (n > 1) {
    _tile_stored(1, c + 16, sc);
    _tile_stored(3, c + 16 * ldc + 16, sc);
  }
}

// c [rows * 16][ldc] float32 = A (row tile r at a[r]) times column tiles b[0..n), n <= 4,
// rows 1 or 2. On the tiles (`tiles`: configured by configure_tiles) every row of the row
// tiles is computed; else on AVX512-BF16 (bf16_dot.h) only the first `valid` rows, which are
// all the callers read.
MOE_AMX_INLINE void block(bool tiles, const uint16_t* const* a, int rows, int valid,
                          int64_t lda, const uint16_t* const* b, int n, int64_t K, float* c,
                          int64_t ldc) {
  if (!tiles) {
    if (valid > 0) dot_block_rows(a, valid, lda, b, n, K, c, ldc);
    return;
  }
  if (rows == 1) {
    block_1xn(a[0], lda, b, n, K, c, ldc);
    return;
  }
  for (int j = 0; j < n; j += 2) {
    block_2xn(a[0], a[1], lda, b + j, n - j >= 2 ? 2 : 1, K, c + j * 16, ldc);
  }
}

// The epilogues are AVX2 (the library's baseline), not AVX-512: these translation units add
// only the AMX flags, so every inline function and template they share with the rest of the
// library (std::vector, cpu_common.h) compiles to the same baseline code, whichever copy the
// linker keeps.

// bfloat16 bits of 8 float32 values in the low halves of 8 int32, rounded to nearest even,
// NaN to 0x7FC0: c10::BFloat16's rounding (cpu_common.h f32_to_bf16), so results match what
// torch's bfloat16 tensors hold.
MOE_AMX_INLINE __m256i round_bf16(__m256 v) { return moe_engine::round_bf16x8(v); }

// dst[0..cols) = src[0..cols) (+ bias[0..cols)) as float32 or bfloat16 bits, cols <= 16.
MOE_AMX_INLINE void store_row16(const float* src, const float* bias, int cols, float* dst) {
  if (cols == kCols) {
    __m256 lo = _mm256_loadu_ps(src), hi = _mm256_loadu_ps(src + 8);
    if (bias) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
    return;
  }
  for (int j = 0; j < cols; ++j) dst[j] = src[j] + (bias ? bias[j] : 0.0f);
}

MOE_AMX_INLINE void store_row16(const float* src, const float* bias, int cols, uint16_t* dst) {
  if (cols == kCols) {
    __m256 lo = _mm256_loadu_ps(src), hi = _mm256_loadu_ps(src + 8);
    if (bias) {
      lo = _mm256_add_ps(lo, _mm256_loadu_ps(bias));
      hi = _mm256_add_ps(hi, _mm256_loadu_ps(bias + 8));
    }
    // packus interleaves the 128-bit lanes: (lo 0-3, hi 0-3, lo 4-7, hi 4-7); permute back
    const __m256i packed = _mm256_packus_epi32(round_bf16(lo), round_bf16(hi));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                        _mm256_permute4x64_epi64(packed, 0xD8));
    return;
  }
  for (int j = 0; j < cols; ++j) dst[j] = f32_to_bf16(src[j] + (bias ? bias[j] : 0.0f));
}

}  // namespace moe_engine::amx
