// Decode attention over the paged KV cache on a CPU: one query token per sequence.
//
// The Python side is kernels/cpu_attention.py (argument checks, docstrings). Algorithm:
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

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

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

inline float to_f32(float v) { return v; }
inline float to_f32(at::BFloat16 v) { return static_cast<float>(v); }

template <typename C>
const C* cache_ptr(const torch::Tensor& t) {
  if constexpr (std::is_same_v<C, float>) return t.data_ptr<float>();
  else return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>());
}

template <typename Q, typename C, typename O>
void decode_attention(const Q* q, const C* k_cache, const C* v_cache, const int64_t* tables,
                      int64_t table_width, const int64_t* seq_lens, const float* sinks,
                      int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t block_size,
                      int64_t window, float scale, O* out) {
  const int64_t G = Hq / Hkv;
  const int64_t row_stride = Hkv * D;  // elements between consecutive slots of one block
  const int threads = at::get_num_threads();
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> qf(G * D), acc(G * D), scores, denom(G);
    std::vector<int64_t> rows;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hkv; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t L = seq_lens[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - first;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d)
          qf[g * D + d] = to_f32(q[(b * Hq + h * G + g) * D + d]) * scale;
      scores.resize(G * std::max<int64_t>(n, 1));
      const int64_t* table = tables + b * table_width;
      // element offset of each visible key's row of head h (one division per key and item)
      rows.resize(std::max<int64_t>(n, 1));
      for (int64_t j = 0; j < n; ++j) {
        const int64_t pos = first + j;
        rows[j] = (table[pos / block_size] * block_size + pos % block_size) * row_stride + h * D;
      }
      // pass 1: scores[g][j] = q_g . k_{first + j}
      for (int64_t j = 0; j < n; ++j) {
        const C* kr = k_cache + rows[j];
        if (j + 4 < n) _mm_prefetch(reinterpret_cast<const char*>(k_cache + rows[j + 4]),
                                    _MM_HINT_T0);
        int64_t g = 0;
        for (; g + 4 <= G; g += 4) {  // four heads at once, reduced together by hadd
          const float* qg = qf.data() + g * D;
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
          const float* qg = qf.data() + g * D;
          for (int64_t d = 0; d < D; d += 8)
            s = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), load8(kr + d), s);
          scores[g * n + j] = hsum(s);
        }
      }
      // softmax per query head (the sink, when given, is one more logit without a value)
      for (int64_t g = 0; g < G; ++g) {
        float* sg = scores.data() + g * n;
        const float sink = sinks ? sinks[h * G + g] : -std::numeric_limits<float>::infinity();
        const float mx = max_of(sg, n, sink);
        denom[g] = exp_shift_sum(sg, n, mx) + (sinks ? std::exp(sink - mx) : 0.0f);
      }
      // pass 2: acc[g] = sum_j p[g][j] * v_{first + j}, two heads x 32 columns in registers
      for (int64_t d0 = 0; d0 < D; d0 += 32) {
        const int nv = static_cast<int>(std::min<int64_t>(32, D - d0) / 8);
        for (int64_t g = 0; g < G; g += 2) {
          const float* p0 = scores.data() + g * n;
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
            _mm256_storeu_ps(acc.data() + g * D + d0 + 8 * v, a0[v]);
            if (g + 1 < G) _mm256_storeu_ps(acc.data() + (g + 1) * D + d0 + 8 * v, a1[v]);
          }
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        const float inv = denom[g] > 0.0f ? 1.0f / denom[g] : 0.0f;
        O* o = out + (b * Hq + h * G + g) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<O>(acc[g * D + d] * inv);
      }
    }
  }
}

// q [B, Hq, D] (float32 or bfloat16, contiguous); k_cache, v_cache [num_blocks, block_size,
// Hkv, D] (float32 or bfloat16, same dtype, contiguous); block_tables [B, W] int64; seq_lens
// [B] int64 (keys of each sequence, its query at position seq_len - 1); sinks [Hq] float32 or
// empty; window 0 for full attention. Returns [B, Hq, D] in q's dtype.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor seq_lens, torch::Tensor sinks, int64_t window,
                                     double scale) {
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "k_cache/v_cache must be contiguous [num_blocks, block_size, Hkv, D], one dtype");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 8 == 0, "head_dim must match and be a multiple of 8");
  TORCH_CHECK(Hq % Hkv == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B &&
                  block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous(),
              "block_tables must be contiguous int64 [B, W]");
  TORCH_CHECK(seq_lens.numel() == B && seq_lens.scalar_type() == torch::kInt64 &&
                  seq_lens.is_contiguous(), "seq_lens must be contiguous int64 [B]");
  const int64_t W = block_tables.size(1);
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * block_size, "seq_lens out of the block table");
  const float* sk = nullptr;
  torch::Tensor sinks_f;
  if (sinks.numel()) {
    TORCH_CHECK(sinks.numel() == Hq, "sinks must be [Hq]");
    sinks_f = sinks.to(torch::kFloat32).contiguous();
    sk = sinks_f.data_ptr<float>();
  }
  auto out = torch::empty_like(q);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  const bool q_bf16 = q.scalar_type() == torch::kBFloat16;
  const bool c_bf16 = k_cache.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(q_bf16 || q.scalar_type() == torch::kFloat32, "q must be float32 or bfloat16");
  TORCH_CHECK(c_bf16 || k_cache.scalar_type() == torch::kFloat32,
              "the KV cache must be float32 or bfloat16");
  if (c_bf16) {
    const uint16_t* kc = cache_ptr<uint16_t>(k_cache);
    const uint16_t* vc = cache_ptr<uint16_t>(v_cache);
    if (q_bf16)
      decode_attention(q.data_ptr<at::BFloat16>(), kc, vc, tables, W, lens, sk, B, Hq, Hkv, D,
                       block_size, window, sc, out.data_ptr<at::BFloat16>());
    else
      decode_attention(q.data_ptr<float>(), kc, vc, tables, W, lens, sk, B, Hq, Hkv, D,
                       block_size, window, sc, out.data_ptr<float>());
  } else {
    const float* kc = k_cache.data_ptr<float>();
    const float* vc = v_cache.data_ptr<float>();
    if (q_bf16)
      decode_attention(q.data_ptr<at::BFloat16>(), kc, vc, tables, W, lens, sk, B, Hq, Hkv, D,
                       block_size, window, sc, out.data_ptr<at::BFloat16>());
    else
      decode_attention(q.data_ptr<float>(), kc, vc, tables, W, lens, sk, B, Hq, Hkv, D,
                       block_size, window, sc, out.data_ptr<float>());
  }
  return out;
}

}  // namespace

// Adds this file's functions to the extension module (module.cpp).
void register_paged_attention(pybind11::module_& m) {
  m.def("paged_decode_attention", &paged_decode_attention,
        "Decode attention over the paged KV cache (CPU, AVX2)",
        py::call_guard<py::gil_scoped_release>());
}
