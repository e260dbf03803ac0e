// The 4-bit expert weights (MXFP4, int4) of this build: `Q4Weights<F>` with `block`, `rows`
// (n <= kRows rows times one tile) and `dequantize` (one tile to float32 [K][16]), from
// q4_avx512.h in the AVX-512 build, else q4_avx2.h.
#pragma once

#include "gemm.h"

namespace moe_engine {

// The `format` argument of moe_fused_moe_q4: MXFP4, or int4 with float32 / bfloat16 / float16
// scales (every value but kMxfp4 is int4).
enum class Q4 { kMxfp4 = 0, kInt4 = 1, kInt4Bf16 = 2, kInt4F16 = 3 };

}  // namespace moe_engine

#if MOE_ENGINE_VECTOR_BITS == 512
#include "q4_avx512.h"
#else
#include "q4_avx2.h"
#endif
