// Shared helpers of the native CPU kernels: bfloat16 conversions, aligned scratch buffers and
// a parallel-for with ATen's chunking (on the pool of thread_pool.h).
//
// The kernels include no torch, ATen or pybind11 header (those made every translation unit
// take ~35 s to compile); tensors arrive as raw pointers and sizes through the C ABI of
// moe_engine_cpu.h, checked on the Python side (kernels/cpu_*.py).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>

#include "thread_pool.h"

namespace moe_engine {

// A bfloat16 value: the high half of a float32.
struct bf16_t {
  uint16_t bits;
};

inline float bf16_to_f32(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, NaN to the quiet NaN 0x7FC0: c10::BFloat16(float)'s rounding, so
// results match what torch's bfloat16 tensors hold.
inline uint16_t f32_to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + ((u >> 16) & 1) + 0x7FFF) >> 16);
}

inline float to_f32(float v) { return v; }
inline float to_f32(bf16_t v) { return bf16_to_f32(v.bits); }

template <typename T>
inline T from_f32(float v);
template <>
inline float from_f32<float>(float v) {
  return v;
}
template <>
inline bf16_t from_f32<bf16_t>(float v) {
  return bf16_t{f32_to_bf16(v)};
}

// 8 bfloat16 values widened to float32 (exact).
inline __m256 load_bf16x8(const bf16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load_f32x8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_f32x8(const bf16_t* p) { return load_bf16x8(p); }
inline float load_f32(const float* p) { return *p; }
inline float load_f32(const bf16_t* p) { return bf16_to_f32(p->bits); }

// bfloat16 bits of 8 float32 values in the low halves of 8 int32, rounded to nearest even, NaN
// to 0x7FC0: f32_to_bf16 on each lane.
inline __m256i round_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, lsb), _mm256_set1_epi32(0x7FFF)), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// 8 float32 values stored as float32, or rounded to bfloat16 (round_bf16x8).
inline void store_f32x8(float* dst, __m256 v) { _mm256_storeu_ps(dst, v); }
inline void store_f32x8(bf16_t* dst, __m256 v) {
  const __m256i r = round_bf16x8(v);  // 8 x int32, each < 2^16
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
}

// sum_d x[d]^2 in float32, in one fixed order whatever the build or the caller (RMSNorm's
// statistic: ops_cpu.cpp rms_norm and rope_cpu.cpp's q/k norm must agree bit for bit): 16
// lane-wise sums, x[d] into lane d % 16 by fused multiply-add, up to the last multiple of 16;
// lanes i and i + 8 added, then the 8 as ((0+1)+(2+3))+((4+5)+(6+7)); then the tail in order,
// each by std::fma.
template <typename T>
inline float sum_squares(const T* x, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  int64_t d = 0;
  for (; d + 16 <= D; d += 16) {
    const __m256 v0 = load_f32x8(x + d), v1 = load_f32x8(x + d + 8);
    a0 = _mm256_fmadd_ps(v0, v0, a0);
    a1 = _mm256_fmadd_ps(v1, v1, a1);
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, _mm256_add_ps(a0, a1));
  float sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
  for (; d < D; ++d) {
    const float v = load_f32(x + d);
    sum = std::fma(v, v, sum);
  }
  return sum;
}

// An uninitialised float32 buffer aligned to 64 bytes (a cache line), freed on scope exit.
struct FreeDeleter {
  void operator()(float* p) const { std::free(p); }
};
using Buffer = std::unique_ptr<float[], FreeDeleter>;

// Throws std::bad_alloc when the allocation fails (the C entry points turn it into a status).
inline Buffer make_buffer(int64_t floats) {
  const size_t bytes = (static_cast<size_t>(std::max<int64_t>(floats, 1)) * sizeof(float) + 63) /
                       64 * 64;
  float* p = static_cast<float*>(std::aligned_alloc(64, bytes));
  if (!p) throw std::bad_alloc();
  return Buffer(p);
}

// A grow-only, uninitialised, 64-byte-aligned array of T: a kernel's scratch kept across calls
// (thread_local in the kernel's unit), so that the calls of a step reuse pages already mapped.
template <typename T>
class Grown {
 public:
  // At least n elements (contents unspecified); throws std::bad_alloc.
  T* get(int64_t n) {
    if (n > capacity_) {
      const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
      T* p = static_cast<T*>(std::aligned_alloc(64, bytes));
      if (!p) throw std::bad_alloc();
      data_.reset(p);
      capacity_ = n;
    }
    return data_.get();
  }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> data_;
  int64_t capacity_ = 0;
};

// f(begin, end) over [0, n) in at most `threads` contiguous chunks of at least `grain` items,
// as at::parallel_for splits it; inline when one chunk suffices or inside a pool job.
template <typename F>
inline void parallel_for(int64_t n, int64_t grain, int threads, const F& f) {
  if (n <= 0) return;
  const int64_t chunks = (n + grain - 1) / grain;
  const int t = static_cast<int>(std::min<int64_t>(std::max(threads, 1), chunks));
  const int64_t chunk = (n + t - 1) / t;
  parallel_items(t, t, [&](int64_t i, int) {
    const int64_t begin = i * chunk, end = std::min(n, begin + chunk);
    if (begin < end) f(begin, end);
  });
}

// The experts' activation of (gate, up), shared by every fused-MoE kernel (moe_cpu.cpp,
// amx_moe.cpp): plain SwiGLU, silu(gate) * up (Shazeer 2020, "GLU Variants Improve
// Transformer"), or gpt-oss's clamped variant, (up + 1) * gate * sigmoid(alpha * gate) with
// gate clamped above and up on both sides at `limit` (transformers' `GptOssExperts`).
struct Activation {
  bool clamped;     // gpt-oss: (up + 1) * gate * sigmoid(alpha * gate)
  bool has_limit;   // gpt-oss clamp of gate (max) and up (both sides)
  float alpha;
  float limit;

  inline __attribute__((always_inline)) float operator()(float gate, float up) const {
    if (!clamped) return gate / (1.0f + std::exp(-gate)) * up;
    if (has_limit) {
      gate = std::min(gate, limit);
      up = std::max(-limit, std::min(up, limit));
    }
    return (up + 1.0f) * (gate / (1.0f + std::exp(-alpha * gate)));
  }
};

}  // namespace moe_engine
