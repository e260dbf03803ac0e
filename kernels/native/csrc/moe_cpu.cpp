// Fused Mixture-of-Experts for the CPU: route, gate/up GEMM, SwiGLU, down GEMM, weighted sum.
//
// The Python side is kernels/moe/native.py (packing, argument checks, docstrings; the C ABI is
// moe_engine_cpu.h). Algorithm,
// as vLLM's fused_moe (vllm/model_executor/layers/fused_moe) and SGLang's CPU MoE kernel
// (sgl-kernel/csrc/cpu/moe.cpp) structure it: sort the (token, expert) pairs by expert; for
// each active expert run the two projections on its rows only; then every token sums its
// pairs' outputs times their router weights. The GEMMs are register-blocked micro-kernels
// (kRows rows x 16 columns of float32 accumulators, gemm.h; Goto & van de Geijn, "Anatomy of
// High-Performance Matrix Multiplication", TOMS 2008) over weights packed as tiles of 16
// output columns stored k-major, so each k step loads one tile row of 16 weights and
// broadcasts one activation per row. Accumulation is float32 throughout.
//
// Weight formats (one template per format; routing, activation and combine are shared):
//   - float32 or bfloat16, [tiles][K][16] (a bfloat16 is the high half of a float32: widened in
//     registers by a shift).
//   - 4-bit codes, [tiles][K / 2][16] bytes: per k, 8 bytes hold the tile's 16 columns, byte i
//     (i < 8) holding column c = i + 4 * (i / 4) (0-3, 8-11) in its low nibble and column c + 4
//     in its high nibble; the 8 bytes of an even k are followed by those of k + 1 (an order
//     made for AVX2's in-lane shuffles, q4_avx2.h; q4_avx512.h decodes the same bytes).
//     Scales (and zero points) are per column and per block of G values along K:
//     [tiles][K / G][16].
//       * MXFP4 (OCP Microscaling Formats (MX) Specification v1.0, 2023): E2M1 codes (sign,
//         2 exponent bits with bias 1, 1 mantissa bit), G = 32, one E8M0 scale byte s per
//         block (2^(s - 127); 255 is NaN).
//       * int4 (group-wise, GPTQ/AWQ style; quant/int4.py): unsigned codes q with a zero point
//         z (8 when symmetric) and a scale per group, float32, bfloat16 or float16 as the
//         checkpoint stores it (widened exactly in registers: a bfloat16 by a shift, a float16
//         by vcvtph2ps; no float32 copy is kept): w = (q - z) * scale.
//     Either way the decoded weights are exactly the dequantized values quant/ defines. An
//     expert with more than kRows rows (6 in the AVX2 build, 12 in the AVX-512 one) has each
//     4-bit tile dequantized once into a per-thread float32 tile, and the dense micro-kernel
//     runs over all its row blocks; fewer rows run the 4-bit micro-kernels (q4.h).
//
// Parallelism: the pool of thread_pool.h over (expert, 16-column tile) work items, claimed one
// at a time, so a decode step with a few rows per expert still spreads over every core, and
// experts of uneven load balance.

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "gemm.h"
#include "q4.h"
#include "moe_engine_cpu.h"

namespace {

using moe_engine::bf16_t;
using moe_engine::from_f32;
using moe_engine::kRows;
using moe_engine::kTile;
using moe_engine::Q4;
using moe_engine::Q4Weights;
using moe_engine::to_f32;

// The format bit that asks for a bfloat16 call's products on VDPBF16PS (moe_engine_cpu.h;
// RowDot).
constexpr int32_t kDotFlag = 16;

// Rows per work item: an expert with more rows (a long prefill) is cut into chunks, so a chunk's
// activations stay in L2 while every tile of the expert's weights streams past them.
constexpr int64_t kChunk = 96;

// ---------------------------------------------------------------------------------------------
// Dense weights: float32 or bfloat16, [tiles][K][16] (micro-kernels: gemm.h).

template <typename W>
struct DenseWeights {
  const W* data;  // [tiles][K][16]
  int64_t K;

