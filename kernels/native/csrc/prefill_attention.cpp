// Prefill attention for bfloat16 queries over a bfloat16 paged KV cache, on AVX512-BF16: the
// causal (optionally sliding-window, optionally with sink logits) attention of every query
// token of a batch of prefill chunks over its request's cached keys, in one call.
//
// The Python side is kernels/attention/native_decode.py `paged_prefill_attention` (argument checks; the
// C ABI is moe_engine_cpu.h). Algorithm: FlashAttention's tiling with an online softmax (Dao
// et al., "FlashAttention", NeurIPS 2022; Milakov & Gimelshein, "Online normalizer calculation
// for softmax", 2018), as torch's CPU flash kernel (aten/src/ATen/native/cpu/
// FlashAttentionKernel.cpp) runs it for bfloat16: per (request, KV head) the keys and values
// are packed once into the VNNI pair layout of amx_gemm.h; then per block of 16 query tokens
// (x G query heads = rows), per chunk of 64 keys:
//   S = Q K^T            bfloat16 products, float32 sums (bf16_dot.h dot_block_rows)
//   S * scale, keys outside each query's window [max(0, p - window + 1), p] at -inf
//   m' = max(m, max_j S), P = exp(S - m'), l = l e^(m - m') + sum_j P, O = O e^(m - m')
//   O += bf16(P) V       P rounded once to bfloat16 for the product, as torch's bf16 kernel
// and at the end out = O / (l + e^(sink - m)) rounded to bfloat16. A query sees at least
// itself, so no row is empty. Parallelism: the pool of thread_pool.h over (request, KV head).
//
// Only the functions after the target pragma hold AVX-512 instructions; the Python side calls
// this only where moe_bf16_dot_available() said yes.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "bf16_dot.h"
#include "cpu_common.h"
#include "moe_engine_cpu.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

constexpr int64_t kQueries = 16;  // query tokens per block
constexpr int64_t kKeys = 64;     // keys per chunk (4 column tiles of 16)

struct Dims {
  int64_t Hq, Hkv, G, D, block_size, window;
  float scale;
};

// e^x for 16 floats: Cephes' expf as paged_attention.cpp's exp8 (ln 2 split in two, degree-5
// polynomial, 2^n through the exponent bits); x <= -87.3 gives about 1e-38 (an exact 0 after
// the bfloat16 rounding's flush), x = -inf gives 0.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// 16 float32 -> bfloat16 bits, round to nearest even (NaN does not occur: finite scores).
inline __m256i to_bf16x16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(
      _mm512_add_epi32(_mm512_add_epi32(u, lsb), _mm512_set1_epi32(0x7FFF)), 16);
  return _mm512_cvtepi32_epi16(r);
}

// One (request, KV head): keys [kfirst, L) packed, then the query blocks.
struct Head {
  const uint16_t* q;  // the request's first query token, [Lq][Hq][D]
  uint16_t* out;      // likewise
  int64_t Lq, L, kfirst, h, request;
};

// Kp: [Lkp/16][D/2][16] pairs of keys' dims (tile of 16 keys, K = D); Vp: [D/16][Lkp/2][16]
// pairs of keys (tile of 16 dims, K = keys); keys past Lk zero.
void pack_kv(const uint16_t* kc, const uint16_t* vc, const int64_t* table, const Head& hd,
             const Dims& d, int64_t Lkp, uint32_t* Kp, uint16_t* Vp) {
  const int64_t D = d.D, Lk = hd.L - hd.kfirst;
  std::memset(Kp, 0, Lkp * D * sizeof(uint16_t));
  std::memset(Vp, 0, Lkp * D * sizeof(uint16_t));
  for (int64_t j = 0; j < Lk; ++j) {
    const int64_t pos = hd.kfirst + j;
    const int64_t slot = table[pos / d.block_size] * d.block_size + pos % d.block_size;
    const int64_t row = (slot * d.Hkv + hd.h) * D;
    uint32_t pairs[128];  // D <= 256
    std::memcpy(pairs, kc + row, D * sizeof(uint16_t));
    uint32_t* kt = Kp + (j / 16) * (D / 2) * 16 + j % 16;
    for (int64_t p = 0; p < D / 2; ++p) kt[p * 16] = pairs[p];
    const uint16_t* v = vc + row;
    uint16_t* vt = Vp + ((j / 2) * 16) * 2 + j % 2;
    for (int64_t x = 0; x < D; ++x) vt[((x / 16) * (Lkp / 2) * 16 + x % 16) * 2] = v[x];
  }
}

