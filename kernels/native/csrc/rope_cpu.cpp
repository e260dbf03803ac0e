// The attention prologue of a decoder layer in one native call: split the fused QKV output,
// RMSNorm q and k per head (Qwen3's q_norm / k_norm; optional), rotate both (RoPE, Su et al.
// 2021, "RoFormer", in the rotate-half form of transformers' `apply_rotary_pos_emb`), write k
// and v into their KV-cache slots, and return q. In torch this is about 25 ops per layer
// (split, views, two norms, two rotations of six ops each, two casts and index_copy_s), each
// ~3-8 us of dispatch at decode sizes; here it is one pass over the T rows.
//
// Rounding is torch's op by op, so the result is bit-identical to the torch path
// (moe_engine/models/layers/decoder.py `Attention`, rotary.py `_rotate`): the norm as
// ops_cpu.cpp's rms_norm; cos and sin rounded to x's dtype; x * cos and rotate_half(x) * sin
// each rounded to x's dtype, then their sum rounded (never a fused multiply-add: `rounded`
// keeps GCC, whose C++ default is -ffp-contract=fast, from contracting a * b + c).

#include <cmath>
#include <cstdint>
#include <new>
#include <type_traits>

#include "cpu_common.h"
#include "moe_engine_cpu.h"

namespace {

using moe_engine::bf16_t;
using moe_engine::from_f32;
using moe_engine::to_f32;

// v rounded to T, as a torch op of dtype T rounds its result. For float32 the empty asm makes v
// a value in a register, so that a product is rounded before it is added (no contraction into
// an FMA); a bfloat16 rounding goes through the value's bits (integer operations), which no
// contraction crosses, so it needs no barrier and its loops vectorise.
template <typename T>
inline T round_to(float v) {
  if constexpr (std::is_same_v<T, float>) asm("" : "+x"(v));
  return from_f32<T>(v);
}

// One rotated value: x * cos + rot * sin, each product and the sum rounded to T, cos and sin
// rounded to T first.
template <typename T>
inline T rope_one(float x, float rot, float c, float s) {
  const float a = to_f32(round_to<T>(x * to_f32(round_to<T>(c))));
  const float b = to_f32(round_to<T>(rot * to_f32(round_to<T>(s))));
  return round_to<T>(a + b);
}

// One head's D values: RMSNorm (if w) then rotate-half RoPE with cos/sin rows c, s -> out.
template <typename T>
void norm_rope_head(const T* x, int64_t D, const T* w, float eps, const float* c,
                    const float* s, float* scratch, T* out) {
  for (int64_t d = 0; d < D; ++d) scratch[d] = to_f32(x[d]);
  if (w) {
    const float sum = moe_engine::sum_squares(scratch, D);  // as ops_cpu.cpp's rms_norm
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
    for (int64_t d = 0; d < D; ++d) {
      const float h = to_f32(round_to<T>(scratch[d] * inv));
      scratch[d] = to_f32(round_to<T>(to_f32(w[d]) * h));
    }
  }
  // out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]); the two
  // halves in separate loops (no per-element select)
  const int64_t half = D / 2;
  for (int64_t d = 0; d < half; ++d) {
    out[d] = rope_one<T>(scratch[d], -scratch[d + half], c[d], s[d]);
  }
  for (int64_t d = half; d < D; ++d) {
    out[d] = rope_one<T>(scratch[d], scratch[d - half], c[d], s[d]);
  }
}

template <typename T>
void prologue(const T* qkv, int64_t T_, int64_t Hq, int64_t Hkv, int64_t D,
              const int64_t* positions, const float* cos, const float* sin, const T* qw,
              const T* kw, float eps, T* kc, T* vc, const int64_t* slots, T* q_out,
              int threads) {
  const int64_t width = (Hq + 2 * Hkv) * D;
  moe_engine::parallel_for(T_, 16, threads, [&](int64_t begin, int64_t end) {
    moe_engine::Buffer scratch = moe_engine::make_buffer(D);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const float* c = cos + positions[t] * D;
      const float* s = sin + positions[t] * D;
      for (int64_t h = 0; h < Hq; ++h)
        norm_rope_head(row + h * D, D, qw, eps, c, s, scratch.get(), q_out + (t * Hq + h) * D);
      T* k_slot = kc + slots[t] * Hkv * D;
      T* v_slot = vc + slots[t] * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h)
        norm_rope_head(row + (Hq + h) * D, D, kw, eps, c, s, scratch.get(), k_slot + h * D);
      const T* v = row + (Hq + Hkv) * D;
      for (int64_t i = 0; i < Hkv * D; ++i) v_slot[i] = v[i];
    }
  });
}

}  // namespace

// Shapes and dtypes are checked by kernels/dense/ops.py; positions and slots here (contents).
int32_t moe_qk_norm_rope_cache(const void* qkv, int32_t bf16, int64_t T, int64_t Hq, int64_t Hkv,
                               int64_t D, const int64_t* positions, const float* cos,
                               const float* sin, int64_t P, const void* q_norm,
                               const void* k_norm, float eps, void* k_cache, void* v_cache,
                               int64_t S, const int64_t* slot_mapping, void* q_out,
                               int32_t threads) {
  for (int64_t t = 0; t < T; ++t) {
    if (positions[t] < 0 || positions[t] >= P) return kBadArgument;
    if (slot_mapping[t] < 0 || slot_mapping[t] >= S) return kBadArgument;
  }
  if (T == 0 || D % 2) return T == 0 ? kOk : kBadArgument;
  try {
    if (bf16) {
      prologue(static_cast<const bf16_t*>(qkv), T, Hq, Hkv, D, positions, cos, sin,
               static_cast<const bf16_t*>(q_norm), static_cast<const bf16_t*>(k_norm), eps,
               static_cast<bf16_t*>(k_cache), static_cast<bf16_t*>(v_cache), slot_mapping,
               static_cast<bf16_t*>(q_out), threads);
    } else {
      prologue(static_cast<const float*>(qkv), T, Hq, Hkv, D, positions, cos, sin,
               static_cast<const float*>(q_norm), static_cast<const float*>(k_norm), eps,
               static_cast<float*>(k_cache), static_cast<float*>(v_cache), slot_mapping,
               static_cast<float*>(q_out), threads);
    }
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  return kOk;
}
