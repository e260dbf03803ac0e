// Dense linear layer y = x W^T + b on a CPU, over weights packed by kernels/moe/native.py.
//
// The Python side is kernels/dense/native_linear.py (argument checks; the C ABI is moe_engine_cpu.h).
// Work items are (row chunk, 16-column tile): a chunk of up to kChunk rows stays in L2 while
// every tile of W streams past it, and the pool of thread_pool.h spreads the items over the
// cores (claimed one at a time); each item runs the kRows x 16 micro-kernel of gemm.h down its
// rows (6 rows in the AVX2 build, 12 in the AVX-512 one). Small batches (decode: a few rows)
// are bound by reading W, and bfloat16-packed weights halve those bytes.

#include <algorithm>
#include <cstring>

#include "cpu_common.h"
#include "gemm.h"
#include "moe_engine_cpu.h"

namespace {

using moe_engine::bf16_t;
using moe_engine::from_f32;
using moe_engine::kRows;
using moe_engine::kTile;
using moe_engine::tile_rows;

constexpr int64_t kChunk = 96;  // rows per work item (a multiple of kRows)
// Products reading fewer weight bytes than this run on the calling thread alone (a router of
// 32 experts: 32 KiB in bfloat16), where waking a second thread costs more than it saves.
constexpr int64_t kMinParallelBytes = 64 * 1024;

template <typename W, typename O>
void run_linear(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias,
                O* y, int threads) {
  const int64_t tiles = (N + kTile - 1) / kTile, chunks = (M + kChunk - 1) / kChunk;
  if (M <= kRows && N * K * static_cast<int64_t>(sizeof(W)) < kMinParallelBytes) threads = 1;
  moe_engine::parallel_items(chunks * tiles, threads, [&](int64_t item, int) {
    const int64_t chunk = item / tiles, t = item % tiles;
    const int64_t end = std::min(M, (chunk + 1) * kChunk);
    const int64_t cols = std::min<int64_t>(kTile, N - t * kTile);
    alignas(32) float c[kRows * kTile];
    for (int64_t r = chunk * kChunk; r < end; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, end - r));
      tile_rows(x + r * K, K, n, w + t * K * kTile, K, c);
      for (int m = 0; m < n; ++m) {
        O* out = y + (r + m) * N + t * kTile;
        for (int64_t j = 0; j < cols; ++j)
          out[j] = from_f32<O>(c[m * kTile + j] + (bias ? bias[t * kTile + j] : 0.0f));
      }
    }
  });
}

}  // namespace

// The shapes are checked by kernels/dense/native_linear.py.
int32_t moe_linear(const float* x, int64_t M, int64_t K, const void* w, int32_t w_bf16,
                   int64_t N, const float* bias, void* y, int32_t y_bf16, int32_t threads) {
  if (M == 0) return kOk;
  if (w_bf16) {
    const auto* wp = static_cast<const uint16_t*>(w);
    if (y_bf16) run_linear(x, M, K, wp, N, bias, static_cast<bf16_t*>(y), threads);
    else run_linear(x, M, K, wp, N, bias, static_cast<float*>(y), threads);
  } else {
    const auto* wp = static_cast<const float*>(w);
    if (y_bf16) run_linear(x, M, K, wp, N, bias, static_cast<bf16_t*>(y), threads);
    else run_linear(x, M, K, wp, N, bias, static_cast<float*>(y), threads);
  }
  return kOk;
}