// The rows' online-softmax update for one chunk of S [M][64] at keys [c0, c0 + 64): masks,
// rescales O [M][D] and writes P [M][64] bfloat16.
void softmax_chunk(float* S, int64_t M, int64_t c0, const Head& hd, int64_t i0, const Dims& d,
                   float* m, float* l, float* O, uint16_t* P) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t pos = hd.L - hd.Lq + i0 + r / d.G;  // this row's query position
    const int64_t hi = pos - hd.kfirst;  // local key index of the query itself
    const int64_t lo = d.window > 0 ? std::max<int64_t>(0, pos - d.window + 1 - hd.kfirst) : 0;
    float* s = S + r * kKeys;
    __m512 vmax = _mm512_set1_ps(ninf);
    __mmask16 in[kKeys / 16];
    for (int64_t t = 0; t < kKeys; t += 16) {
      const __m512i key = _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int>(c0 + t)));
      in[t / 16] = _mm512_cmpge_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(lo))) &
                   _mm512_cmple_epi32_mask(key, _mm512_set1_epi32(static_cast<int>(hi)));
      const __m512 v = _mm512_mask_mul_ps(_mm512_set1_ps(ninf), in[t / 16],
                                          _mm512_loadu_ps(s + t), _mm512_set1_ps(d.scale));
      _mm512_storeu_ps(s + t, v);
      vmax = _mm512_max_ps(vmax, v);
    }
    const float cmax = _mm512_reduce_max_ps(vmax);
    uint16_t* p = P + r * kKeys;
    if (cmax == ninf) {  // no visible key in this chunk for this row
      std::memset(p, 0, kKeys * sizeof(uint16_t));
      continue;
    }
    const float mnew = std::max(m[r], cmax);
    const float alpha = m[r] == ninf ? 0.0f : std::exp(m[r] - mnew);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < kKeys; t += 16) {
      const __m512 e = _mm512_maskz_mov_ps(  // masked keys: exactly 0
          in[t / 16], exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(mnew))));
      sum = _mm512_add_ps(sum, e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), to_bf16x16(e));
    }
    l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
    m[r] = mnew;
    float* o = O + r * d.D;
    for (int64_t x = 0; x < d.D; x += 16)
      _mm512_storeu_ps(o + x, _mm512_mul_ps(_mm512_loadu_ps(o + x), _mm512_set1_ps(alpha)));
  }
}

// Scratch of one worker, in floats / uint16 (sizes for the longest request's keys).
struct Work {
  uint32_t* Kp;
  uint16_t *Vp, *A, *P;
  float *S, *O, *PV, *m, *l;
};

void attend_head(const uint16_t* kc, const uint16_t* vc, const int64_t* table,
                 const float* sinks, const Head& hd, const Dims& d, const Work& w) {
  const int64_t D = d.D, G = d.G, Lk = hd.L - hd.kfirst;
  const int64_t Lkp = (Lk + kKeys - 1) / kKeys * kKeys;
  pack_kv(kc, vc, table, hd, d, Lkp, w.Kp, w.Vp);
  const uint16_t* Kp16 = reinterpret_cast<const uint16_t*>(w.Kp);
  for (int64_t i0 = 0; i0 < hd.Lq; i0 += kQueries) {
    const int64_t nq = std::min(kQueries, hd.Lq - i0), M = nq * G;
    for (int64_t i = 0; i < nq; ++i)  // rows (query, head g) of the block, contiguous
      std::memcpy(w.A + i * G * D, hd.q + ((i0 + i) * d.Hq + hd.h * G) * D,
                  G * D * sizeof(uint16_t));
    std::fill(w.m, w.m + M, -std::numeric_limits<float>::infinity());
    std::fill(w.l, w.l + M, 0.0f);
    std::fill(w.O, w.O + M * D, 0.0f);
    const uint16_t* a[kQueries * 16];
    const uint16_t* p_rows[kQueries * 16];
    for (int64_t t = 0; t * 16 < M; ++t) {
      a[t] = w.A + t * 16 * D;
      p_rows[t] = w.P + t * 16 * kKeys;
    }
    const int64_t last = hd.L - hd.Lq + i0 + nq - 1 - hd.kfirst;  // the block's last key
    const int64_t first_pos = hd.L - hd.Lq + i0;
    const int64_t lo = d.window > 0 ? std::max<int64_t>(0, first_pos - d.window + 1 - hd.kfirst)
                                    : 0;
    for (int64_t c0 = lo / kKeys * kKeys; c0 <= last; c0 += kKeys) {
      const uint16_t* b[4];
      for (int j = 0; j < 4; ++j) b[j] = Kp16 + (c0 / 16 + j) * D * 16;
      moe_engine::amx::dot_block_rows(a, static_cast<int>(M), D, b, 4, D, w.S, kKeys);
      softmax_chunk(w.S, M, c0, hd, i0, d, w.m, w.l, w.O, w.P);
      for (int64_t x0 = 0; x0 < D; x0 += 64) {
        const int n = static_cast<int>(std::min<int64_t>(4, (D - x0) / 16));
        for (int j = 0; j < n; ++j) b[j] = w.Vp + ((x0 / 16 + j) * (Lkp / 2) + c0 / 2) * 32;
        moe_engine::amx::dot_block_rows(p_rows, static_cast<int>(M), kKeys, b, n, kKeys,
                                        w.PV + x0, D);
      }
      for (int64_t e = 0; e < M * D; e += 16)
        _mm512_storeu_ps(w.O + e, _mm512_add_ps(_mm512_loadu_ps(w.O + e),
                                                _mm512_loadu_ps(w.PV + e)));
    }
    for (int64_t r = 0; r < M; ++r) {
      const int64_t i = r / G, g = r % G;
      float denom = w.l[r];
      if (sinks) denom += std::exp(sinks[hd.h * G + g] - w.m[r]);
      const __m512 inv = _mm512_set1_ps(1.0f / denom);
      uint16_t* o = hd.out + ((i0 + i) * d.Hq + hd.h * G + g) * D;
      for (int64_t x = 0; x < D; x += 16) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(w.O + r * D + x), inv);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + x), to_bf16x16(v));
      }
    }
  }
}

