// The bfloat16 GEMM blocks of amx_gemm.h on AVX512-BF16 (VDPBF16PS), for CPUs that have it but
// no AMX (AMD Zen 4 and Zen 5, Intel Cooper Lake): the same operands (bfloat16 rows, weights in
// the VNNI pair layout [K/2][16][2] of kernels/dense/amx.py `pack_vnni`), the same arithmetic
// (bfloat16 products, exact in float32, summed in float32; denormal inputs and outputs
// flushed to zero, rounding to nearest even, as TDPBF16PS), so the AMX kernels' callers run
// unchanged on either.
//
// Source: Intel 64 and IA-32 Architectures Software Developer's Manual vol. 2, VDPBF16PS: per
// 32-bit lane i, dst[i] += a[2i+1] * b[2i+1] + a[2i] * b[2i] (each product and add in float32,
// DAZ/FTZ, round to nearest even regardless of MXCSR).
//
// A row's pair (a[2p], a[2p+1]) is one 32-bit broadcast; a packed tile's pair row p is one
// zmm of 16 columns x 2, so one VDPBF16PS adds 32 products to a row's 16 column sums. Row
// blocks of up to 6 rows x 4 column tiles keep 24 accumulators in registers (Goto & van de
// Geijn, TOMS 2008). Every output element accumulates over K in one chain, k-pair by k-pair,
// whatever the block's size: a token's result does not depend on the batch it runs in (as on
// the tiles; tests/test_amx_kernels.py).
//
// Compiled with the variant's flags; only the functions below (after the target pragma) may
// hold AVX512-BF16 instructions, and they run only after moe_bf16_dot_available() said yes.

#include <immintrin.h>

#include <algorithm>
#include <cpuid.h>
#include <cstdint>
#include <cstring>

#include "bf16_dot.h"
#include "moe_engine_cpu.h"

namespace {

// CPUID.(7,1).EAX bit 5 AVX512_BF16, CPUID.(7,0).EBX bits 16 (AVX512F) and 30 (AVX512BW),
// and the OS saving the opmask and zmm state (XCR0 bits 1, 2, 5, 6, 7; Intel SDM vol. 1
// 15.2).
bool has_avx512_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c >> 27 & 1)) return false;  // OSXSAVE
  unsigned lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 0xE6) != 0xE6) return false;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(b >> 16 & 1) || !(b >> 30 & 1)) return false;
  return __get_cpuid_count(7, 1, &a, &b, &c, &d) && (a >> 5 & 1);
}

}  // namespace

int32_t moe_bf16_dot_available(void) { return has_avx512_bf16() ? 0 : 1; }

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

constexpr int kMaxRows = 6;  // rows per register block (x 4 column tiles: 24 accumulators)
// No software prefetch: the hardware prefetchers alone fetch the n tile streams faster. A
// prefetch 4 KiB ahead of each stream (a cache line per k pair and tile) measured 4-11% slower
// at one and four rows on gpt-oss-20b's and Qwen3-30B-A3B's projections and LM heads, 6-9% on
// Qwen3-30B-A3B-shaped bf16 experts, and 2-11% on the bench model's linears and experts at 1-64
// rows (bench/NOTES.md section 27), as on the tiles (amx_gemm.h block_1xn).

// c[m][j * 16 + col] (ldc floats per row) = sum over K of row m of a times tile j, for
// m < R, j < N; rows[m] is row m's first value.
template <int R, int N>
inline __attribute__((always_inline)) void dot_block(const uint16_t* const* rows,
                                                     const uint16_t* const* b, int64_t K,
                                                     float* c, int64_t ldc) {
  __m512 acc[R][N];
  for (int m = 0; m < R; ++m) {
    for (int j = 0; j < N; ++j) acc[m][j] = _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < K / 2; ++p) {
    __m512bh w[N];
    for (int j = 0; j < N; ++j) {
      w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(b[j] + p * 32));
    }
    for (int m = 0; m < R; ++m) {
      int32_t pair;
      std::memcpy(&pair, rows[m] + 2 * p, sizeof pair);
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
      for (int j = 0; j < N; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], x, w[j]);
    }
  }
  for (int m = 0; m < R; ++m) {
    for (int j = 0; j < N; ++j) _mm512_storeu_ps(c + m * ldc + j * 16, acc[m][j]);
  }
}

template <int N>
void dot_rows(const uint16_t* const* rows, int r, const uint16_t* const* b, int64_t K, float* c,
              int64_t ldc) {
  switch (r) {
    case 1: dot_block<1, N>(rows, b, K, c, ldc); break;
    case 2: dot_block<2, N>(rows, b, K, c, ldc); break;
    case 3: dot_block<3, N>(rows, b, K, c, ldc); break;
    case 4: dot_block<4, N>(rows, b, K, c, ldc); break;
    case 5: dot_block<5, N>(rows, b, K, c, ldc); break;
    default: dot_block<6, N>(rows, b, K, c, ldc); break;
  }
}

}  // namespace

