// Register-blocked float32 GEMM micro-kernels for AVX2/FMA, shared by the native CPU kernels.
//
// C[m][0..16) = sum_k A[m][k] * W[k][0..16) for m < M <= 6: the weights are packed as tiles of
// 16 output columns stored k-major ([tiles][K][16], kernels/moe/native.py `pack_tiles`), so each
// k step loads 16 contiguous weights (float32, or bfloat16 widened in registers: a bfloat16 is
// the high half of a float32) and broadcasts one activation per row into 2 x M float32
// accumulators (Goto & van de Geijn, "Anatomy of High-Performance Matrix Multiplication",
// ACM TOMS 2008: a 6 x 16 register block uses 12 of AVX2's 16 vector registers). gemm.h
// includes this header in the AVX2 build and gemm_avx512.h in the AVX-512 one.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gemm_common.h"

namespace moe_engine {

constexpr int64_t kTile = 16;  // output columns per packed tile
constexpr int kRows = 6;       // rows per micro-kernel call

MOE_ENGINE_INLINE __m256 widen_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

MOE_ENGINE_INLINE __m256 load_w(const float* p) { return _mm256_loadu_ps(p); }
MOE_ENGINE_INLINE __m256 load_w(const uint16_t* p) { return widen_bf16(p); }

// The k steps in flight per row block: at one or two rows, 2 x M accumulators are too few
// independent FMA chains to hide the FMA latency (4 cycles, 2 FMA ports: 8 chains keep both
// busy; measured 11 GB/s of bf16 weights at one row before, see bench/NOTES.md section 11), so
// U k steps accumulate into U separate sets, summed at the end.
template <int M>
constexpr int kUnroll = M == 1 ? 4 : (M == 2 ? 2 : 1);

// c[m * 16 + j] = sum_k a[m * lda + k] * w[k * 16 + j], m < M, j < 16.
template <int M, typename W>
MOE_ENGINE_INLINE void micro_kernel(const float* a, int64_t lda, const W* w, int64_t K, float* c) {
  constexpr int U = kUnroll<M>;
  __m256 lo[U][M], hi[U][M];
  for (int u = 0; u < U; ++u) {
    for (int m = 0; m < M; ++m) {
      lo[u][m] = _mm256_setzero_ps();
      hi[u][m] = _mm256_setzero_ps();
    }
  }
  auto step = [&](int u, int64_t k) MOE_ENGINE_LAMBDA_INLINE {
    const __m256 w0 = load_w(w + k * kTile);
    const __m256 w1 = load_w(w + k * kTile + 8);
    for (int m = 0; m < M; ++m) {
      const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
      lo[u][m] = _mm256_fmadd_ps(x, w0, lo[u][m]);
      hi[u][m] = _mm256_fmadd_ps(x, w1, hi[u][m]);
    }
  };
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    if constexpr (U > 1) prefetch_weights<U>(w + k * kTile);  // decode sizes: read-bound
    for (int u = 0; u < U; ++u) step(u, k + u);
  }
  for (; k < K; ++k) step(0, k);
  for (int m = 0; m < M; ++m) {
    for (int u = 1; u < U; ++u) {
      lo[0][m] = _mm256_add_ps(lo[0][m], lo[u][m]);
      hi[0][m] = _mm256_add_ps(hi[0][m], hi[u][m]);
    }
    _mm256_storeu_ps(c + m * kTile, lo[0][m]);
    _mm256_storeu_ps(c + m * kTile + 8, hi[0][m]);
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
