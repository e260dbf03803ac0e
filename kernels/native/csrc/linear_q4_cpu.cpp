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
// Up to kDotMaxRows bfloat16 rows with `format | kDotFlag` (the Python side sets it where the
// bf16 kernels run on AVX512-BF16 or AMX: kernels/dense/amx.py `bf16_backend`, chosen and
// logged once) run the products on VDPBF16PS instead (`dot_tile_rows`, q4_dot_avx512.h): the
// codes are decoded to bfloat16 by one word lookup (vpermw) per 32 weights, and a VDPBF16PS
// adds 32 products, where the float32 kernel spends a shift, a vpermps and an FMA per 16
// (bench/NOTES.md sections 22 and 25). Products exact (bfloat16 x times the exact 4-bit
// value), float32 sums, scaled once per group; a row's sums do not depend on the batch.

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

// The format bit that asks for the VDPBF16PS kernel at up to kDotMaxRows bfloat16 rows
// (moe_engine_cpu.h).
constexpr int32_t kDotFlag = 16;
constexpr int64_t kChunk = 96;  // rows per work item (a multiple of kRows)
// Bfloat16 batches of up to this many rows run the VDPBF16PS kernel (with kDotFlag): its 4-bit
// decode is shared by two rows; 2-8 rows measured 1.1-1.9x faster than the float32 kernels at
// gpt-oss-20b's and Qwen3-30B-A3B's shapes (bench/NOTES.md section 27). Beyond, the float32
// kernels' dequantized tile serves more rows per decode.
constexpr int64_t kDotMaxRows = 8;
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

#include "q4_dot_avx512.h"

namespace {

// y [M, N] (float32) = x W^T + b for M <= kDotMaxRows bfloat16 rows x [M, K]: per 16-column
// tile (one work item), the rows two at a time (dot_tile_rows), each row's sums the same as
// alone.
template <Q4 F>
void dot_rows(const uint16_t* x, int64_t M, const Q4Weights<F>& w, int64_t N, const float* bias,
              float* y, int threads) {
  const int64_t tiles = (N + kTile - 1) / kTile, K = w.K;
  if (N * K / 2 < kMinParallelBytes) threads = 1;
  const DotConstants kc = dot_constants(w);
  moe_engine::parallel_items(tiles, threads, [&](int64_t t, int) {
    alignas(64) float c[2 * kTile];
    const int64_t cols = std::min<int64_t>(kTile, N - t * kTile);
    for (int64_t r = 0; r < M; r += 2) {
      const int n = M - r >= 2 ? 2 : 1;
      if (n == 2) dot_tile_rows<2>(x + r * K, K, w, t, kc, c);
      else dot_tile(x + r * K, w, t, kc, c);
      for (int m = 0; m < n; ++m) {
        float* out = y + (r + m) * N + t * kTile;
        for (int64_t j = 0; j < cols; ++j) {
          out[j] = c[m * kTile + j] + (bias ? bias[t * kTile + j] : 0.0f);
        }
      }
    }
  });
}

// y [M, N] = x W^T + b for M <= kDotMaxRows bfloat16 rows x (moe_linear_q4's arguments;
// G % 16 == 0, no zero points). Only called where moe_bf16_dot_available() said yes.
int32_t dot_rows_any(const uint16_t* x, int64_t M, int64_t K, const uint8_t* codes,
                     const void* scales, int32_t format, int64_t G, int64_t N, const float* bias,
                     void* y, int32_t y_bf16, int threads) {
  auto with = [&](auto format_tag) {
    constexpr Q4 F = decltype(format_tag)::value;
    const Q4Weights<F> w{codes, scales, nullptr, K, G};
    float* out = y_bf16 ? widened.get(M * N) : static_cast<float*>(y);
    dot_rows(x, M, w, N, bias, out, threads);
    auto* yb = static_cast<bf16_t*>(y);
    if (y_bf16) {
      for (int64_t j = 0; j < M * N; ++j) yb[j] = from_f32<bf16_t>(out[j]);
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

// Whether the rows take the VDPBF16PS kernel (kDotFlag asked for it).
bool takes_dot(int32_t dot, int32_t x_bf16, int64_t M, int64_t G, const uint8_t* zeros) {
  return MOE_ENGINE_VECTOR_BITS == 512 && dot && x_bf16 && M <= kDotMaxRows && G % 16 == 0 &&
         !zeros;
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
      return dot_rows_any(static_cast<const uint16_t*>(x), M, K, codes, scales, format, G, N,
                          bias, y, y_bf16, threads);
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

