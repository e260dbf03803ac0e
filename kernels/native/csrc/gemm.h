// The dense micro-kernels of this build: 512-bit (gemm_avx512.h) when compiled for AVX-512
// (kernels/native/build.py's "avx512" variant), else AVX2/FMA (gemm_avx2.h). Both define
// kTile, kRows, load_w, micro_kernel and tile_rows in namespace moe_engine.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#include "gemm_avx512.h"
#define MOE_ENGINE_VECTOR_BITS 512
#else
#include "gemm_avx2.h"
#define MOE_ENGINE_VECTOR_BITS 256
#endif
