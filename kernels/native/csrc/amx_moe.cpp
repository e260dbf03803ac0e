// Fused Mixture-of-Experts on Intel AMX for bfloat16 activations and experts: route, gate/up
// GEMM, SwiGLU, down GEMM, weighted sum. The Python side is kernels/moe/amx.py
// `AmxExperts` (VNNI packing, argument checks); compiled with the AMX flags of
// kernels/native/build.py SOURCE_FLAGS, called only after moe_amx_available() said yes, or,
// with `tiles` 0 (the same blocks on AVX512-BF16, bf16_dot.cpp), moe_bf16_dot_available().
//
// The structure of moe_cpu.cpp's route_run_combine / run_experts (itself vLLM's fused_moe and
// SGLang's CPU MoE): sort the (token, expert) pairs by expert (stable), gather each expert's
// rows, run its two projections on those rows only, then every token sums its pairs' outputs
// times their router weights. What differs is the GEMMs (the tile blocks of amx_gemm.h) and
// the layout they need:
//   - each expert's rows start at a multiple of 16 (a tile's rows); the padding rows are zero
//     and their results are never read;
//   - the gathered rows stay bfloat16 (the A operand), K padded with zeros to a multiple of 32;
//   - the SwiGLU output, computed in float32 from the float32 gate and up sums in the
//     operation order of moe_cpu.cpp's Activation (exp by a vector Cephes expf, within 2 ulp
//     of std::exp; only on rows that hold pairs), is rounded once to bfloat16 (round to
//     nearest even) to be the down projection's A operand: one rounding where moe_cpu.cpp
//     keeps float32 (the reference in bfloat16, transformers' Qwen3-MoE / Mixtral experts,
//     rounds the gate, the up, the SiLU and the product each to bfloat16);
//   - the down projection's float32 sums (+ bias) are combined in float32 as moe_cpu.cpp does,
//     then rounded once to bfloat16.
// Parallelism: the pool of thread_pool.h over (expert, row chunk, column group) work items.

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <vector>

#include "amx_gemm.h"
#include "cpu_common.h"
#include "moe_engine_cpu.h"

namespace {

namespace amx = moe_engine::amx;
using moe_engine::f32_to_bf16;

constexpr int64_t kChunk = 128;  // rows per work item (a multiple of 32)

using moe_engine::Activation;  // cpu_common.h

struct Dims {
  int64_t T, H, E, I, k;
  int64_t Hk, Ik;  // K of the two GEMMs: H and I rounded up to a multiple of 32
  int64_t It, Ht;  // column tiles: ceil(I / 16) (of gate, of up), ceil(H / 16)
};

struct Item {
  int32_t expert;
  int32_t group;
  int64_t begin, end;  // padded rows [begin, end) of this item, multiples of 16
  int64_t used;        // rows [begin, used) hold pairs, the rest is padding
};

// (expert, row chunk, group) items for every expert with rows, `groups` column groups each;
// expert e's rows are [offsets[e], offsets[e] + counts[e]) then padding to offsets[e + 1].
std::vector<Item> make_items(const std::vector<int64_t>& offsets,
                             const std::vector<int64_t>& counts, int64_t groups) {
  std::vector<Item> items;
  for (size_t e = 0; e + 1 < offsets.size(); ++e) {
    const int64_t last = offsets[e] + counts[e];
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kChunk) {
      const int64_t end = std::min(offsets[e + 1], r + kChunk);
      for (int64_t g = 0; g < groups; ++g)
        items.push_back({int32_t(e), int32_t(g), r, end, std::min(end, last)});
    }
  }
  return items;
}

// exp(x) for 8 float32 lanes: Cephes' expf (S. L. Moshier, Cephes Math Library, expf.c, as
// vectorised in J. Pommier's avx_mathfun.h `exp256_ps`): x = n ln 2 + r (ln 2 split in two
// for an exact reduction), exp(r) by a degree-7 polynomial, times 2^n built in the exponent
// bits. Within 2 ulp of the exact value (Cephes' stated bound) over [-88.38, 88.38]; x is
// clamped to that range first (above, +inf, as std::exp gives from 88.72; below, 0, where
// std::exp returns denormals, which TDPBF16PS flushes to zero anyway). NaN stays NaN (the
// clamps keep it: _mm256_min_ps / max_ps return their second operand when either is NaN).
// AVX2, like the rest of these units' epilogues (amx_gemm.h).
MOE_AMX_INLINE __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
  x = _mm256_max_ps(_mm256_set1_ps(-88.3762626647949f), x);
  const __m256 n = _mm256_floor_ps(
      _mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                    _mm256_set1_ps(0.5f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(y, x), _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(y, x), x), _mm256_add_ps(x, _mm256_set1_ps(1)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// 8 lanes of act(gate, up), in the operation order of cpu_common.h's Activation (std::min /
// std::max operand order kept, so NaN goes where the scalar code sends it).
MOE_AMX_INLINE __m256 swiglu8(__m256 g, __m256 u, const Activation& act) {
  const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
  if (!act.clamped) {
    const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
    return _mm256_mul_ps(silu, u);
  }
  if (act.has_limit) {
    const __m256 lim = _mm256_set1_ps(act.limit);
    g = _mm256_min_ps(lim, g);  // std::min(g, lim) = lim < g ? lim : g
    u = _mm256_max_ps(_mm256_min_ps(lim, u), _mm256_sub_ps(zero, lim));
  }
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(-act.alpha), g);
  const __m256 glu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(z)));
  return _mm256_mul_ps(_mm256_add_ps(u, one), glu);
}

