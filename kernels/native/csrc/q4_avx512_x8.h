// The AVX-512 4-bit micro-kernel for one or two rows over chunks of 8 k (64 code bytes), the
// decode path of a batch-1 step (q4_avx512.h uses it where the block size G is a multiple of
// 8, as every checkpoint's is: 32, 64, 128).
//
// At one row the k-pair kernel of q4_avx512.h spends 5 shuffle-port operations per 32 weights
// (byte interleave, zero-extension, two table lookups) beside 2 FMAs, so the shuffle port
// bounds it. Here the 64 bytes are one zmm of 16 dwords, and vpermps, which reads only the low
// 4 bits of each index dword, looks up nibble s of every dword after a shift by 4 s: 8 lookups
// and 7 shifts decode 128 weights with no extension, and each shift s has its own accumulator,
// so one row already has 8 independent FMA chains (the FMA latency needs 8).
//
// Lane j of lookup s holds, by the packed layout (moe_cpu.cpp header; byte i of a k holds
// column L(i) = i + 4 * (i / 4) low, L(i) + 4 high), the weight of
//   k = k0 + 2 * (j / 4) + (j % 4 >= 2),   column 8 * (j % 2) + c(s), c(s) = s / 2 + 4 * (s % 2),
// so one activation vector per row and chunk (x[k0 + kActLane[j]], a vpermps of 8 floats)
// serves all 8 lookups. Scales and zero points are permuted into each s's column order once
// per block; at the tile's end the 8 accumulators of a row are reduced (lanes of equal parity
// summed) into the 16 columns. One row: block sums unscaled, scaled once per block (as the
// other kernels' kBlockScale); two rows: the decoded weights are scaled (16 accumulators plus
// 16 block sums would not fit the 32 registers).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gemm.h"

namespace moe_engine {

// The lanes' columns in lookup s: 8 * (j % 2) + c(s).
MOE_ENGINE_INLINE __m512i x8_lane_columns(int s) {
  const int c = s / 2 + 4 * (s % 2);
  return _mm512_add_epi32(_mm512_setr_epi32(0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8),
                          _mm512_set1_epi32(c));
}

// 16 floats of one block (natural column order) -> the 8 lookups' lane orders.
MOE_ENGINE_INLINE void x8_arrange(__m512 v, __m512 (&out)[8]) {
  for (int s = 0; s < 8; ++s) out[s] = _mm512_permutexvar_ps(x8_lane_columns(s), v);
}

// x[k0 .. k0 + 8) -> lane j: x[k0 + 2 * (j / 4) + (j % 4 >= 2)].
MOE_ENGINE_INLINE __m512 x8_activations(const float* x) {
  const __m512i lanes = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  return _mm512_permutexvar_ps(lanes, _mm512_castps256_ps512(_mm256_loadu_ps(x)));
}

// The 8 accumulators of one row -> its 16 columns at c: per accumulator, the sums of its even
// lanes (column c(s)) and odd lanes (c(s) + 8), by three rounds of pairwise shuffles and adds.
MOE_ENGINE_INLINE void x8_store_columns(const __m512 (&acc)[8], float* c) {
  __m512 pairs[4];  // 128-bit lane q: even/odd partial sums of acc[2i], then of acc[2i + 1]
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(acc[2 * i]), b = _mm512_castps_pd(acc[2 * i + 1]);
    pairs[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  auto fold = [](__m512 a, __m512 b) MOE_ENGINE_LAMBDA_INLINE {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  // lanes 2s, 2s + 1: the even and odd sums of acc[s]
  const __m512 sums = fold(fold(pairs[0], pairs[1]), fold(pairs[2], pairs[3]));
  const __m512i columns = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 1, 5, 9, 13, 3, 7, 11, 15);
  _mm512_storeu_ps(c, _mm512_permutexvar_ps(columns, sums));
}

// c[m][0..16) = sum_k a[m * lda + k] * w[k][0..16), m < M <= 2, w the dequantized tile `tile`
// of `w` (Q4Weights of q4_avx512.h); G % 8 == 0. kZeros: asymmetric int4.
template <int M, Q4 F, bool kZeros, typename WS>
MOE_ENGINE_INLINE void micro_kernel_q4x8(const WS& w, int64_t tile, const float* a, int64_t lda,
                                         float* c) {
  static_assert(M == 1 || M == 2, "x8 kernel: one or two rows");
  constexpr bool kBlockScale = M == 1;
  const int64_t K = w.K, G = w.G;
  const __m512 t = w.table();
  __m512 acc[M][8];
  for (int m = 0; m < M; ++m) {
    for (int s = 0; s < 8; ++s) acc[m][s] = _mm512_setzero_ps();
  }
  const uint8_t* p = w.codes + tile * (K / 2) * kTile;
  for (int64_t g = 0; g < K / G; ++g) {
    const int64_t at = (tile * (K / G) + g) * kTile;
    __m512 scale[8], zero[8], part[M][8];
    x8_arrange(load_scales16<F>(w.scales, at), scale);
    if constexpr (kZeros) {
      x8_arrange(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.zeros + at)))), zero);
    }
    for (int m = 0; m < M; ++m) {
      for (int s = 0; s < 8; ++s) part[m][s] = _mm512_setzero_ps();
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 8, p += 4 * kTile) {
      prefetch_weights<4>(p);
      const __m512i raw = _mm512_loadu_si512(p);
      __m512 x[M];
      for (int m = 0; m < M; ++m) x[m] = x8_activations(a + m * lda + k);
#pragma GCC unroll 8
      for (int s = 0; s < 8; ++s) {
        __m512 ws = _mm512_permutexvar_ps(s ? _mm512_srli_epi32(raw, 4 * s) : raw, t);
        if constexpr (kZeros) ws = _mm512_sub_ps(ws, zero[s]);
        if constexpr (!kBlockScale) ws = _mm512_mul_ps(ws, scale[s]);
        for (int m = 0; m < M; ++m) {
          __m512& sum = kBlockScale ? part[m][s] : acc[m][s];
          sum = _mm512_fmadd_ps(x[m], ws, sum);
        }
      }
    }
    if constexpr (kBlockScale) {
      for (int s = 0; s < 8; ++s) acc[0][s] = _mm512_fmadd_ps(part[0][s], scale[s], acc[0][s]);
    }
  }
  for (int m = 0; m < M; ++m) x8_store_columns(acc[m], c + m * kTile);
}

}  // namespace moe_engine
