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