// dst[0..cols) = bfloat16(act(g + bias_g, u + bias_u)) for one row of a gate tile and its up
// tile (16 float32 columns each, cols <= 16 stored; biases null or cols long). Every column
// takes the same vector code whatever `cols`, so a value does not depend on its position.
MOE_AMX_INLINE void swiglu_row16(const float* g, const float* u, const float* bias_g,
                                 const float* bias_u, int cols, const Activation& act,
                                 uint16_t* dst) {
  alignas(32) float bg[amx::kCols] = {}, bu[amx::kCols] = {};
  if (bias_g) {
    std::memcpy(bg, bias_g, cols * sizeof(float));
    std::memcpy(bu, bias_u, cols * sizeof(float));
  }
  __m256 v[2];
  for (int h = 0; h < 2; ++h) {
    v[h] = swiglu8(_mm256_add_ps(_mm256_loadu_ps(g + 8 * h), _mm256_load_ps(bg + 8 * h)),
                   _mm256_add_ps(_mm256_loadu_ps(u + 8 * h), _mm256_load_ps(bu + 8 * h)), act);
  }
  const __m256i packed = _mm256_permute4x64_epi64(
      _mm256_packus_epi32(amx::round_bf16(v[0]), amx::round_bf16(v[1])), 0xD8);
  if (cols == amx::kCols) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), packed);
    return;
  }
  alignas(32) uint16_t tmp[amx::kCols];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), packed);
  std::memcpy(dst, tmp, cols * sizeof(uint16_t));
}

// The tile rows of the next block: a lone row tile (`tiles` 1) holding `used` < 16 real rows
// runs on tiles of that many rows (at 1-16 tokens most experts hold 1-2 rows: 5-15% faster at
// 2 threads, bench/NOTES.md section 9 "small batches"); else 16. Reconfigures only on a change
// of `current`; returns the rows now configured.
int configure_rows(int tiles, int64_t used, int current) {
  const int m = tiles == 1 ? static_cast<int>(std::clamp<int64_t>(used, 1, amx::kRows))
                            : static_cast<int>(amx::kRows);
  if (m != current) amx::configure_tiles(m);
  return m;
}

// inter [rows][Ik] bfloat16 = act(x w_gate^T + b_gate, x w_up^T + b_up) over padded rows;
// items: two gate tiles and the two up tiles of the same columns.
void gate_up(const uint16_t* xs, const uint16_t* w13, const float* b13,
             const std::vector<Item>& items, const Dims& d, const Activation& act,
             uint16_t* inter, bool tiles, int threads) {
  moe_engine::parallel_items(static_cast<int64_t>(items.size()), threads, [&](int64_t i, int) {
    if (tiles) amx::configure_tiles();
    int config_rows = amx::kRows;
    const Item& it = items[i];
    const int64_t e = it.expert, t0 = it.group * 2;
    const int n = static_cast<int>(std::min<int64_t>(2, d.It - t0));
    const uint16_t* b[4];
    for (int j = 0; j < n; ++j) {
      b[j] = w13 + ((e * 2 + 0) * d.It + t0 + j) * d.Hk * amx::kCols;
      b[n + j] = w13 + ((e * 2 + 1) * d.It + t0 + j) * d.Hk * amx::kCols;
    }
    constexpr int64_t ldc = 64;
    alignas(64) float c[2 * amx::kRows * ldc];
    for (int64_t r = it.begin; r < it.end; r += 2 * amx::kRows) {
      const int rows = it.end - r > amx::kRows ? 2 : 1;
      const uint16_t* a[2] = {xs + r * d.Hk, xs + (r + amx::kRows) * d.Hk};
      const int valid = static_cast<int>(std::min<int64_t>(rows * amx::kRows, it.used - r));
      if (tiles) config_rows = configure_rows(rows, it.used - r, config_rows);
      amx::block(tiles, a, rows, valid, d.Hk, b, 2 * n, d.Hk, c, ldc);
      for (int64_t m = 0; m < valid; ++m) {
        uint16_t* out = inter + (r + m) * d.Ik;
        for (int j = 0; j < n; ++j) {
          const int64_t col0 = (t0 + j) * amx::kCols;
          const int64_t cols = std::min<int64_t>(amx::kCols, d.I - col0);
          const float* g = c + m * ldc + j * amx::kCols;
          const float* u = c + m * ldc + (n + j) * amx::kCols;
          const float* bias = b13 ? b13 + e * 2 * d.I + col0 : nullptr;
          swiglu_row16(g, u, bias, bias ? bias + d.I : nullptr, static_cast<int>(cols), act,
                       out + col0);
        }
      }
    }
    if (tiles) _tile_release();
  });
}

