// Dense linear layer y = x W^T + b on Intel AMX, bfloat16 activations and weights, float32
// accumulation (the tile blocks of amx_gemm.h), or, with `tiles` 0, the same blocks on
// AVX512-BF16 (bf16_dot.cpp). The Python side is kernels/dense/amx.py `AmxLinear` (argument
// checks, the VNNI packing); compiled with the AMX flags of kernels/native/build.py
// SOURCE_FLAGS and called only after moe_amx_available() (tiles) or moe_bf16_dot_available()
// said yes.
//
// Work items are (row chunk of up to kChunk rows, group of up to 4 column tiles = 64 columns),
// claimed one at a time by the pool of thread_pool.h. Within an item, 32-row blocks run the
// 2 x 2 tile blocking (each loaded A and B tile feeds two products), a last 16-row block the
// 1 x 4 one. A last block of fewer than 16 rows reads a zero-padded copy of those rows.

#include <algorithm>
#include <cstring>
#include <new>
#include <vector>

#include "amx_gemm.h"
#include "cpu_common.h"
#include "moe_engine_cpu.h"

namespace {

namespace amx = moe_engine::amx;

constexpr int64_t kChunk = 128;  // rows per work item (a multiple of 32)
// Products reading fewer weight bytes than this, with at most one row tile, run on the calling
// thread alone (as linear_cpu.cpp: waking a second thread costs more than it saves).
constexpr int64_t kMinParallelBytes = 64 * 1024;

template <typename O>
void run_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                const float* bias, O* y, bool tiles, int threads) {
  const int64_t col_tiles = (N + amx::kCols - 1) / amx::kCols;
  const int64_t groups = (col_tiles + amx::kMaxColTiles - 1) / amx::kMaxColTiles;
  const int64_t chunks = (M + kChunk - 1) / kChunk;
  const int64_t full = M / amx::kRows * amx::kRows, tail = M - full;
  std::vector<uint16_t> padded;  // the last M % 16 rows, zero-padded to 16 (tiles only)
  if (tail && tiles) {
    padded.assign(amx::kRows * K, 0);
    std::memcpy(padded.data(), x + full * K, tail * K * sizeof(uint16_t));
  }
  if (M <= amx::kRows && N * K * 2 < kMinParallelBytes) threads = 1;
  moe_engine::parallel_items(chunks * groups, threads, [&](int64_t item, int) {
    if (tiles) amx::configure_tiles();
    // Weights larger than the activations: consecutive items share a column group (its
    // weights stay in L2 while the row chunks pass); else they share a row chunk.
    const bool by_group = N * K > M * K;
    const int64_t chunk = by_group ? item % chunks : item / groups;
    const int64_t g = by_group ? item / chunks : item % groups;
    const int64_t t0 = g * amx::kMaxColTiles;
    const int n = static_cast<int>(std::min<int64_t>(amx::kMaxColTiles, col_tiles - t0));
    const uint16_t* b[amx::kMaxColTiles];
    for (int j = 0; j < n; ++j) b[j] = w + (t0 + j) * K * amx::kCols;
    alignas(64) float c[2 * amx::kRows * amx::kMaxColTiles * amx::kCols];
    const int64_t ldc = amx::kMaxColTiles * amx::kCols;
    const int64_t end = std::min(M, (chunk + 1) * kChunk);
    for (int64_t r = chunk * kChunk; r < end; r += 2 * amx::kRows) {
      const int rows = end - r > amx::kRows ? 2 : 1;
      const uint16_t* a[2];
      for (int i = 0; i < rows; ++i) {
        const int64_t at = r + i * amx::kRows;
        a[i] = at < full || !tiles ? x + at * K : padded.data();
      }
      const int64_t m_end = std::min(end, r + rows * amx::kRows);
      amx::block(tiles, a, rows, static_cast<int>(m_end - r), K, b, n, K, c, ldc);
      for (int64_t m = r; m < m_end; ++m) {
        for (int j = 0; j < n; ++j) {
          const int64_t col = (t0 + j) * amx::kCols;
          const int cols = static_cast<int>(std::min<int64_t>(amx::kCols, N - col));
          amx::store_row16(c + (m - r) * ldc + j * amx::kCols, bias ? bias + col : nullptr,
                           cols, y + m * N + col);
        }
      }
    }
    if (tiles) _tile_release();
  });
}

}  // namespace

// The shapes are checked by kernels/dense/amx.py `AmxLinear`.
int32_t moe_amx_linear(const void* x, int64_t M, int64_t K, const void* w, int64_t N,
                       const float* bias, void* y, int32_t y_bf16, int32_t tiles,
                       int32_t threads) {
  if (M == 0 || N == 0) return kOk;
  if (K % amx::kDepth) return kBadArgument;
  const auto* xp = static_cast<const uint16_t*>(x);
  const auto* wp = static_cast<const uint16_t*>(w);
  try {
    if (y_bf16) run_linear(xp, M, K, wp, N, bias, static_cast<uint16_t*>(y), tiles, threads);
    else run_linear(xp, M, K, wp, N, bias, static_cast<float*>(y), tiles, threads);
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  return kOk;
}