  // The rows [0, n) of a (n <= kRows) times packed tile `tile` -> c [n][16].
  MOE_ENGINE_INLINE void rows(int64_t tile, const float* a, int64_t lda, int n, float* c) const {
    moe_engine::tile_rows(a, lda, n, data + tile * K * kTile, K, c);
  }
};

// ---------------------------------------------------------------------------------------------
// The expert computation, shared by every weight format.

using moe_engine::Activation;  // cpu_common.h

struct Item {
  int32_t expert;
  int32_t tile;
  int64_t begin, end;  // the rows of this item: a chunk of the expert's rows
};

// Work items (expert, row chunk, tile) of every expert with rows, chunk-major within an expert.
std::vector<Item> make_items(const std::vector<int64_t>& offsets, int64_t tiles) {
  std::vector<Item> items;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kChunk) {
      const int64_t end = std::min(offsets[e + 1], r + kChunk);
      for (int64_t t = 0; t < tiles; ++t) items.push_back({int32_t(e), int32_t(t), r, end});
    }
  }
  return items;
}

template <typename WS>
struct is_quantized : std::false_type {};
template <Q4 F>
struct is_quantized<Q4Weights<F>> : std::true_type {};

// One tile of a weight set as the row blocks of one expert use it: a 4-bit tile that more than
// one block of kRows rows multiplies is dequantized once, into `scratch` ([K][16] float32), and
// the dense micro-kernel runs on that; otherwise the weight set's own kernel runs.
template <typename WS>
struct TileView {
  const WS& w;
  int64_t tile;
  const float* dense = nullptr;

  TileView(const WS& ws, int64_t t, int64_t rows, float* scratch) : w(ws), tile(t) {
    if constexpr (is_quantized<WS>::value) {
      if (rows > kRows) {
        w.dequantize(tile, scratch);
        dense = scratch;
      }
    }
  }

  MOE_ENGINE_INLINE void rows(const float* a, int64_t lda, int n, float* c) const {
    if constexpr (is_quantized<WS>::value) {
      if (dense) return DenseWeights<float>{dense, w.K}.rows(0, a, lda, n, c);
    }
    w.rows(tile, a, lda, n, c);
  }
};

// The products of 4-bit experts on VDPBF16PS (q4_dot_avx512.h) for bfloat16 hidden rows, where
// the bf16 kernels run (moe_fused_moe_q4's kDotFlag; null elsewhere): tile(ctx, down, x, ldx,
// n, tile, c) writes c [n][16] = the n <= kRows bfloat16 rows x (ldx apart) times tile `tile`
// of w13 (down false) or w2 (down true), two rows sharing each decoded weight. Every row of
// the call takes it, and its intermediate is rounded once to bfloat16 to be down's rows, as
// amx_moe.cpp rounds it for the bf16 experts (the float32 kernels keep it float32). A row's
// sums do not depend on the rows beside it, so a token's result does not depend on its batch
// (a prefill's long blocks decode each weight once per two rows: about as many operations as
// the float32 kernels' FMAs on a dequantized tile).
struct RowDot {
  void (*tile)(const void* ctx, bool down, const uint16_t* x, int64_t ldx, int n, int64_t tile,
               float* c);
  const void* ctx;
};

// The bfloat16 rows and intermediate of a RowDot call ([P, H], [P, Ip]), per calling thread
// (grow-only).
thread_local moe_engine::Grown<uint16_t> x_bf16, inter_bf16;