namespace moe_engine::amx {

void dot_block_rows(const uint16_t* const* a, int rows, int64_t lda, const uint16_t* const* b,
                    int n, int64_t K, float* c, int64_t ldc) {
  for (int m0 = 0; m0 < rows; m0 += kMaxRows) {
    const int r = std::min(kMaxRows, rows - m0);
    const uint16_t* row[kMaxRows];
    for (int m = 0; m < r; ++m) {
      const int at = m0 + m;
      row[m] = a[at / 16] + (at % 16) * lda;
    }
    float* out = c + m0 * ldc;
    switch (n) {
      case 1: dot_rows<1>(row, r, b, K, out, ldc); break;
      case 2: dot_rows<2>(row, r, b, K, out, ldc); break;
      case 3: dot_rows<3>(row, r, b, K, out, ldc); break;
      default: dot_rows<4>(row, r, b, K, out, ldc); break;
    }
  }
}

}  // namespace moe_engine::amx

namespace {

// lane i = the sum of a[i]'s 16 lanes, in a fixed order: pairs within 128-bit lanes, then
// pairs of those, then across the four 128-bit lanes (as q4_avx512_x8.h's x8_store_columns).
inline __attribute__((always_inline)) __m512 sum_lanes16(const __m512 (&a)[16]) {
  __m512 r1[8], r2[4];
  for (int i = 0; i < 8; ++i) {
    r1[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                          _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // 128-bit lane: partial sums of a[4i .. 4i + 4)
    const __m512d c = _mm512_castps_pd(r1[2 * i]), d = _mm512_castps_pd(r1[2 * i + 1]);
    r2[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(c, d)),
                          _mm512_castpd_ps(_mm512_unpackhi_pd(c, d)));
  }
  auto fold = [](__m512 x, __m512 y) __attribute__((always_inline)) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(x, y, _MM_SHUFFLE(3, 1, 3, 1)));
  };
  return fold(fold(r2[0], r2[1]), fold(r2[2], r2[3]));
}

// Keys ahead of the current group whose rows the scores pass prefetches: 32 measured 1.6-1.8x
// the next group's alone with a batch's K/V in DRAM (64 x 364 keys, 8 layers' caches rotated;
// 16, 48, 64 and 128 slower: bench/NOTES.md section 22).
constexpr int64_t kPrefetchKeys = 32;

// 16 / G keys at a time: their G scores each are the 16 accumulators of sum_lanes16.
template <int G>
void dot_scores(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                const int64_t* rows, int64_t n,
                int64_t D, float scale, float* scores) {
  constexpr int kKeys = 16 / G;
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += kKeys) {
    const int keys = static_cast<int>(std::min<int64_t>(kKeys, n - j0));
    const uint16_t* k[kKeys];
    for (int jj = 0; jj < kKeys; ++jj) k[jj] = k_cache + rows[j0 + std::min(jj, keys - 1)];
    // the rows of the group kPrefetchKeys keys ahead (slots 256 bytes and more apart, blocks
    // anywhere in the pool: the hardware prefetchers do not follow them across pages)
    for (int jj = 0; jj < kKeys && j0 + kPrefetchKeys + jj < n; ++jj) {
      const int64_t at = rows[j0 + kPrefetchKeys + jj];
      const char* next = reinterpret_cast<const char*>(k_cache + at);
      for (int64_t off = 0; off < D * 2; off += 64) _mm_prefetch(next + off, _MM_HINT_T0);
      if (v_cache) {  // the values pass reads the same rows of v_cache next: into L2 now
        const char* value = reinterpret_cast<const char*>(v_cache + at);
        for (int64_t off = 0; off < D * 2; off += 64) _mm_prefetch(value + off, _MM_HINT_T1);
      }
    }
    __m512 acc[16];
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 32) {
      for (int jj = 0; jj < kKeys; ++jj) {
        const __m512bh kv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(k[jj] + d));
        for (int g = 0; g < G; ++g) {
          const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + g * D + d));
          acc[jj * G + g] = _mm512_dpbf16_ps(acc[jj * G + g], kv, qv);
        }
      }
    }
    alignas(64) float out[16];
    _mm512_store_ps(out, _mm512_mul_ps(sum_lanes16(acc), vscale));
    for (int jj = 0; jj < keys; ++jj) {
      for (int g = 0; g < G; ++g) scores[g * n + j0 + jj] = out[jj * G + g];
    }
  }
}

}  // namespace

namespace moe_engine {

void dot_decode_scores(const uint16_t* q, const uint16_t* k_cache, const uint16_t* v_cache,
                       const int64_t* rows,
                       int64_t n, int64_t G, int64_t D, float scale, float* scores) {
  switch (G) {
    case 1: dot_scores<1>(q, k_cache, v_cache, rows, n, D, scale, scores); break;
    case 2: dot_scores<2>(q, k_cache, v_cache, rows, n, D, scale, scores); break;
    case 4: dot_scores<4>(q, k_cache, v_cache, rows, n, D, scale, scores); break;
    case 8: dot_scores<8>(q, k_cache, v_cache, rows, n, D, scale, scores); break;
    default: dot_scores<16>(q, k_cache, v_cache, rows, n, D, scale, scores); break;
  }
}

}  // namespace moe_engine

#pragma GCC pop_options
