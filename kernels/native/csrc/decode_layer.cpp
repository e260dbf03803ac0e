// One pre-norm MoE decoder layer of a decode step as a single native call.
//
// The Python side is kernels/decode_layer/native.py. At decode batch sizes a layer's kernels take
// about 120 us on the project's 2-core AMX machine while the Python around them (module calls,
// argument checks, output allocation, ~25 torch ops) took another ~170 us (bench/NOTES.md
// section 14); this runs the same kernels, in the same order and with the same roundings, from
// C++:
//
//   x = rms_norm(h)                                  moe_rms_norm (the weight multiplied in
//                                                    float32 for gpt-oss)
//   qkv = x W_qkv^T (+ b)                            moe_amx_linear, bfloat16 out (or
//                                                    moe_linear_q4 for 4-bit projections)
//   q = rope(norm(q)); cache <- rope(norm(k)), v     moe_qk_norm_rope_cache
//   a = paged decode attention(q, cache, sinks)      moe_paged_decode_attention (window, sinks)
//   h = h + a W_o^T (+ b)                            moe_amx_linear (or moe_linear_q4); a
//                                                    bfloat16 add
//   x = rms_norm(h)                                  moe_rms_norm
//   logits = x W_router^T (+ b)                      moe_amx_linear, bfloat16 out
//   topk_weights, topk_ids = route(logits)           moe_router_softmax_topk, or top-k then
//                                                    softmax (gpt-oss: moe_router_topk_softmax)
//   h = h + experts(x, topk)                         moe_amx_fused_moe (bfloat16 experts) or
//                                                    moe_fused_moe_q4 (4-bit), with biases and
//                                                    the clamped SwiGLU where given; a bfloat16
//                                                    add
//
// The residual adds round float32(h) + float32(y) to bfloat16 (round to nearest even), which
// is what torch's bfloat16 `h + y` computes. Scratch lives in per-thread buffers that grow to
// the largest step seen.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "cpu_common.h"
#include "moe_engine_cpu.h"

namespace {

using moe_engine::bf16_to_f32;
using moe_engine::f32_to_bf16;

// The most experts per token the top-k-then-softmax routing takes: below the narrowest float
// vector (AVX2's 8), so that ATen's bfloat16 softmax runs its scalar loops (std::exp), which
// topk_softmax_row repeats.
constexpr int64_t kTopkSoftmaxMaxK = 7;

// h[i] = bf16(float(h[i]) + float(y[i])) over n values.
void add_into(uint16_t* h, const uint16_t* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = f32_to_bf16(bf16_to_f32(h[i]) + bf16_to_f32(y[i]));
}

// The step's intermediates, bfloat16: reused across calls and layers on this thread.
struct Scratch {
  std::vector<uint16_t> x, qkv, q, attn, y, logits;