// WS: a weight set with K, rows(tile, a, lda, n, c) and, when quantized, dequantize(tile, out)
// (DenseWeights, Q4Weights). Tile t of expert e is (e * 2 + 0) * Ip/16 + t (gate) or
// (e * 2 + 1) * Ip/16 + t (up) in w13, e * Hp/16 + t in w2.
template <typename WS>
void run_experts(
    const float* x,                 // [P, H] rows sorted by expert
    const WS& w13,                  // [E, 2, Ip/16] tiles over K = H
    const WS& w2,                   // [E, Hp/16] tiles over K = I
    const float* b13,               // [E, 2I] (gate, then up) or null
    const float* b2,                // [E, H] or null
    const std::vector<int64_t>& offsets,  // [E + 1] row ranges per expert
    int64_t H, int64_t I, int64_t Ip, int64_t Hp, const Activation& act,
    float* inter,                   // [P, Ip] scratch
    float* y,                       // [P, Hp] out
    int threads,                    // threads of the pool (thread_pool.h)
    const RowDot* dot = nullptr) {  // bfloat16 rows' products on VDPBF16PS, or null
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t up_tiles = Ip / kTile, h_tiles = Hp / kTile;
  std::vector<Item> items = make_items(offsets, up_tiles);
  // per thread: two dequantized tiles of K = max(H, I), for 4-bit experts with > kRows rows
  const int64_t tile_floats = std::max(H, I) * kTile;
  bool dequantizes = false;
  for (int64_t e = 0; e < E && !dot; ++e) dequantizes |= offsets[e + 1] - offsets[e] > kRows;
  std::unique_ptr<float[]> scratch;
  if (is_quantized<WS>::value && dequantizes) scratch.reset(new float[threads * 2 * tile_floats]);
  uint16_t* const x16 = dot ? x_bf16.get(offsets[E] * H) : nullptr;
  uint16_t* const inter16 = dot ? inter_bf16.get(offsets[E] * Ip) : nullptr;
  // the rows, widened from bfloat16 by the gather: exactly their high halves
  for (int64_t i = 0; dot && i < offsets[E] * H; ++i) {
    uint32_t bits;
    std::memcpy(&bits, x + i, sizeof bits);
    x16[i] = static_cast<uint16_t>(bits >> 16);
  }
  const int64_t n1 = static_cast<int64_t>(items.size());
  moe_engine::parallel_items(n1, threads, [&](int64_t i, int worker) {
    const int64_t e = items[i].expert, t = items[i].tile, begin = items[i].begin;
    const int64_t end = items[i].end, rows = end - begin;
    float* mine = scratch ? scratch.get() + worker * 2 * tile_floats : nullptr;
    const int64_t dense_rows = dot ? 0 : rows;  // RowDot reads the 4-bit tiles
    const TileView<WS> gate(w13, (e * 2 + 0) * up_tiles + t, dense_rows, mine);
    const TileView<WS> up(w13, (e * 2 + 1) * up_tiles + t, dense_rows, mine + tile_floats);
    const int64_t cols = std::min<int64_t>(kTile, I - t * kTile);
    alignas(32) float bg[kTile] = {}, bu[kTile] = {};
    if (b13) {
      for (int64_t c = 0; c < cols; ++c) {
        bg[c] = b13[e * 2 * I + t * kTile + c];
        bu[c] = b13[e * 2 * I + I + t * kTile + c];
      }
    }
    alignas(32) float g[kRows * kTile];
    alignas(32) float u[kRows * kTile];
    for (int64_t r = begin; r < end; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, end - r));
      if (dot) {
        dot->tile(dot->ctx, false, x16 + r * H, H, n, gate.tile, g);
        dot->tile(dot->ctx, false, x16 + r * H, H, n, up.tile, u);
        for (int m = 0; m < n; ++m) {
          uint16_t* out = inter16 + (r + m) * Ip + t * kTile;
          for (int c = 0; c < kTile; ++c) {
            out[c] = moe_engine::f32_to_bf16(act(g[m * kTile + c] + bg[c],
                                                 u[m * kTile + c] + bu[c]));
          }
        }
        continue;
      }
      gate.rows(x + r * H, H, n, g);
      up.rows(x + r * H, H, n, u);
      for (int m = 0; m < n; ++m) {
        float* out = inter + (r + m) * Ip + t * kTile;
        for (int c = 0; c < kTile; ++c) {
          out[c] = act(g[m * kTile + c] + bg[c], u[m * kTile + c] + bu[c]);
        }
      }
    }
  });
  items = make_items(offsets, h_tiles);
  const int64_t n2 = static_cast<int64_t>(items.size());
  moe_engine::parallel_items(n2, threads, [&](int64_t i, int worker) {
    const int64_t e = items[i].expert, t = items[i].tile, begin = items[i].begin;
    const int64_t end = items[i].end, rows = end - begin;
    float* mine = scratch ? scratch.get() + worker * 2 * tile_floats : nullptr;
    const TileView<WS> down(w2, e * h_tiles + t, dot ? 0 : rows, mine);
    const int64_t cols = std::min<int64_t>(kTile, H - t * kTile);
    alignas(32) float bd[kTile] = {};
    if (b2) {
      for (int64_t c = 0; c < cols; ++c) bd[c] = b2[e * H + t * kTile + c];
    }
    alignas(32) float c[kRows * kTile];
    for (int64_t r = begin; r < end; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, end - r));
      if (dot) {
        dot->tile(dot->ctx, true, inter16 + r * Ip, Ip, n, down.tile, c);
      } else {
        down.rows(inter + r * Ip, Ip, n, c);
      }
      for (int m = 0; m < n; ++m) {
        float* out = y + (r + m) * Hp + t * kTile;
        for (int col = 0; col < kTile; ++col) out[col] = c[m * kTile + col] + bd[col];
      }
    }
  });
}

