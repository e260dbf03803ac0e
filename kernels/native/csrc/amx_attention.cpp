// Decode attention's query-key scores on Intel AMX (amx_attention.h): one TDPBF16PS per 16 keys
// and 32 head dimensions, where the AVX2 loop spends two FMAs and a widening per key, query
// head and 8 dimensions (the scores pass was about half of paged_attention.cpp's time at
// decode batches: bench/NOTES.md section 15).
//
// Tiles (Intel SDM vol. 1 ch. 18; the operand layouts of amx_gemm.h):
//   A (tmm1): 16 keys x 32 bfloat16 dimensions, read in place from the cache: a block's slots
//     are `row_stride` elements apart, which TILELOADD's stride takes as is;
//   B (tmm2): the G query heads in the VNNI pair layout, [16 pairs of dimensions][16 columns]
//     [2], columns >= G zero; packed here once per call, D / 32 tiles;
//   C (tmm0): 16 keys x 16 columns float32; column g is key . q_g.

#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "amx_attention.h"
#include "amx_gemm.h"

namespace moe_engine {

namespace {

constexpr int64_t kKeys = 16;  // keys per tile (A's rows)

// The scores' three tiles, every one 16 rows x 64 bytes.
void configure() {
  amx::TileConfig cfg;
  for (int t = 0; t < 3; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace

void amx_decode_scores(const uint16_t* q, const uint16_t* k_cache, const int64_t* table,
                       int64_t block_size, int64_t row_stride, int64_t head_offset, int64_t D,
                       int64_t G, int64_t first, int64_t L, float scale, float* scores) {
  const int64_t steps = D / amx::kDepth, n = L - first;
  // B tiles: qv[s][p][c][t] = q[c][32 s + 2 p + t] for columns c < G, else 0.
  alignas(64) uint16_t qv[8 * 16 * amx::kCols * 2] = {};  // D <= 256: 8 steps
  for (int64_t s = 0; s < steps; ++s)
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t g = 0; g < G; ++g)
        for (int t = 0; t < 2; ++t)
          qv[((s * 16 + p) * amx::kCols + g) * 2 + t] = q[g * D + s * amx::kDepth + 2 * p + t];
  alignas(64) float c[kKeys * amx::kCols];
  configure();
  const auto tile_at = [&](int64_t p0) {
    return k_cache + (table[p0 / block_size] * block_size + p0 % block_size) * row_stride +
           head_offset;
  };
  for (int64_t p0 = first / kKeys * kKeys; p0 < L; p0 += kKeys) {
    const uint16_t* a = tile_at(p0);
    // The next tile's keys: one block's slots are row_stride apart, blocks anywhere, so the
    // hardware prefetchers do not find them (the loads below were 60% of the time without).
    if (p0 + kKeys < L) {
      const char* next = reinterpret_cast<const char*>(tile_at(p0 + kKeys));
      for (int64_t r = 0; r < kKeys; ++r)
        for (int64_t off = 0; off < D * 2; off += 64)
          _mm_prefetch(next + r * row_stride * 2 + off, _MM_HINT_T0);
    }
    _tile_zero(0);
    for (int64_t s = 0; s < steps; ++s) {
      _tile_loadd(1, a + s * amx::kDepth, row_stride * 2);
      _tile_loadd(2, qv + s * 16 * amx::kCols * 2, 64);
      _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, c, amx::kCols * 4);
    const int64_t lo = std::max(p0, first), hi = std::min(p0 + kKeys, L);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = scores + g * n - first;
      for (int64_t pos = lo; pos < hi; ++pos) sg[pos] = c[(pos - p0) * amx::kCols + g] * scale;
    }
  }
  _tile_release();
}

}  // namespace moe_engine
