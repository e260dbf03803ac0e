// Dense linear layer y = x W^T + b on a CPU, over weights packed by kernels/cpu_native.py.
//
// The Python side is kernels/cpu_linear.py. Work items are (row chunk, 16-column tile): a
// chunk of up to kChunk rows stays in L2 while every tile of W streams past it, and OpenMP
// spreads the items over the cores (dynamic schedule); each item runs the 6 x 16 micro-kernel
// of gemm_avx2.h down its rows. Small batches (decode: a few rows) are bound by reading W, and
// bfloat16-packed weights halve those bytes.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "gemm_avx2.h"

namespace {

using moe_engine::kRows;
using moe_engine::kTile;
using moe_engine::tile_rows;

constexpr int64_t kChunk = 96;  // rows per work item (a multiple of kRows)

template <typename W, typename O>
void run_linear(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* bias,
                O* y) {
  const int64_t tiles = (N + kTile - 1) / kTile, chunks = (M + kChunk - 1) / kChunk;
  const int threads = at::get_num_threads();
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t item = 0; item < chunks * tiles; ++item) {
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
          out[j] = static_cast<O>(c[m * kTile + j] + (bias ? bias[t * kTile + j] : 0.0f));
      }
    }
  }
}

// x [M, K] float32 or bfloat16; w packed [ceil(N/16), K, 16] float32 or bfloat16; bias [N]
// float32 or empty. Returns [M, N] in x's dtype.
torch::Tensor linear(torch::Tensor x, torch::Tensor w, torch::Tensor bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2, "x must be [M, K]");
  TORCH_CHECK(w.dim() == 3 && w.size(2) == kTile && w.is_contiguous() &&
                  w.size(1) == x.size(1) && w.size(0) * kTile >= N,
              "w must be packed [ceil(N/16), K, 16] for x [M, K]");
  TORCH_CHECK(!bias.numel() || (bias.numel() == N && bias.scalar_type() == torch::kFloat32),
              "bias must be float32 [N]");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool bf16_in = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16_in || x.scalar_type() == torch::kFloat32, "x must be float32 or bfloat16");
  auto xf = bf16_in ? x.to(torch::kFloat32).contiguous() : x.contiguous();
  const float* xs = xf.data_ptr<float>();
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (w.scalar_type() == torch::kBFloat16) {
    const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    if (bf16_in) run_linear(xs, M, K, wp, N, b, y.data_ptr<at::BFloat16>());
    else run_linear(xs, M, K, wp, N, b, y.data_ptr<float>());
  } else {
    TORCH_CHECK(w.scalar_type() == torch::kFloat32, "w must be float32 or bfloat16");
    const float* wp = w.data_ptr<float>();
    if (bf16_in) run_linear(xs, M, K, wp, N, b, y.data_ptr<at::BFloat16>());
    else run_linear(xs, M, K, wp, N, b, y.data_ptr<float>());
  }
  return y;
}

}  // namespace

// Adds this file's functions to the extension module (module.cpp).
void register_linear_cpu(pybind11::module_& m) {
  m.def("linear", &linear, "y = x W^T + b over packed float32/bfloat16 weights (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