// Everything but the expert GEMMs: sort the pairs by expert, gather the rows (float32), call
// The gathered rows (float32), the activation and the down sums of one call, per calling thread
// (grow-only): fresh allocations were mapped and faulted in by every layer's call.
struct Scratch {
  moe_engine::Grown<float> x, inter, y;
};
thread_local Scratch thread_scratch;

// run(x, offsets, inter, y), then sum every token's pairs times their router weights.
// hidden [T, H] (Hidden: float or bf16_t); topk_weights [T, k] float32; topk_ids [T, k] (Id:
// int32_t or int64_t; ids outside [0, E) are skipped); out [T, H] of Hidden, every row written.
template <typename Hidden, typename Id, typename Run>
void route_run_combine(const Hidden* hidden, int64_t T, int64_t H, const float* wt,
                       const Id* id, int64_t k, int64_t E, int64_t Ip, int64_t Hp, Hidden* out,
                       int threads, Run&& run) {
  // Sort the pairs by expert (stable: token order within an expert).
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t p = 0; p < T * k; ++p)
    if (id[p] >= 0 && id[p] < E) ++offsets[id[p] + 1];
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  const int64_t P = offsets[E];
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  std::vector<int64_t> row_of_pair(T * k, -1), token_of_row(P);
  for (int64_t p = 0; p < T * k; ++p) {
    if (id[p] < 0 || id[p] >= E) continue;
    const int64_t r = fill[id[p]]++;
    row_of_pair[p] = r;
    token_of_row[r] = p / k;
  }
  if (P == 0) {
    std::memset(out, 0, T * H * sizeof(Hidden));
    return;
  }
  // Uninitialised, reused across calls on this thread (as amx_moe.cpp's `Scratch`).
  Scratch& scratch = thread_scratch;
  float* const xs = scratch.x.get(P * H);
  float* const inter = scratch.inter.get(P * Ip);
  float* const ys_out = scratch.y.get(P * Hp);
  moe_engine::parallel_for(P, 64, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* dst = xs + r * H;
      const Hidden* src = hidden + token_of_row[r] * H;
      if constexpr (std::is_same_v<Hidden, float>) {
        std::memcpy(dst, src, H * sizeof(float));
      } else {
        for (int64_t h = 0; h < H; ++h) dst[h] = to_f32(src[h]);
      }
    }
  });

  run(static_cast<const float*>(xs), offsets, inter, ys_out);

  // Every token sums its pairs' rows times their router weights (float32, then hidden's dtype).
  const float* ys = ys_out;
  moe_engine::parallel_for(T, 16, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      bool any = false;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row_of_pair[t * k + j];
        if (r < 0) continue;
        any = true;
        const float w = wt[t * k + j];
        const float* row = ys + r * Hp;
        for (int64_t h = 0; h < H; ++h) acc[h] += w * row[h];
      }
      Hidden* dst = out + t * H;
      if (!any) {
        std::memset(dst, 0, H * sizeof(Hidden));
      } else if constexpr (std::is_same_v<Hidden, float>) {
        std::memcpy(dst, acc.data(), H * sizeof(float));
      } else {
        for (int64_t h = 0; h < H; ++h) dst[h] = from_f32<Hidden>(acc[h]);
      }
    }
  });
}

