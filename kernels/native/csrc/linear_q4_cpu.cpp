// Dense linear layer y = x W^T + b over 4-bit weights (int4 group-wise or MXFP4) on a CPU.
//
// The Python side is kernels/dense/native_linear_q4.py (quantization, packing, argument checks; the C
// ABI is moe_engine_cpu.h). The weights are the 4-bit tiles of the experts' kernel
// (moe_cpu.cpp's header comment: [tiles][K / 2][16] code bytes, [tiles][K / G][16] scales and
// zero points), decoded by the same `Q4Weights` (q4.h), so a dense projection quantized with
// `--quantized-layers all` reads 4 + 32 / G bits per weight, as a Q4_0 GGUF's do in llama.cpp.
// Work items are (row chunk, 16-column tile), as csrc/linear_cpu.cpp: a chunk of up to kRows
// rows runs the 4-bit micro-kernel (decode: bound by reading the codes); a longer chunk (a
// prefill) dequantizes the tile once into a per-thread float32 tile and runs the dense
// micro-kernel of gemm.h down its rows. Float32 accumulation throughout; the decoded weights
// are exactly quant/'s dequantized values.
//
// One bfloat16 row with `format | kDotFlag` (the Python side sets it where the bf16 kernels run
// on AVX512-BF16 or AMX: kernels/dense/amx.py `bf16_backend`, chosen and logged once) runs the
// products on VDPBF16PS instead (`dot_tile` below): the codes are decoded to bfloat16 by one
// word lookup (vpermw) per 32 weights, and a VDPBF16PS adds 32 products, where the float32
// kernel spends a shift, a vpermps and an FMA per 16 (bench/NOTES.md section 22). Products
// exact (bfloat16 x times the exact 4-bit value), float32 sums, scaled once per group.

#include <algorithm>
#include <memory>
#include <new>

#include "cpu_common.h"
#include "gemm.h"
#include "moe_engine_cpu.h"
#include "q4.h"

namespace {

using moe_engine::bf16_t;
using moe_engine::from_f32;
using moe_engine::kRows;
using moe_engine::kTile;
using moe_engine::Q4;
using moe_engine::Q4Weights;

// The format bit that asks for the VDPBF16PS kernel at one bfloat16 row (moe_engine_cpu.h).
constexpr int32_t kDotFlag = 16;
constexpr int64_t kChunk = 96;  // rows per work item (a multiple of kRows)
// Products reading fewer code bytes than this run on the calling thread alone.
constexpr int64_t kMinParallelBytes = 32 * 1024;

// x as float32 rows: bfloat16 inputs widened into a per-thread buffer (grow-only).
thread_local moe_engine::Grown<float> widened;

template <Q4 F, typename O>
void run_linear_q4(const float* x, int64_t M, int64_t K, const Q4Weights<F>& w, int64_t N,
                   const float* bias, O* y, int threads) {
  const int64_t tiles = (N + kTile - 1) / kTile, chunks = (M + kChunk - 1) / kChunk;
  if (M <= kRows && N * K / 2 < kMinParallelBytes) threads = 1;
  std::unique_ptr<float[]> scratch;  // per worker: one dequantized tile [K][16]
  if (M > kRows) scratch.reset(new float[static_cast<size_t>(threads) * K * kTile]);
  moe_engine::parallel_items(chunks * tiles, threads, [&](int64_t item, int worker) {
    const int64_t chunk = item / tiles, t = item % tiles;
    const int64_t begin = chunk * kChunk, end = std::min(M, begin + kChunk);
    const int64_t cols = std::min<int64_t>(kTile, N - t * kTile);
    float* dense = nullptr;
    if (end - begin > kRows) {
      dense = scratch.get() + static_cast<int64_t>(worker) * K * kTile;
      w.dequantize(t, dense);
    }
    alignas(64) float c[kRows * kTile];
    for (int64_t r = begin; r < end; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, end - r));
      if (dense) moe_engine::tile_rows(x + r * K, K, n, dense, K, c);
      else w.rows(t, x + r * K, K, n, c);
      for (int m = 0; m < n; ++m) {
        O* out = y + (r + m) * N + t * kTile;
        for (int64_t j = 0; j < cols; ++j)
          out[j] = from_f32<O>(c[m * kTile + j] + (bias ? bias[t * kTile + j] : 0.0f));
      }
    }
  });
}

template <Q4 F>
void run_any_out(const float* x, int64_t M, int64_t K, const Q4Weights<F>& w, int64_t N,
                 const float* bias, void* y, int32_t y_bf16, int threads) {
  if (y_bf16) run_linear_q4(x, M, K, w, N, bias, static_cast<bf16_t*>(y), threads);
  else run_linear_q4(x, M, K, w, N, bias, static_cast<float*>(y), threads);
}

}  // namespace

#if MOE_ENGINE_VECTOR_BITS == 512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

