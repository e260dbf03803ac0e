// Decode attention over the paged KV cache on a CPU: one query token per sequence.
//
// The Python side is kernels/attention/native_decode.py (argument checks, docstrings; the C ABI is
// moe_engine_cpu.h). Algorithm:
// PagedAttention (Kwon et al., SOSP'23; vLLM's csrc/cpu/attention.cpp is the CPU reference):
// each sequence's keys and values are read in place through its block table (no gather copy),
// one work item per (sequence, KV head) covering that head's G = Hq / Hkv query heads (GQA,
// Ainslie et al. 2023), two passes: scores q.k * scale for every visible key, then a softmax
// (max-subtracted, float32) and the probability-weighted sum of the values. Optional per-head
// sink logits (gpt-oss; Xiao et al. 2023) join each softmax denominator as a value-less key.
// A sliding window of W tokens makes key positions < L - W invisible (L keys, the query at
// position L - 1), transformers' `sliding_window_overlay` convention.
//
// Vectorised along the head dimension with AVX2/FMA (D a multiple of 8); K/V caches in float32
// or bfloat16 (widened in registers); OpenMP over the work items.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "amx_attention.h"
#include "bf16_dot.h"
#include "cpu_common.h"
#include "moe_engine_cpu.h"

namespace {

using moe_engine::bf16_t;
using moe_engine::from_f32;
using moe_engine::to_f32;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 0x55)));
}

// e^x for 8 floats: Cephes' expf (range reduction by ln 2 split in two constants, degree-5
// polynomial, scaling by 2^n through the exponent bits); relative error ~2e-7 on [-87, 88].
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f),
                                                    _mm256_set1_ps(0.5f)));
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// In place: s[j] = exp(s[j] - mx) for j < n; returns the sum.
inline float exp_shift_sum(float* s, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 v = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
    _mm256_storeu_ps(s + j, v);
    acc = _mm256_add_ps(acc, v);
  }
  float sum = hsum(acc);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - mx);
    sum += s[j];
  }
  return sum;
}

inline float max_of(const float* s, int64_t n, float init) {
  __m256 m = _mm256_set1_ps(init);
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + j));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float mx = init;
  for (float v : lanes) mx = std::max(mx, v);
  for (; j < n; ++j) mx = std::max(mx, s[j]);
  return mx;
}

#if defined(__AVX512F__)
// The AVX-512 build's values pass (D a multiple of 16): 16 columns per register, four query
// heads at once, so each value row is widened once for four heads.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// acc[g][d0 .. d0 + 16 NV) = sum_j p[g][j] v_j[d0 ..] for heads g0 .. g0 + 3 (< G; a head
// past G repeats the last one and is not stored).
template <int NV, typename C>
inline void values_block(const float* scores, int64_t n, const C* v_cache, const int64_t* rows,
                         int64_t g0, int64_t G, int64_t D, int64_t d0, float* acc) {
  const float* p[4];
  for (int i = 0; i < 4; ++i) p[i] = scores + std::min<int64_t>(g0 + i, G - 1) * n;
  __m512 a[4][NV];
  for (int i = 0; i < 4; ++i)
    for (int v = 0; v < NV; ++v) a[i][v] = _mm512_setzero_ps();
  constexpr int64_t kAhead = 32;  // value rows prefetched ahead (blocks lie anywhere; 8 before)
  for (int64_t j = 0; j < n; ++j) {
    const C* vr = v_cache + rows[j] + d0;
    if (j + kAhead < n) {
      const char* next = reinterpret_cast<const char*>(v_cache + rows[j + kAhead] + d0);
      for (int64_t off = 0; off < NV * 16 * int64_t(sizeof(C)); off += 64)
        _mm_prefetch(next + off, _MM_HINT_T0);
    }
    __m512 x[NV];
    for (int v = 0; v < NV; ++v) x[v] = load16(vr + 16 * v);
    for (int i = 0; i < 4; ++i) {
      const __m512 w = _mm512_set1_ps(p[i][j]);
      for (int v = 0; v < NV; ++v) a[i][v] = _mm512_fmadd_ps(w, x[v], a[i][v]);
    }
  }
  for (int i = 0; i < 4 && g0 + i < G; ++i)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(acc + (g0 + i) * D + d0 + 16 * v, a[i][v]);
}

