// The query-key scores of decode attention on Intel AMX tiles (csrc/amx_attention.cpp, compiled
// with the AMX flags of kernels/native/build.py SOURCE_FLAGS); called by paged_attention.cpp
// only when its caller said the AMX kernels may run (moe_amx_available() said yes in this
// process) and `amx_scores_fit` holds.
#pragma once

#include <cstdint>

namespace moe_engine {

// Whether amx_decode_scores takes these shapes: D a multiple of 32 up to 256, G query heads per
// KV head at most 16, blocks of a multiple of 16 slots (a tile's 16 keys never straddle two
// blocks).
inline bool amx_scores_fit(int64_t D, int64_t G, int64_t block_size) {
  return D % 32 == 0 && D <= 256 && G >= 1 && G <= 16 && block_size % 16 == 0;
}

// scores[g * n + j] = scale * sum_d q[g][d] * K[first + j][d] for g < G, j < n = L - first:
// q [G][D] bfloat16 (the G query heads of one KV head, contiguous); K the KV head's keys in a
// bfloat16 cache whose slot s starts at k_cache + s * row_stride (+ head_offset for the head),
// position p at slot table[p / block_size] * block_size + p % block_size. Products exact,
// sums float32 (TDPBF16PS, denormals flushed), then times scale. Whole 16-key tiles are
// multiplied; a tile's keys outside [first, L) are read from their (allocated) block and
// discarded. Requires amx_scores_fit(D, G, block_size).
void amx_decode_scores(const uint16_t* q, const uint16_t* k_cache, const int64_t* table,
                       int64_t block_size, int64_t row_stride, int64_t head_offset, int64_t D,
                       int64_t G, int64_t first, int64_t L, float scale, float* scores);

}  // namespace moe_engine
