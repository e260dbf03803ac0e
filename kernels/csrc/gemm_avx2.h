// Register-blocked float32 GEMM micro-kernels for AVX2/FMA, shared by the native CPU kernels.
//
// C[m][0..16) = sum_k A[m][k] * W[k][0..16) for m < M <= 6: the weights are packed as tiles of
// 16 output columns stored k-major ([tiles][K][16], kernels/cpu_native.py `pack_tiles`), so each
// k step loads 16 contiguous weights (float32, or bfloat16 widened in registers: a bfloat16 is
// the high half of a float32) and broadcasts one activation per row into 2 x M float32
// accumulators (Goto & van de Geijn, "Anatomy of High-Performance Matrix Multiplication",
// ACM TOMS 2008: a 6 x 16 register block uses 12 of AVX2's 16 vector registers).
#pragma once

#include <immintrin.h>

#include <cstdint>

// Forced inlining: GCC's inliner budgets grow with the translation unit, and these small units
// (no torch headers) otherwise keep the micro-kernels out of line (measured 45% slower on the
// 4-bit MoE at 64 tokens).
#define MOE_ENGINE_INLINE inline __attribute__((always_inline))

namespace moe_engine {

constexpr int64_t kTile = 16;  // output columns per packed tile
constexpr int kRows = 6;       // rows per micro-kernel call

MOE_ENGINE_INLINE __m256 widen_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

MOE_ENGINE_INLINE __m256 load_w(const float* p) { return _mm256_loadu_ps(p); }
MOE_ENGINE_INLINE __m256 load_w(const uint16_t* p) { return widen_bf16(p); }

// c[m * 16 + j] = sum_k a[m * lda + k] * w[k * 16 + j], m < M, j < 16.
template <int M, typename W>
MOE_ENGINE_INLINE void micro_kernel(const float* a, int64_t lda, const W* w, int64_t K, float* c) {
  __m256 lo[M], hi[M];
  for (int m = 0; m < M; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = load_w(w + k * kTile);
    const __m256 w1 = load_w(w + k * kTile + 8);
    for (int m = 0; m < M; ++m) {
      const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
      lo[m] = _mm256_fmadd_ps(x, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(x, w1, hi[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(c + m * kTile, lo[m]);
    _mm256_storeu_ps(c + m * kTile + 8, hi[m]);
  }
}

// Rows [0, n) of a (n <= kRows) times one packed tile -> c [n][16].
template <typename W>
MOE_ENGINE_INLINE void tile_rows(const float* a, int64_t lda, int n, const W* w, int64_t K,
                                 float* c) {
  switch (n) {
    case 1: micro_kernel<1>(a, lda, w, K, c); break;
    case 2: micro_kernel<2>(a, lda, w, K, c); break;
    case 3: micro_kernel<3>(a, lda, w, K, c); break;
    case 4: micro_kernel<4>(a, lda, w, K, c); break;
    case 5: micro_kernel<5>(a, lda, w, K, c); break;
    default: micro_kernel<6>(a, lda, w, K, c); break;
  }
}

}  // namespace moe_engine