namespace {

// In dot_tile, each 128-bit lane q of a 64-byte chunk (k pair k0 + 2q, k0 + 2q + 1) is
// reordered bytewise so that dword d holds bytes 2d, 2d + 1 (k) and 8 + 2d, 9 + 2d (k + 1) of
// the pair: word 2d is k's, word 2d + 1 is k + 1's, and their nibble s (s < 4) is the same
// column, dot_column(s, d), by the packed layout (moe_cpu.cpp header: byte i holds column
// L(i) = i + 4 * (i / 4) low, L(i) + 4 high). So lookup s (the words shifted by 4 s) gives, in
// dword d, the weight pair (k, k + 1) of one column, as VDPBF16PS pairs them.
constexpr int dot_column(int s, int d) {
  const int i = 2 * d + s / 2;
  return i + 4 * (i / 4) + 4 * (s % 2);
}

struct DotConstants {
  __m512i order, pair_lanes, table, scale_lanes[4], columns;
};

// vpermw reads the low 5 bits of each index word: after the shift by 4 s, bit 4 is the next
// nibble's lowest bit, so the 16 values are stored twice.
template <Q4 F>
DotConstants dot_constants(const Q4Weights<F>& w) {
  DotConstants k;
  k.order = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
  k.pair_lanes = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  alignas(64) float values[16];
  _mm512_store_ps(values, w.table());
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) table[i] = moe_engine::f32_to_bf16(values[i % 16]);
  k.table = _mm512_load_si512(table);
  alignas(64) int32_t lanes[4][16], columns[16];
  for (int s = 0; s < 4; ++s) {
    for (int j = 0; j < 16; ++j) lanes[s][j] = dot_column(s, j % 4);
    for (int d = 0; d < 4; ++d) columns[dot_column(s, d)] = 4 * s + d;
  }
  for (int s = 0; s < 4; ++s) k.scale_lanes[s] = _mm512_load_si512(lanes[s]);
  k.columns = _mm512_load_si512(columns);
  return k;
}

inline __attribute__((always_inline)) __m512 fold_lanes(__m512 a, __m512 b) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

// c[0..16) = sum_k x[k] * w[k][0..16) over tile `tile`: per 16 k (two chunks, their own
// accumulators: 8 chains) 2 loads, 2 byte shuffles, 6 shifts, 8 lookups, 8 VDPBF16PS; each
// group's sums scaled once; the four 128-bit lanes (different k) summed at the end.
template <Q4 F>
inline __attribute__((always_inline)) void dot_tile(const uint16_t* x, const Q4Weights<F>& w,
                                                    int64_t tile, const DotConstants& kc,
                                                    float* c) {
  const int64_t K = w.K, G = w.G;
  const uint8_t* p = w.codes + tile * (K / 2) * kTile;
  __m512 acc[4];
  for (int s = 0; s < 4; ++s) acc[s] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / G; ++g) {
    __m512 part[2][4];
    for (int u = 0; u < 2; ++u) {
      for (int s = 0; s < 4; ++s) part[u][s] = _mm512_setzero_ps();
    }
    for (int64_t k = g * G; k < (g + 1) * G; k += 16, p += 8 * kTile) {
      moe_engine::prefetch_weights<8>(p);
      for (int u = 0; u < 2; ++u) {
        const __m512i r = _mm512_shuffle_epi8(_mm512_loadu_si512(p + u * 4 * kTile), kc.order);
        const __m512bh xv = reinterpret_cast<__m512bh>(_mm512_permutexvar_epi32(
            kc.pair_lanes, _mm512_castsi128_si512(
                _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + k + 8 * u)))));
#pragma GCC unroll 4
        for (int s = 0; s < 4; ++s) {
          const __m512i v = _mm512_permutexvar_epi16(s ? _mm512_srli_epi16(r, 4 * s) : r,
                                                     kc.table);
          part[u][s] = _mm512_dpbf16_ps(part[u][s], xv, reinterpret_cast<__m512bh>(v));
        }
      }
    }
    const __m512 scale = moe_engine::load_scales16<F>(w.scales, (tile * (K / G) + g) * kTile);
    for (int s = 0; s < 4; ++s) {
      acc[s] = _mm512_fmadd_ps(_mm512_add_ps(part[0][s], part[1][s]),
                               _mm512_permutexvar_ps(kc.scale_lanes[s], scale), acc[s]);
    }
  }
  // lane 4 s + d: the sum over the four k pairs of acc[s]'s dword d, column dot_column(s, d)
  const __m512 sums = fold_lanes(fold_lanes(acc[0], acc[1]), fold_lanes(acc[2], acc[3]));
  _mm512_storeu_ps(c, _mm512_permutexvar_ps(kc.columns, sums));
}

