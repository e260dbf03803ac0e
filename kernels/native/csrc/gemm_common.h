// What the AVX2 and AVX-512 micro-kernels (gemm_avx2.h, gemm_avx512.h) share: forced inlining
// and the software prefetch of the weight stream.
#pragma once

#include <immintrin.h>

#include <cstdint>

// Forced inlining: GCC's inliner budgets grow with the translation unit, and these small units
// (no torch headers) otherwise keep the micro-kernels out of line (measured 45% slower on the
// 4-bit MoE at 64 tokens).
#define MOE_ENGINE_INLINE inline __attribute__((always_inline))
#define MOE_ENGINE_LAMBDA_INLINE __attribute__((always_inline))

namespace moe_engine {

// Bytes ahead of the current k step that the weight stream is prefetched. A decode step reads
// each weight once, from L3 (or DRAM), in one sequential stream per thread; the L2 hardware
// prefetcher does not cross 4 KiB pages (Intel 64 and IA-32 Architectures Optimization
// Reference Manual, "Data Prefetching"), so each new page would start cold. 2 KiB ahead
// measured 30-40% faster than none at one and two rows from L3 on the project's machine
// (bench/NOTES.md section 11); reading past a tile's end only touches the next tile. The AVX2
// kernels prefetch only at those decode sizes (at 4-6 rows, compute-bound, the extra loads
// cost 10%: bench/native_micro.cpp).
constexpr int64_t kPrefetchBytes = 2048;

// Prefetch (into L1) the cache lines that the U k steps after `w` + kPrefetchBytes hold: one
// packed tile row is 16 weights (64 bytes of float32, 32 of bfloat16).
template <int U, typename W>
MOE_ENGINE_INLINE void prefetch_weights(const W* w) {
  constexpr int64_t bytes = U * 16 * int64_t(sizeof(W));
  const char* p = reinterpret_cast<const char*>(w) + kPrefetchBytes;
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T0);
}

}  // namespace moe_engine
