// Small fused CPU ops of the decoder layer, one native call instead of several torch ops each.
//
// The Python side is kernels/cpu_ops.py. On the project's 2-core machine every torch op costs
// about 8-10 us of dispatch, so RMSNorm written as six torch ops (float, pow, mean, add, rsqrt,
// mul, mul) takes ~65 us on an [8, 512] input; fused it is one pass over the rows.
//
// rms_norm: y = x / sqrt(mean(x^2) + eps) * w (Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization"), statistics in float32, with the rounding of Hugging Face transformers'
// Qwen3/Mixtral `RMSNorm`: the normalised value is cast to x's dtype before the multiply by the
// weight (or, with weight_in_float32, the product is formed in float32 and cast once: gpt-oss).

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>

namespace {

inline float to_f32(float v) { return v; }
inline float to_f32(at::BFloat16 v) { return static_cast<float>(v); }

template <typename T>
void rms_rows(const T* x, int64_t A, int64_t B, int64_t D, int64_t sa, int64_t sb,
              const T* w, float eps, bool weight_in_float32, T* y) {
  at::parallel_for(0, A * B, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = x + (r / B) * sa + (r % B) * sb;
      T* out = y + r * D;
      float sum = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        const float v = to_f32(row[d]);
        sum += v * v;
      }
      const float inv = 1.0f / std::sqrt(sum / static_cast<float>(D) + eps);
      for (int64_t d = 0; d < D; ++d) {
        const float h = to_f32(row[d]) * inv;
        if (weight_in_float32) {
          out[d] = static_cast<T>(to_f32(w[d]) * h);
        } else {
          out[d] = static_cast<T>(to_f32(w[d]) * to_f32(static_cast<T>(h)));
        }
      }
    }
  });
}

// x [..., D] float32 or bfloat16 whose last dimension is contiguous (any strides before it,
// at most 2 leading dimensions); weight [D] of x's dtype. Returns a contiguous [..., D].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps,
                       bool weight_in_float32) {
  TORCH_CHECK(x.dim() >= 1 && x.dim() <= 3 && x.stride(-1) == 1,
              "x must be [D], [A, D] or [A, B, D] with a contiguous last dimension");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "weight must have x's dtype");
  const int64_t D = x.size(-1);
  TORCH_CHECK(weight.numel() == D && weight.is_contiguous(), "weight must be contiguous [D]");
  const int64_t A = x.dim() >= 2 ? x.size(0) : 1, B = x.dim() == 3 ? x.size(1) : 1;
  const int64_t sa = x.dim() >= 2 ? x.stride(0) : D, sb = x.dim() == 3 ? x.stride(1) : D;
  auto y = torch::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == torch::kBFloat16) {
    rms_rows(x.data_ptr<at::BFloat16>(), A, B, D, sa, sb, weight.data_ptr<at::BFloat16>(), e,
             weight_in_float32, y.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32, "x must be float32 or bfloat16");
    rms_rows(x.data_ptr<float>(), A, B, D, sa, sb, weight.data_ptr<float>(), e,
             weight_in_float32, y.data_ptr<float>());
  }
  return y;
}

}  // namespace

// Adds this file's functions to the extension module (module.cpp).
void register_ops_cpu(pybind11::module_& m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
