// Register-blocked float32 GEMM micro-kernels for AVX-512 (F/BW/VL/DQ), the 512-bit twin of
// gemm_avx2.h with the same interface (kTile, kRows, load_w, micro_kernel, tile_rows), chosen
// at compile time by gemm.h and at load time by kernels/native/library.py.
//
// A packed tile row of 16 output columns ([tiles][K][16], kernels/moe/native.py `pack_tiles`)
// is exactly one zmm register of float32 (a bfloat16 row widened by a zero-extension and a
// shift), so each k step is one weight load and one FMA per row with the activation as an
// embedded broadcast ({1to16} memory operand): no broadcast instruction and half the FMAs of
// the AVX2 kernel per weight. With 32 vector registers a row block holds kRows = 12 rows
// (12 accumulators; Goto & van de Geijn, "Anatomy of High-Performance Matrix Multiplication",
// ACM TOMS 2008: the register block amortises each weight load over the rows). Few rows leave
// too few independent FMA chains for the FMA latency (4 cycles on two 512-bit FMA ports: 8
// chains keep both busy; Intel 64 and IA-32 Architectures Optimization Reference Manual,
// Sapphire Rapids), so 1, 2 and 3-4 rows unroll k by 8, 4 and 2 into separate accumulators.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gemm_common.h"

namespace moe_engine {

constexpr int64_t kTile = 16;  // output columns per packed tile
constexpr int kRows = 12;      // rows per micro-kernel call

MOE_ENGINE_INLINE __m512 load_w(const float* p) { return _mm512_loadu_ps(p); }
MOE_ENGINE_INLINE __m512 load_w(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// k steps in flight per row block: >= 8 independent FMA chains up to 4 rows.
template <int M>
constexpr int kUnroll = M == 1 ? 8 : (M == 2 ? 4 : (M <= 4 ? 2 : 1));

// c[m * 16 + j] = sum_k a[m * lda + k] * w[k * 16 + j], m < M, j < 16.
template <int M, typename W>
MOE_ENGINE_INLINE void micro_kernel(const float* a, int64_t lda, const W* w, int64_t K, float* c) {
  constexpr int U = kUnroll<M>;
  __m512 acc[U][M];
  for (int u = 0; u < U; ++u) {
    for (int m = 0; m < M; ++m) acc[u][m] = _mm512_setzero_ps();
  }
  auto step = [&](int u, int64_t k) MOE_ENGINE_LAMBDA_INLINE {
    const __m512 wk = load_w(w + k * kTile);
    for (int m = 0; m < M; ++m) {
      acc[u][m] = _mm512_fmadd_ps(_mm512_set1_ps(a[m * lda + k]), wk, acc[u][m]);
    }
  };
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    prefetch_weights<U>(w + k * kTile);
    for (int u = 0; u < U; ++u) step(u, k + u);
  }
  for (; k < K; ++k) step(0, k);
  for (int m = 0; m < M; ++m) {
    for (int u = 1; u < U; ++u) acc[0][m] = _mm512_add_ps(acc[0][m], acc[u][m]);
    _mm512_storeu_ps(c + m * kTile, acc[0][m]);
  }
}

// Rows [0, n) of a (n <= kRows) times one packed tile -> c [n][16]. Out of line, as q4_rows
// (q4_avx512.h): one call per tile and row block.
template <typename W>
__attribute__((noinline)) void tile_rows(const float* a, int64_t lda, int n, const W* w, int64_t K,
                                 float* c) {
  switch (n) {
    case 1: micro_kernel<1>(a, lda, w, K, c); break;
    case 2: micro_kernel<2>(a, lda, w, K, c); break;
    case 3: micro_kernel<3>(a, lda, w, K, c); break;
    case 4: micro_kernel<4>(a, lda, w, K, c); break;
    case 5: micro_kernel<5>(a, lda, w, K, c); break;
    case 6: micro_kernel<6>(a, lda, w, K, c); break;
    case 7: micro_kernel<7>(a, lda, w, K, c); break;
    case 8: micro_kernel<8>(a, lda, w, K, c); break;
    case 9: micro_kernel<9>(a, lda, w, K, c); break;
    case 10: micro_kernel<10>(a, lda, w, K, c); break;
    case 11: micro_kernel<11>(a, lda, w, K, c); break;
    default: micro_kernel<12>(a, lda, w, K, c); break;
  }
}

}  // namespace moe_engine