template <typename C>
inline void weighted_values_512(const float* scores, int64_t n, const C* v_cache,
                                const int64_t* rows, int64_t G, int64_t D, float* acc) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    int64_t d0 = 0;
    for (; d0 + 64 <= D; d0 += 64)
      values_block<4>(scores, n, v_cache, rows, g0, G, D, d0, acc);
    for (; d0 < D; d0 += 16) values_block<1>(scores, n, v_cache, rows, g0, G, D, d0, acc);
  }
}
#endif

// The scores in float32 FMAs (AVX2): scores[g * n + j] = qf_g . k_j, qf [G][D] float32 (q
// times the scale), key j's row at k_cache + rows[j].
template <typename C>
void scores_fma(const float* qf, const C* k_cache, const int64_t* rows, int64_t n, int64_t G,
                int64_t D, float* scores) {
  for (int64_t j = 0; j < n; ++j) {
    const C* kr = k_cache + rows[j];
    if (j + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(k_cache + rows[j + 4]),
                                _MM_HINT_T0);
    int64_t g = 0;
    for (; g + 4 <= G; g += 4) {  // four heads at once, reduced together by hadd
      const float* qg = qf + g * D;
      __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 kv = load8(kr + d);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), kv, s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + D + d), kv, s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 2 * D + d), kv, s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 3 * D + d), kv, s3);
      }
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
      alignas(16) float four[4];
      _mm_store_ps(four, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
      for (int i = 0; i < 4; ++i) scores[(g + i) * n + j] = four[i];
    }
    for (; g < G; ++g) {
      __m256 s = _mm256_setzero_ps();
      const float* qg = qf + g * D;
      for (int64_t d = 0; d < D; d += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8(kr + d), s);
      scores[g * n + j] = hsum(s);
    }
  }
}

// The values pass in AVX2 FMAs: acc[g][d] = sum_j p[g][j] v_j[d], p = scores [G][n], value j's
// row at v_cache + rows[j]; two heads x 32 columns in registers.
template <typename C>
void weighted_values_256(const float* scores, int64_t n, const C* v_cache, const int64_t* rows,
                         int64_t G, int64_t D, float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    const int nv = static_cast<int>(std::min<int64_t>(32, D - d0) / 8);
    for (int64_t g = 0; g < G; g += 2) {
      const float* p0 = scores + g * n;
      const float* p1 = g + 1 < G ? p0 + n : p0;
      __m256 a0[4], a1[4];
      for (int v = 0; v < 4; ++v) a0[v] = a1[v] = _mm256_setzero_ps();
      if (nv == 4) {
        for (int64_t j = 0; j < n; ++j) {
          const C* vr = v_cache + rows[j] + d0;
          const __m256 w0 = _mm256_set1_ps(p0[j]), w1 = _mm256_set1_ps(p1[j]);
          for (int v = 0; v < 4; ++v) {
            const __m256 x = load8(vr + 8 * v);
            a0[v] = _mm256_fmadd_ps(w0, x, a0[v]);
            a1[v] = _mm256_fmadd_ps(w1, x, a1[v]);
          }
        }
      } else {
        for (int64_t j = 0; j < n; ++j) {
          const C* vr = v_cache + rows[j] + d0;
          const __m256 w0 = _mm256_set1_ps(p0[j]), w1 = _mm256_set1_ps(p1[j]);
          for (int v = 0; v < nv; ++v) {
            const __m256 x = load8(vr + 8 * v);
            a0[v] = _mm256_fmadd_ps(w0, x, a0[v]);
            a1[v] = _mm256_fmadd_ps(w1, x, a1[v]);
          }
        }
      }
      for (int v = 0; v < nv; ++v) {
        _mm256_storeu_ps(acc + g * D + d0 + 8 * v, a0[v]);
        if (g + 1 < G) _mm256_storeu_ps(acc + (g + 1) * D + d0 + 8 * v, a1[v]);
      }
    }
  }
}