  void size_for(int64_t T, int64_t H, int64_t qkv_n, int64_t q_n, int64_t E) {
    x.resize(T * H);
    qkv.resize(T * qkv_n);
    q.resize(T * q_n);
    attn.resize(T * q_n);
    y.resize(T * H);
    logits.resize(T * E);
  }
};

thread_local Scratch scratch;

// y [T, N] bfloat16 = x [T, K] bfloat16 W^T (+ b): the AMX-packed weight w (format < 0) or the
// 4-bit tiles w / scales of moe_linear_q4's format, group G.
int32_t project(const uint16_t* x, int64_t T, int64_t K, const void* w, const float* b,
                int64_t N, int32_t format, const void* scales, int64_t G, uint16_t* y,
                int32_t tiles, int32_t threads) {
  if (format < 0) return moe_amx_linear(x, T, K, w, N, b, y, 1, tiles, threads);
  return moe_linear_q4(x, 1, T, K, static_cast<const uint8_t*>(w), scales, nullptr, format, G,
                       N, b, y, 1, threads);
}


// One row of gpt-oss's routing as transformers computes it on a CPU in bfloat16
// (`torch.topk(logits, k)`, then `softmax(values, dtype=bfloat16)`), operation for operation:
// ATen's topk_impl_loop for k * 64 > E (std::nth_element over (float value, index) pairs with
// NaN above every number, then std::sort of the first k - 1), and its bfloat16 softmax over the
// k values for k below one float vector (max, std::exp(x - max), a sequential sum, times
// 1 / sum, rounded to bfloat16). The weights are those bfloat16 values widened to float32.
void topk_softmax_row(const uint16_t* logits, int64_t E, int64_t k,
                      std::vector<std::pair<float, int64_t>>& queue, float* weights,
                      int32_t* ids) {
  using elem_t = std::pair<float, int64_t>;
  queue.resize(E);
  for (int64_t j = 0; j < E; ++j) queue[j] = {bf16_to_f32(logits[j]), j};
  auto larger = [](const elem_t& a, const elem_t& b) {
    return (std::isnan(a.first) && !std::isnan(b.first)) || a.first > b.first;
  };
  std::nth_element(queue.begin(), queue.begin() + k - 1, queue.end(), larger);
  std::sort(queue.begin(), queue.begin() + k - 1, larger);
  float values[kTopkSoftmaxMaxK];
  float max_val = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < k; ++j) {
    // the top-k values are bfloat16 in torch: widening them back is exact
    values[j] = queue[j].first;
    max_val = std::max(max_val, values[j]);
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < k; ++j) {
    values[j] = std::exp(values[j] - max_val);
    sum += values[j];
  }
  sum = 1 / sum;
  for (int64_t j = 0; j < k; ++j) {
    weights[j] = bf16_to_f32(f32_to_bf16(values[j] * sum));
    ids[j] = static_cast<int32_t>(queue[j].second);
  }
}

}  // namespace