// route_run_combine over hidden's dtype (hidden_bf16) and the ids' width (ids_int64); returns
// kOk, or kOutOfMemory when a scratch buffer could not be allocated.
template <typename Run>
int32_t route_run_combine_any(const void* hidden, int32_t hidden_bf16, int64_t T, int64_t H,
                              const float* wt, const void* ids, int32_t ids_int64, int64_t k,
                              int64_t E, int64_t Ip, int64_t Hp, void* out, int threads,
                              Run&& run) {
  auto with_ids = [&](auto* h, auto* o) {
    if (ids_int64)
      route_run_combine(h, T, H, wt, static_cast<const int64_t*>(ids), k, E, Ip, Hp, o,
                        threads, run);
    else
      route_run_combine(h, T, H, wt, static_cast<const int32_t*>(ids), k, E, Ip, Hp, o,
                        threads, run);
  };
  try {  // the scratch buffers throw std::bad_alloc (cpu_common.h): a status for the caller
    if (hidden_bf16)
      with_ids(static_cast<const bf16_t*>(hidden), static_cast<bf16_t*>(out));
    else
      with_ids(static_cast<const float*>(hidden), static_cast<float*>(out));
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  return kOk;
}

}  // namespace

#if MOE_ENGINE_VECTOR_BITS == 512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

#include "q4_dot_avx512.h"

namespace {

// What RowDot's function reads: the weights and the lookup tables (the same for w13 and w2:
// they depend on the format only).
template <Q4 F>
struct DotWeights {
  const Q4Weights<F>* w13;
  const Q4Weights<F>* w2;
  DotConstants kc;
};

template <Q4 F>
__attribute__((noinline)) void dot_weights_init(DotWeights<F>* d, const Q4Weights<F>* w13,
                                                const Q4Weights<F>* w2) {
  d->w13 = w13;
  d->w2 = w2;
  d->kc = dot_constants(*w13);
}

// RowDot's function: the rows two at a time (dot_tile_rows), a last odd one alone.
template <Q4 F>
void dot_expert_tile(const void* ctx, bool down, const uint16_t* x, int64_t ldx, int n,
                     int64_t tile, float* c) {
  const auto& d = *static_cast<const DotWeights<F>*>(ctx);
  const Q4Weights<F>& w = down ? *d.w2 : *d.w13;
  int m = 0;
  for (; m + 2 <= n; m += 2) dot_tile_rows<2>(x + m * ldx, ldx, w, tile, d.kc, c + m * kTile);
  if (m < n) dot_tile(x + m * ldx, w, tile, d.kc, c + m * kTile);
}

}  // namespace

#pragma GCC pop_options
#endif  // MOE_ENGINE_VECTOR_BITS == 512

