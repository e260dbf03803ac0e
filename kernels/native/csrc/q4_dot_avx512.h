// The one-row 4-bit kernel on VDPBF16PS, shared by the dense 4-bit linear (linear_q4_cpu.cpp)
// and the experts' gate/up projections at one token (moe_cpu.cpp): a bfloat16 row times one
// packed 4-bit tile (moe_cpu.cpp's header: [tiles][K / 2][16] code bytes, [tiles][K / G][16]
// scales), the codes decoded to bfloat16 by one word lookup (vpermw) per 32 weights and 32
// products added by one VDPBF16PS, where the float32 kernels (q4_avx512_x8.h) spend a shift, a
// vpermps and an FMA per 16 (bench/NOTES.md section 22). Products exact (bfloat16 x times the
// exact 4-bit value, its scale applied once per group in float32), float32 sums. G % 16 == 0,
// no zero points (symmetric int4 or MXFP4).
//
// Include only inside a `#pragma GCC target("...,avx512bf16")` region of a translation unit of
// the AVX-512 build, and call only where moe_bf16_dot_available() said yes; everything here
// has internal linkage, so no copy of it can stand in for another unit's baseline code.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu_common.h"
#include "q4.h"

namespace {

using moe_engine::kTile;
using moe_engine::Q4;
using moe_engine::Q4Weights;

// In dot_tile, each 128-bit lane q of a 64-byte chunk (k pair k0 + 2q, k0 + 2q + 1) is
// reordered bytewise so that dword d holds bytes 2d, 2d + 1 (k) and 8 + 2d, 9 + 2d (k + 1) of
// the pair: word 2d is k's, word 2d + 1 is k + 1's, and their nibble s (s < 4) is the same
// column, dot_column(s, d), by the packed layout (moe_cpu.cpp header: byte i holds column
// L(i) = i + 4 * (i / 4) low, L(i) + 4 high). So lookup s (the words shifted by 4 s) gives, in
// dword d, the weight pair (k, k + 1) of one column, as VDPBF16PS pairs them.
constexpr int dot_column(int s, int d) {
  const int i = 2 * d + s / 2;
  return i + 4 * (i / 4) + 4 * (s % 2);
}

struct DotConstants {
  __m512i order, pair_lanes, table, scale_lanes[4], columns;
};

// vpermw reads the low 5 bits of each index word: after the shift by 4 s, bit 4 is the next
// nibble's lowest bit, so the 16 values are stored twice.
template <Q4 F>
DotConstants dot_constants(const Q4Weights<F>& w) {
  DotConstants k;
  k.order = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  k.pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  alignas(64) float values[16];
  _mm512_store_ps(values, w.table());
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = moe_engine::f32_to_bf16(values[i % 16]);
  k.table = _mm512_load_si512(table);
  alignas(64) int32_t lanes[4][16], columns[16];
  for (int s = 0; s < 4; ++s) {
    for (int j = 0; j < 16; ++j) lanes[s][j] = dot_column(s, j % 4);
    for (int d = 0; d < 4; ++d) columns[dot_column(s, d)] = 4 * s + d;
  }
  for (int s = 0; s < 4; ++s) k.scale_lanes[s] = _mm512_load_si512(lanes[s]);
  k.columns = _mm512_load_si512(columns);
  return k;
}

inline __attribute__((always_inline)) __m512 fold_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// c[m][0..16) = sum_k x[m * ldx + k] * w[k][0..16) over tile `tile`, for the R rows m < R
// (R <= 2: the accumulators of two rows fill most of the 32 registers): per 16 k (two chunks,
// their own accumulators: 8 chains a row) 2 loads, 2 byte shuffles, 6 shifts and 8 lookups
// shared by the rows, and 8 VDPBF16PS a row; each group's sums scaled once; the four 128-bit
// lanes (different k) summed at the end. A row's arithmetic is the same whatever R: its
// results do not depend on the rows beside it.
template <int R, Q4 F>
inline __attribute__((always_inline)) void dot_tile_rows(const uint16_t* x, int64_t ldx,
                                                         const Q4Weights<F>& w, int64_t tile,
                                                         const DotConstants& kc, float* c) {
  const int64_t K = w.K, G = w.G;
  const uint8_t* p = w.codes + tile * (K / 2) * kTile;
  __m512 acc[R][4];
  for (int m = 0; m < R; ++m) {
    for (int s = 0; s < 4; ++s) acc[m][s] = _mm512_setzero_ps();
  }
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 part[R][2][4];
    for (int m = 0; m < R; ++m) {
      for (int u = 0; u < 2; ++u) {
        for (int s = 0; s < 4; ++s) part[m][u][s] = _mm512_setzero_ps();
      }
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 16, p += 8 * kTile) {
      moe_engine::prefetch_weights<8>(p);
      for (int u = 0; u < 2; ++u) {
        const __m512i r = _mm512_shuffle_epi8(_mm512_loadu_si512(p + u * 4 * kTile), kc.order);
        __m512bh xv[R];
        for (int m = 0; m < R; ++m) {
          xv[m] = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi32(
              kc.pair_lanes, _mm512_castsi128_si512(_mm_loadu_si128(
                  reinterpret_cast<const __m128i*>(x + m * ldx + k + 8 * u)))));
        }
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
          const __m512i v = _mm512_permutexvar_epi16(s ? _mm512_srli_epi16(r, 4 * s) : r,
                                                     kc.table);
          for (int m = 0; m < R; ++m) {
            part[m][u][s] = _mm512_dpbf16_ps(part[m][u][s], xv[m],
                                             reinterpret_cast<__m512bh>(v));
          }
        }
      }
    }
    const __m512 scale = moe_engine::load_scales16<F>(w.scales, (tile * (K / G) + g) * kTile);
    for (int s = 0; s < 4; ++s) {
      const __m512 lanes = _mm512_permutexvar_ps(kc.scale_lanes[s], scale);
      for (int m = 0; m < R; ++m) {
        acc[m][s] = _mm512_fmadd_ps(_mm512_add_ps(part[m][0][s], part[m][1][s]), lanes,
                                    acc[m][s]);
      }
    }
  }
  // lane 4 s + d: the sum over the four k pairs of acc[s]'s dword d, column dot_column(s, d)
  for (int m = 0; m < R; ++m) {
    const __m512 sums = fold_lanes(fold_lanes(acc[m][0], acc[m][1]),
                                   fold_lanes(acc[m][2], acc[m][3]));
    _mm512_storeu_ps(c + m * kTile, _mm512_permutexvar_ps(kc.columns, sums));
  }
}

// One row: c[0..16) = sum_k x[k] * w[k][0..16) (dot_tile_rows).
template <Q4 F>
inline __attribute__((always_inline)) void dot_tile(const uint16_t* x, const Q4Weights<F>& w,
                                                    int64_t tile, const DotConstants& kc,
                                                    float* c) {
  dot_tile_rows<1>(x, 0, w, tile, kc, c);
}

}  // namespace