int32_t moe_router_topk_softmax(const void* logits, int64_t T, int64_t E, int64_t k,
                                float* weights, int32_t* ids) {
  if (T < 0 || k < 1 || k > kTopkSoftmaxMaxK || k * 64 <= E) return kBadArgument;
  thread_local std::vector<std::pair<float, int64_t>> queue;
  const uint16_t* l = static_cast<const uint16_t*>(logits);
  try {
    for (int64_t t = 0; t < T; ++t) {
      topk_softmax_row(l + t * E, E, k, queue, weights + t * k, ids + t * k);
    }
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  return kOk;
}

namespace {

// x -> y [T, H] = experts(x, topk): moe_fused_moe_q4 (q4) or moe_amx_fused_moe, with the
// experts' biases and activation.
int32_t run_experts(const uint16_t* x, int64_t T, int64_t H, int64_t E, int64_t I,
                    int64_t k, const float* topk_weights, const int32_t* topk_ids,
                    const void* w13, const void* w2, int32_t q4, const uint8_t* codes13,
                    const void* scales13, const uint8_t* zeros13, const uint8_t* codes2,
                    const void* scales2, const uint8_t* zeros2, int32_t format, int64_t G,
                    int64_t Ip, int64_t Hp, const float* b13, const float* b2,
                    int32_t clamped, float alpha, int32_t has_limit, float limit, uint16_t* y,
                    int32_t tiles, int32_t threads) {
  if (q4) {
    return moe_fused_moe_q4(x, 1, T, H, codes13, scales13, zeros13, codes2, scales2, zeros2,
                            format, G, E, I, Ip, Hp, topk_weights, topk_ids, 0, k, b13, b2,
                            clamped, alpha, has_limit, limit, y, threads);
  }
  return moe_amx_fused_moe(x, T, H, w13, w2, E, I, topk_weights, topk_ids, 0, k, b13, b2,
                           clamped, alpha, has_limit, limit, y, tiles, threads);
}

}  // namespace

int32_t moe_decode_layer(void* h, int64_t T, int64_t H, const void* norm1, const void* norm2,
                         float eps, int32_t norm_in_float32, const void* w_qkv,
                         const float* b_qkv, int64_t Hq, int64_t Hkv, int64_t D,
                         const int64_t* positions, const float* cos, const float* sin,
                         int64_t P, const void* q_norm, const void* k_norm, float qk_eps,
                         void* k_cache, void* v_cache, int64_t S, const int64_t* slot_mapping,
                         const int64_t* block_tables, int64_t W, const int64_t* seq_lens,
                         int64_t block_size, int64_t window, float scale, const float* sinks,
                         const void* w_o, const float* b_o, const void* w_router,
                         const float* b_router, int64_t E, int64_t k, int32_t renormalize,
                         int32_t topk_softmax, const void* w13, const void* w2, int64_t I,
                         int32_t q4, const uint8_t* codes13, const void* scales13,
                         const uint8_t* zeros13, const uint8_t* codes2, const void* scales2,
                         const uint8_t* zeros2, int32_t format, int64_t G, int64_t Ip,
                         int64_t Hp, const float* b13, const float* b2, int32_t clamped,
                         float alpha, int32_t has_limit, float limit, float* topk_weights,
                         int32_t* topk_ids, int32_t qkv_format, const void* qkv_scales,
                         int64_t qkv_G, int32_t o_format, const void* o_scales, int64_t o_G,
                         int32_t tiles, int32_t threads) {
  if (T <= 0) return T == 0 ? kOk : kBadArgument;
  if (topk_softmax && (k > kTopkSoftmaxMaxK || k * 64 <= E)) return kBadArgument;
  const int64_t q_n = Hq * D, qkv_n = (Hq + 2 * Hkv) * D;
  try {
    scratch.size_for(T, H, qkv_n, q_n, E);
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  Scratch& s = scratch;
  uint16_t* hh = static_cast<uint16_t*>(h);
  int32_t status = moe_rms_norm(h, T, 1, H, H, H, norm1, eps, norm_in_float32, 1, s.x.data(),
                                threads);
  if (status == kOk) {
    status = project(s.x.data(), T, H, w_qkv, b_qkv, qkv_n, qkv_format, qkv_scales, qkv_G,
                     s.qkv.data(), tiles, threads);
  }
  if (status == kOk) {
    status = moe_qk_norm_rope_cache(s.qkv.data(), 1, T, Hq, Hkv, D, positions, cos, sin, P,
                                    q_norm, k_norm, qk_eps, k_cache, v_cache, S, slot_mapping,
                                    s.q.data(), threads);
  }
  if (status == kOk) {
    status = moe_paged_decode_attention(s.q.data(), 1, k_cache, v_cache, 1, block_tables, W,
                                        seq_lens, sinks, T, Hq, Hkv, D, block_size, window,
                                        scale, tiles ? 1 : 2, s.attn.data(), threads);
  }
  if (status == kOk) {
    status = project(s.attn.data(), T, q_n, w_o, b_o, H, o_format, o_scales, o_G, s.y.data(),
                     tiles, threads);
  }
  if (status != kOk) return status;
  add_into(hh, s.y.data(), T * H);
  status = moe_rms_norm(h, T, 1, H, H, H, norm2, eps, norm_in_float32, 1, s.x.data(), threads);
  if (status == kOk) {
    status = moe_amx_linear(s.x.data(), T, H, w_router, E, b_router, s.logits.data(), 1, tiles,
                            threads);
  }
  if (status == kOk && topk_softmax) {
    status = moe_router_topk_softmax(s.logits.data(), T, E, k, topk_weights, topk_ids);
  } else if (status == kOk) {
    status = moe_router_softmax_topk(s.logits.data(), 1, T, E, k, renormalize, topk_weights,
                                     topk_ids, threads);
  }
  if (status == kOk) {
    status = run_experts(s.x.data(), T, H, E, I, k, topk_weights, topk_ids, w13, w2, q4,
                         codes13, scales13, zeros13, codes2, scales2, zeros2, format, G, Ip,
                         Hp, b13, b2, clamped, alpha, has_limit, limit, s.y.data(), tiles,
                         threads);
  }
  if (status != kOk) return status;
  add_into(hh, s.y.data(), T * H);
  return kOk;
}
