// The AVX512-BF16 twin of amx_gemm.h's tile blocks (bf16_dot.cpp), for CPUs without AMX.
#pragma once

#include <cstdint>

namespace moe_engine::amx {

// c[m][j * 16 + col] (ldc floats per row, overwritten) = sum_k A[m][k] * W_j[col][k] for the
// first `rows` rows m (row m at a[m / 16] + (m % 16) * lda: the 16-row tiles of amx_gemm.h's
// block) and the n <= 4 packed column tiles b[j] ([K/2][16][2] bfloat16); K even. Rows past
// `rows` are neither read nor written. Runs only where moe_bf16_dot_available() said yes.
void dot_block_rows(const uint16_t* const* a, int rows, int64_t lda, const uint16_t* const* b,
                    int n, int64_t K, float* c, int64_t ldc);

}  // namespace moe_engine::amx

namespace moe_engine {

// Whether dot_decode_scores takes these shapes: D a multiple of 32 up to 256, G query heads per
// KV head dividing 16 (1, 2, 4, 8, 16).
inline bool dot_scores_fit(int64_t D, int64_t G) {
  return D % 32 == 0 && D <= 256 && G >= 1 && G <= 16 && 16 % G == 0;
}

// scores[g * n + j] = scale * sum_d q[g][d] * k_cache[rows[j] + d] for g < G, j < n: q [G][D]
// bfloat16 (one KV head's query heads), keys in a bfloat16 cache at element offsets rows[j].
// Products exact, sums float32 (VDPBF16PS, denormals flushed), then times scale: the
// arithmetic of amx_decode_scores. v_cache (or null): the value cache whose rows[j] the caller
// reads next, prefetched into L2 beside the keys. Requires dot_scores_fit(D, G) and
// moe_bf16_dot_available().
void dot_decode_scores(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* rows, int64_t n, int64_t G, int64_t D, float scale,
                       float* scores);

}  // namespace moe_engine