// Keys of the next work item that an item prefetches (decode_attention).
constexpr int64_t kNextKeys = 32;

template <typename Q, typename C, typename O>
void decode_attention(const Q* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                      int64_t table_width, const int64_t* seq_lens, const float* sinks,
                      int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                      int64_t window, float scale, int amx, O* out, int threads) {
  const int64_t G = Hq / Hkv;
  // the scores on AMX tiles (amx 1) or AVX512-BF16 (amx 2): bfloat16 queries and cache only
  // (both multiply bfloat16)
  constexpr bool kBf16 = std::is_same_v<Q, bf16_t> && std::is_same_v<C, uint16_t>;
  const bool amx_scores = kBf16 && amx == 1 && moe_engine::amx_scores_fit(D, G, block_size);
  const bool dot_scores = kBf16 && amx == 2 && moe_engine::dot_scores_fit(D, G);
  const int64_t row_stride = Hkv * D;  // elements between consecutive slots of one block
  struct Scratch {
    std::vector<float> qf, acc, scores, denom;
    std::vector<int64_t> rows;
  };
  std::vector<Scratch> scratch(std::max(threads, 1));  // one per pool worker
  for (Scratch& s : scratch) {
    s.qf.resize(G * D);
    s.acc.resize(G * D);
    s.denom.resize(G);
  }
  // The first keys of work item `item` (a pool worker usually claims the next item next):
  // requested while the current item computes, so that its start does not wait on DRAM.
  auto prefetch_first_keys = [&](int64_t item) {
    const int64_t b = item / Hkv, h = item % Hkv, L = seq_lens[b];
    const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    const int64_t* table = tables + b * table_width;
    for (int64_t pos = first; pos < std::min(L, first + kNextKeys); ++pos) {
      const int64_t at =
          (table[pos / block_size] * block_size + pos % block_size) * row_stride + h * D;
      const char* key = reinterpret_cast<const char*>(k_cache + at);
      for (int64_t off = 0; off < D * int64_t(sizeof(C)); off += 64)
        _mm_prefetch(key + off, _MM_HINT_T1);
    }
  };
  moe_engine::parallel_items(B * Hkv, threads, [&](int64_t item, int worker) {
      Scratch& mine = scratch[worker];
      std::vector<float>&qf = mine.qf, &acc = mine.acc, &scores = mine.scores, &denom = mine.denom;
      std::vector<int64_t>& rows = mine.rows;
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t L = seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - first;
      if (!amx_scores && !dot_scores) {  // the FMA scores read q times the scale in float32
        for (int64_t g = 0; g < G; ++g)
          for (int64_t d = 0; d < D; ++d)
            qf[g * D + d] = to_f32(q[(b * Hq + h * G + g) * D + d]) * scale;
      }
      scores.resize(G * std::max<int64_t>(n, 1));
      const int64_t* table = tables + b * table_width;
      // element offset of each visible key's row of head h, block by block
      rows.resize(std::max<int64_t>(n, 1));
      for (int64_t pos = first, j = 0; pos < L;) {
        const int64_t in_block = pos % block_size, len = std::min(block_size - in_block, L - pos);
        const int64_t base = (table[pos / block_size] * block_size + in_block) * row_stride + h * D;
        for (int64_t o = 0; o < len; ++o) rows[j + o] = base + o * row_stride;
        pos += len;
        j += len;
      }
      if (item + 1 < B * Hkv) prefetch_first_keys(item + 1);
      // pass 1: scores[g][j] = q_g . k_{first + j}
      if constexpr (kBf16) {
        const uint16_t* qh = reinterpret_cast<const uint16_t*>(q) + (b * Hq + h * G) * D;
        if (amx_scores)
          moe_engine::amx_decode_scores(qh, k_cache, table, block_size, row_stride, h * D, D, G,
                                        first, L, scale, scores.data());
        if (dot_scores)
          moe_engine::dot_decode_scores(qh, k_cache, v_cache, rows.data(), n, G, D, scale,
                                        scores.data());
      }
      if (!amx_scores && !dot_scores)
        scores_fma(qf.data(), k_cache, rows.data(), n, G, D, scores.data());
      // softmax per query head (the sink, when given, is one more logit without a value)
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float sink = sinks ? sinks[h * G + g] : -std::numeric_limits<float>::infinity();
        const float mx = max_of(sg, n, sink);
        denom[g] = exp_shift_sum(sg, n, mx) + (sinks ? std::exp(sink - mx) : 0.0f);
      }
      // pass 2: acc[g] = sum_j p[g][j] * v_{first + j}
#if defined(__AVX512F__)
      if (D % 16 == 0) {
        weighted_values_512(scores.data(), n, v_cache, rows.data(), G, D, acc.data());
      } else {
        weighted_values_256(scores.data(), n, v_cache, rows.data(), G, D, acc.data());
      }
#else
      weighted_values_256(scores.data(), n, v_cache, rows.data(), G, D, acc.data());
#endif
      for (int64_t g = 0; g < G; ++g) {
        const float inv = denom[g] > 0.0f ? 1.0f / denom[g] : 0.0f;
        O* o = out + (b * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = from_f32<O>(acc[g * D + d] * inv);
      }
  });
}

