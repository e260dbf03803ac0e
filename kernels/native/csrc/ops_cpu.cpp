// Small fused CPU ops of the decoder layer, one native call instead of several torch ops each.
//
// The Python side is kernels/dense/ops.py (argument checks; the C ABI is moe_engine_cpu.h). On
// the project's 2-core machine every torch op costs about 8-10 us of dispatch, so RMSNorm
// written as six torch ops (float, pow, mean, add, rsqrt, mul, mul) takes ~65 us on an [8, 512]
// input; fused it is one pass over the rows.
//
// rms_norm: y = x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization"), statistics in float32, with the rounding of Hugging Face transformers'
// Qwen3/Mixtral `RMSNorm`: the normalised value is cast to x's dtype before the multiply by the
// weight (or, with weight_in_float32, the product is formed in float32 and cast once: gpt-oss).
//
// The routers' top-k expert selection (topk_row): k passes of an argmax over the row, each pass
// taking the first (lowest-index) maximum among the values not yet taken: the first k entries of
// a stable descending sort (the order Hugging Face transformers' torch.topk leaves unspecified
// for ties), without sorting all N. O(k N) per row; k <= 8 and N <= 256 for the models served.
//
// router_softmax_topk: the softmax-then-top-k routing of Qwen3-MoE and Mixtral (transformers'
// `Qwen3MoeSparseMoeBlock`): softmax over the E logits in float32 (the row's
// maximum subtracted, std::exp, the sum taken left to right, each term divided by it), the
// stable top-k above, then optionally the k values divided by their left-to-right sum. Not
// bit-identical to torch's vectorised softmax (within a relative 2e-6 of a float64 one,
// tests/test_router_topk.py); a native-cpu FusedMoE routes every step through it (the decode
// layer of decode_layer.cpp included), so a token's experts do not depend on the step it runs
// in.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cpu_common.h"
#include "gemm.h"
#include "moe_engine_cpu.h"

namespace {

using moe_engine::bf16_t;
using moe_engine::from_f32;
using moe_engine::to_f32;

template <typename T>
void rms_rows(const T* x, int64_t A, int64_t B, int64_t D, int64_t sa, int64_t sb,
              const T* w, float eps, bool weight_in_float32, T* y, int threads) {
  using moe_engine::load_f32x8;
  using moe_engine::store_f32x8;
  constexpr bool kBf16 = std::is_same_v<T, bf16_t>;
  moe_engine::parallel_for(A * B, 64, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + (r / B) * sa + (r % B) * sb;
      T* out = y + r * D;
      const float sum = moe_engine::sum_squares(row, D);
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
      // out = w * h (weight_in_float32 or float32), else w * bf16(h); h = x * inv
      const __m256 vinv = _mm256_set1_ps(inv);
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) {
        __m256 h = _mm256_mul_ps(load_f32x8(row + d), vinv);
        if (kBf16 && !weight_in_float32) {
          h = _mm256_castsi256_ps(_mm256_slli_epi32(moe_engine::round_bf16x8(h), 16));
        }
        store_f32x8(out + d, _mm256_mul_ps(load_f32x8(w + d), h));
      }
      for (; d < D; ++d) {
        const float h = to_f32(row[d]) * inv;
        if (weight_in_float32) {
          out[d] = from_f32<T>(to_f32(w[d]) * h);
        } else {
          out[d] = from_f32<T>(to_f32(w[d]) * to_f32(from_f32<T>(h)));
        }
      }
    }
  });
}

// Whether a ranks above b in a descending sort: larger, or NaN over a number (torch.sort).
inline bool ranks_above(float a, float b) {
  return a > b || (std::isnan(a) && !std::isnan(b));
}

void topk_row(const float* row, int64_t N, int64_t k, float* values, int32_t* ids) {
  bool taken[4096];
  std::fill(taken, taken + N, false);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t n = 0; n < N; ++n) {
      if (!taken[n] && (best < 0 || ranks_above(row[n], row[best]))) best = n;
    }
    taken[best] = true;
    values[j] = row[best];
    ids[j] = static_cast<int32_t>(best);
  }
}

template <typename T>
void router_rows(const T* logits, int64_t rows, int64_t E, int64_t k, bool renormalize,
                 float* weights, int32_t* ids, int threads) {
  moe_engine::parallel_for(rows, 64, threads, [&](int64_t begin, int64_t end) {
    float probs[4096];
    for (int64_t t = begin; t < end; ++t) {
      const T* row = logits + t * E;
      float top = -INFINITY;
      for (int64_t e = 0; e < E; ++e) top = std::max(top, to_f32(row[e]));
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) {
        probs[e] = std::exp(to_f32(row[e]) - top);  // NaN in, NaN out: as torch's softmax
        sum += probs[e];
      }
      for (int64_t e = 0; e < E; ++e) probs[e] /= sum;
      float* w = weights + t * k;
      topk_row(probs, E, k, w, ids + t * k);
      if (renormalize) {
        float picked = 0.0f;
        for (int64_t j = 0; j < k; ++j) picked += w[j];
        for (int64_t j = 0; j < k; ++j) w[j] /= picked;
      }
    }
  });
}

}  // namespace

int32_t moe_engine_abi_version(void) { return 10; }

// gemm.h: 512 in the AVX-512 variant, 256 in the AVX2 one.
int32_t moe_engine_vector_bits(void) { return MOE_ENGINE_VECTOR_BITS; }

// The shapes are checked by kernels/dense/ops.py.
int32_t moe_rms_norm(const void* x, int64_t A, int64_t B, int64_t D, int64_t sa, int64_t sb,
                     const void* weight, float eps, int32_t weight_in_float32, int32_t bf16,
                     void* y, int32_t threads) {
  if (A * B * D == 0) return kOk;
  if (bf16) {
    rms_rows(static_cast<const bf16_t*>(x), A, B, D, sa, sb, static_cast<const bf16_t*>(weight),
             eps, weight_in_float32 != 0, static_cast<bf16_t*>(y), threads);
  } else {
    rms_rows(static_cast<const float*>(x), A, B, D, sa, sb, static_cast<const float*>(weight),
             eps, weight_in_float32 != 0, static_cast<float*>(y), threads);
  }
  return kOk;
}

int32_t moe_router_softmax_topk(const void* logits, int32_t bf16, int64_t T, int64_t E,
                                int64_t k, int32_t renormalize, float* weights, int32_t* ids,
                                int32_t threads) {
  if (k < 1 || k > E || E > 4096 || T < 0) return kBadArgument;
  if (bf16) {
    router_rows(static_cast<const bf16_t*>(logits), T, E, k, renormalize != 0, weights, ids,
                threads);
  } else {
    router_rows(static_cast<const float*>(logits), T, E, k, renormalize != 0, weights, ids,
                threads);
  }
  return kOk;
}