struct Scratch {
  moe_engine::Grown<uint16_t> halves;
  moe_engine::Grown<float> floats;
};
thread_local Scratch thread_scratch;

}  // namespace

int32_t moe_prefill_attention(const void* q, const void* k_cache, const void* v_cache,
                              const int64_t* block_tables, int64_t W, const int64_t* seq_lens,
                              const int64_t* query_start_loc, const float* sinks, int64_t B,
                              int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                              int64_t window, float scale, void* out, int32_t threads) {
  if (D % 32 || D > 256 || Hkv < 1 || Hq % Hkv || Hq / Hkv > 16) return kBadArgument;
  const Dims d{Hq, Hkv, Hq / Hkv, D, block_size, window, scale};
  int64_t max_keys = 0;
  std::vector<Head> heads;
  const auto* qp = static_cast<const uint16_t*>(q);
  auto* op = static_cast<uint16_t*>(out);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t L = seq_lens[b], q0 = query_start_loc[b], Lq = query_start_loc[b + 1] - q0;
    if (L < 1 || L > W * block_size || Lq < 0 || Lq > L) return kBadArgument;
    if (Lq == 0) continue;
    const int64_t kfirst = window > 0 ? std::max<int64_t>(0, L - Lq - window + 1) : 0;
    max_keys = std::max(max_keys, L - kfirst);
    for (int64_t h = 0; h < Hkv; ++h)
      heads.push_back({qp + q0 * Hq * D, op + q0 * Hq * D, Lq, L, kfirst, h, b});
  }
  if (heads.empty()) return kOk;
  const int64_t Lkp = (max_keys + kKeys - 1) / kKeys * kKeys, M = kQueries * d.G;
  const int64_t halves = 2 * Lkp * D + M * D + M * kKeys;  // Kp, Vp, A, P
  const int64_t floats = M * kKeys + 2 * M * D + 2 * M;     // S, O, PV, m, l
  const int workers = std::max(threads, 1);
  uint16_t* h16;
  float* f32;
  try {
    h16 = thread_scratch.halves.get(workers * halves);
    f32 = thread_scratch.floats.get(workers * floats);
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  const auto* kc = static_cast<const uint16_t*>(k_cache);
  const auto* vc = static_cast<const uint16_t*>(v_cache);
  moe_engine::parallel_items(static_cast<int64_t>(heads.size()), threads,
                             [&](int64_t item, int worker) {
    uint16_t* hw = h16 + worker * halves;
    float* fw = f32 + worker * floats;
    const Work w{reinterpret_cast<uint32_t*>(hw), hw + Lkp * D, hw + 2 * Lkp * D,
                 hw + 2 * Lkp * D + M * D, fw, fw + M * kKeys, fw + M * kKeys + M * D,
                 fw + M * kKeys + 2 * M * D, fw + M * kKeys + 2 * M * D + M};
    const Head& hd = heads[item];
    attend_head(kc, vc, block_tables + hd.request * W, sinks, hd, d, w);
  });
  return kOk;
}

#pragma GCC pop_options