// y [rows][Ht * 16] float32 = inter w_down^T + b_down over padded rows.
void down(const uint16_t* inter, const uint16_t* w2, const float* b2,
          const std::vector<Item>& items, const Dims& d, float* y, bool tiles, int threads) {
  const int64_t ldy = d.Ht * amx::kCols;
  moe_engine::parallel_items(static_cast<int64_t>(items.size()), threads, [&](int64_t i, int) {
    if (tiles) amx::configure_tiles();
    int config_rows = amx::kRows;
    const Item& it = items[i];
    const int64_t e = it.expert, t0 = it.group * amx::kMaxColTiles;
    const int n = static_cast<int>(std::min<int64_t>(amx::kMaxColTiles, d.Ht - t0));
    const uint16_t* b[amx::kMaxColTiles];
    for (int j = 0; j < n; ++j) b[j] = w2 + (e * d.Ht + t0 + j) * d.Ik * amx::kCols;
    // No bias and every column of the group inside H: y's rows (padding rows too, never
    // read) take the tiles' float32 sums as they are, which the copy below would write.
    const bool direct = b2 == nullptr && (t0 + n) * amx::kCols <= d.H;
    constexpr int64_t ldc = amx::kMaxColTiles * amx::kCols;
    alignas(64) float c[2 * amx::kRows * ldc];
    for (int64_t r = it.begin; r < it.end; r += 2 * amx::kRows) {
      const int rows = it.end - r > amx::kRows ? 2 : 1;
      const uint16_t* a[2] = {inter + r * d.Ik, inter + (r + amx::kRows) * d.Ik};
      const int valid = static_cast<int>(std::min<int64_t>(rows * amx::kRows, it.used - r));
      if (tiles) config_rows = configure_rows(rows, it.used - r, config_rows);
      if (direct) {  // the sums are y's values: the tiles store into y itself
        amx::block(tiles, a, rows, valid, d.Ik, b, n, d.Ik, y + r * ldy + t0 * amx::kCols,
                   ldy);
        continue;
      }
      amx::block(tiles, a, rows, valid, d.Ik, b, n, d.Ik, c, ldc);
      for (int64_t m = 0; m < valid; ++m) {
        for (int j = 0; j < n; ++j) {
          const int64_t col0 = (t0 + j) * amx::kCols;
          const int cols = static_cast<int>(std::min<int64_t>(amx::kCols, d.H - col0));
          amx::store_row16(c + m * ldc + j * amx::kCols, b2 ? b2 + e * d.H + col0 : nullptr,
                           cols, y + (r + m) * ldy + col0);
        }
      }
    }
    if (tiles) _tile_release();
  });
}

// The gathered rows, the SwiGLU output and the down projection's sums of one call, kept per
// calling thread so that a step's calls (one per layer) reuse the same pages: allocated fresh,
// a 2048-token prefill's 28 MB per layer were mapped and faulted in by every call, and an
// 8192-token step's 112 MB (over glibc's 32 MB mmap ceiling) made 4096- and 8192-token chunks
// slower per token than 2048 (bench/NOTES.md section 15). The largest call's size stays held.
struct Scratch {
  moe_engine::Grown<uint16_t> xs, inter;
  moe_engine::Grown<float> y;
};
thread_local Scratch thread_scratch;