template <typename C>
void dispatch_q(const void* q, bool q_bf16, const C* kc, const C* vc, const int64_t* tables,
                int64_t W, const int64_t* lens, const float* sinks, int64_t B, int64_t Hq,
                int64_t Hkv, int64_t D, int64_t block_size, int64_t window, float scale,
                int amx, void* out, int threads) {
  if (q_bf16)
    decode_attention(static_cast<const bf16_t*>(q), kc, vc, tables, W, lens, sinks, B, Hq, Hkv,
                     D, block_size, window, scale, amx, static_cast<bf16_t*>(out), threads);
  else
    decode_attention(static_cast<const float*>(q), kc, vc, tables, W, lens, sinks, B, Hq, Hkv,
                     D, block_size, window, scale, amx, static_cast<float*>(out), threads);
}

}  // namespace

// Shapes and dtypes are checked by kernels/attention/native_decode.py; the sequence lengths here (they
// are tensor contents).
int32_t moe_paged_decode_attention(const void* q, int32_t q_bf16, const void* k_cache,
                                   const void* v_cache, int32_t cache_bf16,
                                   const int64_t* block_tables, int64_t W,
                                   const int64_t* seq_lens, const float* sinks, int64_t B,
                                   int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                                   int64_t window, float scale, int32_t amx, void* out,
                                   int32_t threads) {
  for (int64_t b = 0; b < B; ++b)
    if (seq_lens[b] < 1 || seq_lens[b] > W * block_size) return kBadArgument;
  if (cache_bf16)
    dispatch_q(q, q_bf16, static_cast<const uint16_t*>(k_cache),
               static_cast<const uint16_t*>(v_cache), block_tables, W, seq_lens, sinks, B, Hq,
               Hkv, D, block_size, window, scale, amx, out, threads);
  else
    dispatch_q(q, q_bf16, static_cast<const float*>(k_cache), static_cast<const float*>(v_cache),
               block_tables, W, seq_lens, sinks, B, Hq, Hkv, D, block_size, window, scale,
               amx, out, threads);
  return kOk;
}