template <Q4 F>
void dot_row(const uint16_t* x, const Q4Weights<F>& w, int64_t N, const float* bias, float* y,
             int threads) {
  const int64_t tiles = (N + kTile - 1) / kTile;
  if (N * w.K / 2 < kMinParallelBytes) threads = 1;
  const DotConstants kc = dot_constants(w);
  moe_engine::parallel_items(tiles, threads, [&](int64_t t, int) {
    alignas(64) float c[kTile];
    dot_tile(x, w, t, kc, c);
    const int64_t cols = std::min<int64_t>(kTile, N - t * kTile);
    for (int64_t j = 0; j < cols; ++j) y[t * kTile + j] = c[j] + (bias ? bias[t * kTile + j] : 0.0f);
  });
}

// y [1, N] = x W^T + b for one bfloat16 row x (moe_linear_q4's arguments; G % 16 == 0, no
// zero points). Only called where moe_bf16_dot_available() said yes.
int32_t dot_row_any(const uint16_t* x, int64_t K, const uint8_t* codes, const void* scales,
                    int32_t format, int64_t G, int64_t N, const float* bias, void* y,
                    int32_t y_bf16, int threads) {
  auto with = [&](auto format_tag) {
    constexpr Q4 F = decltype(format_tag)::value;
    const Q4Weights<F> w{codes, scales, nullptr, K, G};
    float* out = y_bf16 ? widened.get(N) : static_cast<float*>(y);
    dot_row(x, w, N, bias, out, threads);
    auto* yb = static_cast<bf16_t*>(y);
    if (y_bf16) {
      for (int64_t j = 0; j < N; ++j) yb[j] = from_f32<bf16_t>(out[j]);
    }
  };
  switch (static_cast<Q4>(format)) {
    case Q4::kMxfp4: with(std::integral_constant<Q4, Q4::kMxfp4>{}); break;
    case Q4::kInt4: with(std::integral_constant<Q4, Q4::kInt4>{}); break;
    case Q4::kInt4Bf16: with(std::integral_constant<Q4, Q4::kInt4Bf16>{}); break;
    case Q4::kInt4F16: with(std::integral_constant<Q4, Q4::kInt4F16>{}); break;
    default: return kBadArgument;
  }
  return kOk;
}

}  // namespace

#pragma GCC pop_options
#endif  // MOE_ENGINE_VECTOR_BITS == 512

namespace {

// Whether one row takes the VDPBF16PS kernel (kDotFlag asked for it).
bool takes_dot(int32_t dot, int32_t x_bf16, int64_t M, int64_t G, const uint8_t* zeros) {
  return MOE_ENGINE_VECTOR_BITS == 512 && dot && x_bf16 && M == 1 && G % 16 == 0 && !zeros;
}

}  // namespace

// The shapes are checked by kernels/dense/native_linear_q4.py.
int32_t moe_linear_q4(const void* x, int32_t x_bf16, int64_t M, int64_t K,
                      const uint8_t* codes, const void* scales, const uint8_t* zeros,
                      int32_t format, int64_t G, int64_t N, const float* bias, void* y,
                      int32_t y_bf16, int32_t threads) {
  if (M == 0) return kOk;
  if (K % G || G % 2 || K % 2) return kBadArgument;
  const int32_t dot = format & kDotFlag;
  format &= ~kDotFlag;
  try {
#if MOE_ENGINE_VECTOR_BITS == 512
    if (takes_dot(dot, x_bf16, M, G, zeros)) {
      return dot_row_any(static_cast<const uint16_t*>(x), K, codes, scales, format, G, N, bias,
                         y, y_bf16, threads);
    }
#else
    (void)takes_dot(dot, x_bf16, M, G, zeros);
#endif
    const float* xf = static_cast<const float*>(x);
    if (x_bf16) {
      float* buf = widened.get(M * K);
      const auto* xb = static_cast<const uint16_t*>(x);
      for (int64_t i = 0; i < M * K; ++i) buf[i] = moe_engine::bf16_to_f32(xb[i]);
      xf = buf;
    }
    auto with = [&](auto format_tag) {
      constexpr Q4 F = decltype(format_tag)::value;
      const Q4Weights<F> w{codes, scales, F == Q4::kMxfp4 ? nullptr : zeros, K, G};
      run_any_out(xf, M, K, w, N, bias, y, y_bf16, threads);
    };
    switch (static_cast<Q4>(format)) {
      case Q4::kMxfp4: with(std::integral_constant<Q4, Q4::kMxfp4>{}); break;
      case Q4::kInt4: with(std::integral_constant<Q4, Q4::kInt4>{}); break;
      case Q4::kInt4Bf16: with(std::integral_constant<Q4, Q4::kInt4Bf16>{}); break;
      case Q4::kInt4F16: with(std::integral_constant<Q4, Q4::kInt4F16>{}); break;
      default: return kBadArgument;
    }
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  return kOk;
}