// Shapes and dtypes are checked by kernels/moe/native.py `PackedExperts.__call__`.
int32_t moe_fused_moe(const void* hidden, int32_t hidden_bf16, int64_t T, int64_t H,
                      const void* w13, const void* w2, int32_t w_bf16, int64_t E, int64_t I,
                      int64_t Ip, int64_t Hp, const float* topk_weights, const void* topk_ids,
                      int32_t ids_int64, int64_t k, const float* b13, const float* b2,
                      int32_t clamped, float alpha, int32_t has_limit, float limit, void* out,
                      int32_t threads) {
  const Activation act{clamped != 0, has_limit != 0, alpha, limit};
  auto run = [&](const float* x, const std::vector<int64_t>& offsets, float* inter, float* y) {
    if (w_bf16) {
      run_experts(x, DenseWeights<uint16_t>{static_cast<const uint16_t*>(w13), H},
                  DenseWeights<uint16_t>{static_cast<const uint16_t*>(w2), I}, b13, b2, offsets,
                  H, I, Ip, Hp, act, inter, y, threads);
    } else {
      run_experts(x, DenseWeights<float>{static_cast<const float*>(w13), H},
                  DenseWeights<float>{static_cast<const float*>(w2), I}, b13, b2, offsets, H, I,
                  Ip, Hp, act, inter, y, threads);
    }
  };
  return route_run_combine_any(hidden, hidden_bf16, T, H, topk_weights, topk_ids, ids_int64, k,
                               E, Ip, Hp, out, threads, run);
}

// Shapes and dtypes are checked by kernels/moe/native.py `PackedQuantExperts.__call__`.
int32_t moe_fused_moe_q4(const void* hidden, int32_t hidden_bf16, int64_t T, int64_t H,
                         const uint8_t* codes13, const void* scales13, const uint8_t* zeros13,
                         const uint8_t* codes2, const void* scales2, const uint8_t* zeros2,
                         int32_t format, int64_t G, int64_t E, int64_t I, int64_t Ip, int64_t Hp,
                         const float* topk_weights, const void* topk_ids, int32_t ids_int64,
                         int64_t k, const float* b13, const float* b2, int32_t clamped,
                         float alpha, int32_t has_limit, float limit, void* out,
                         int32_t threads) {
  const Activation act{clamped != 0, has_limit != 0, alpha, limit};
  const bool dot = (format & kDotFlag) && MOE_ENGINE_VECTOR_BITS == 512 && hidden_bf16 &&
                   G % 16 == 0 && zeros13 == nullptr && zeros2 == nullptr;
  format &= ~kDotFlag;
  auto run = [&](const float* x, const std::vector<int64_t>& offsets, float* inter, float* y) {
    auto with = [&](auto format_tag) {
      constexpr Q4 F = decltype(format_tag)::value;
      const Q4Weights<F> w13{codes13, scales13, F == Q4::kMxfp4 ? nullptr : zeros13, H, G};
      const Q4Weights<F> w2{codes2, scales2, F == Q4::kMxfp4 ? nullptr : zeros2, I, G};
#if MOE_ENGINE_VECTOR_BITS == 512
      if (dot) {
        DotWeights<F> weights;
        dot_weights_init(&weights, &w13, &w2);
        const RowDot products{dot_expert_tile<F>, &weights};
        return run_experts(x, w13, w2, b13, b2, offsets, H, I, Ip, Hp, act, inter, y, threads,
                           &products);
      }
#else
      (void)dot;
#endif
      run_experts(x, w13, w2, b13, b2, offsets, H, I, Ip, Hp, act, inter, y, threads);
    };
    switch (static_cast<Q4>(format)) {
      case Q4::kMxfp4: with(std::integral_constant<Q4, Q4::kMxfp4>{}); break;
      case Q4::kInt4Bf16: with(std::integral_constant<Q4, Q4::kInt4Bf16>{}); break;
      case Q4::kInt4F16: with(std::integral_constant<Q4, Q4::kInt4F16>{}); break;
      default: with(std::integral_constant<Q4, Q4::kInt4>{}); break;
    }
  };
  return route_run_combine_any(hidden, hidden_bf16, T, H, topk_weights, topk_ids, ids_int64, k,
                               E, Ip, Hp, out, threads, run);
}