template <typename Id>
void route_run_combine(const uint16_t* hidden, const uint16_t* w13, const uint16_t* w2,
                       const float* wt, const Id* id, const float* b13, const float* b2,
                       const Dims& d, const Activation& act, uint16_t* out, bool tiles,
                       int threads) {
  const int64_t E = d.E, k = d.k, pairs = d.T * d.k;
  // Sort the pairs by expert (stable: token order within an expert), each expert's rows
  // starting at a multiple of 16.
  std::vector<int64_t> offsets(E + 1, 0), counts(E, 0);
  for (int64_t p = 0; p < pairs; ++p)
    if (id[p] >= 0 && id[p] < E) ++counts[id[p]];
  for (int64_t e = 0; e < E; ++e) {
    offsets[e + 1] = offsets[e] + (counts[e] + amx::kRows - 1) / amx::kRows * amx::kRows;
  }
  const int64_t P = offsets[E];
  if (P == 0) {
    std::memset(out, 0, d.T * d.H * sizeof(uint16_t));
    return;
  }
  std::vector<int64_t> fill(offsets.begin(), offsets.end() - 1);
  std::vector<int64_t> row_of_pair(pairs, -1), token_of_row(P, -1);
  for (int64_t p = 0; p < pairs; ++p) {
    if (id[p] < 0 || id[p] >= E) continue;
    const int64_t r = fill[id[p]]++;
    row_of_pair[p] = r;
    token_of_row[r] = p / k;
  }
  // Uninitialised (the gather writes every row of xs, padding included, and inter's padding
  // rows and columns; gate_up writes the rest of inter, down all of y that is read): zeroing
  // them cost more than the GEMMs' epilogues at 2048 tokens. Reused across calls on this
  // thread (`Scratch`).
  Scratch& scratch = thread_scratch;
  uint16_t* const xs = scratch.xs.get(P * d.Hk);
  uint16_t* const inter = scratch.inter.get(P * d.Ik);
  float* const y = scratch.y.get(P * d.Ht * amx::kCols);
  moe_engine::parallel_for(P, 64, threads, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      uint16_t* dst = xs + r * d.Hk;
      const int64_t t = token_of_row[r];
      if (t >= 0) std::memcpy(dst, hidden + t * d.H, d.H * sizeof(uint16_t));
      std::fill(dst + (t >= 0 ? d.H : 0), dst + d.Hk, uint16_t{0});
      // padding columns; and padding rows whole (gate_up's epilogue skips them)
      std::fill(inter + r * d.Ik + (t >= 0 ? d.I : 0), inter + (r + 1) * d.Ik,
                uint16_t{0});
    }
  });
  gate_up(xs, w13, b13, make_items(offsets, counts, (d.It + 1) / 2), d, act,
          inter, tiles, threads);
  down(inter, w2, b2,
       make_items(offsets, counts, (d.Ht + amx::kMaxColTiles - 1) / amx::kMaxColTiles), d,
       y, tiles, threads);
  // Every token sums its pairs' rows times their router weights (float32, then bfloat16).
  const int64_t ldy = d.Ht * amx::kCols;
  moe_engine::parallel_for(d.T, 16, threads, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d.H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      bool any = false;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t r = row_of_pair[t * k + j];
        if (r < 0) continue;
        any = true;
        const float w = wt[t * k + j];
        const float* row = y + r * ldy;
        for (int64_t h = 0; h < d.H; ++h) acc[h] += w * row[h];
      }
      uint16_t* dst = out + t * d.H;
      for (int64_t h = 0; h < d.H; ++h) dst[h] = any ? f32_to_bf16(acc[h]) : 0;
    }
  });
}

}  // namespace

// Shapes and dtypes are checked by kernels/moe/amx.py `AmxExperts.__call__`.
int32_t moe_amx_fused_moe(const void* hidden, int64_t T, int64_t H, const void* w13,
                          const void* w2, int64_t E, int64_t I, const float* topk_weights,
                          const void* topk_ids, int32_t ids_int64, int64_t k, const float* b13,
                          const float* b2, int32_t clamped, float alpha, int32_t has_limit,
                          float limit, void* out, int32_t tiles, int32_t threads) {
  if (T == 0) return kOk;
  const Activation act{clamped != 0, has_limit != 0, alpha, limit};
  const auto up32 = [](int64_t v) { return (v + amx::kDepth - 1) / amx::kDepth * amx::kDepth; };
  const auto col_tiles = [](int64_t v) { return (v + amx::kCols - 1) / amx::kCols; };
  const Dims d{T, H, E, I, k, up32(H), up32(I), col_tiles(I), col_tiles(H)};
  const auto* h = static_cast<const uint16_t*>(hidden);
  const auto* p13 = static_cast<const uint16_t*>(w13);
  const auto* p2 = static_cast<const uint16_t*>(w2);
  auto* o = static_cast<uint16_t*>(out);
  try {
    if (ids_int64)
      route_run_combine(h, p13, p2, topk_weights, static_cast<const int64_t*>(topk_ids), b13,
                        b2, d, act, o, tiles != 0, threads);
    else
      route_run_combine(h, p13, p2, topk_weights, static_cast<const int32_t*>(topk_ids), b13,
                        b2, d, act, o, tiles != 0, threads);
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  return kOk;
}
