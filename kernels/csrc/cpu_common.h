// Shared helpers of the native CPU kernels: bfloat16 conversions, aligned scratch buffers and
// a parallel-for with ATen's chunking (on the pool of thread_pool.h).
//
// The kernels include no torch, ATen or pybind11 header (those made every translation unit
// take ~35 s to compile); tensors arrive as raw pointers and sizes through the C ABI of
// moe_engine_cpu.h, checked on the Python side (kernels/cpu_*.py).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

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
