// Fused Mixture-of-Experts for the CPU: route, gate/up GEMM, SwiGLU, down GEMM, weighted sum.
//
// The Python side is kernels/cpu_native.py (packing, argument checks, docstrings). Algorithm,
// as vLLM's fused_moe (vllm/model_executor/layers/fused_moe) and SGLang's CPU MoE kernel
// (sgl-kernel/csrc/cpu/moe.cpp) structure it: sort the (token, expert) pairs by expert; for
// each active expert run the two projections on its rows only; then every token sums its
// pairs' outputs times their router weights. The GEMMs are register-blocked micro-kernels
// (6 rows x 16 columns of float32 accumulators, Goto & van de Geijn, "Anatomy of
// High-Performance Matrix Multiplication", TOMS 2008) over weights packed as tiles of 16
// output columns stored k-major ([tiles][K][16]), so each k step loads 16 contiguous weights
// and broadcasts one activation per row. Weights are float32 or bfloat16 (widened to float32 in
// registers: a bfloat16 is the high half of a float32); accumulation is float32.
//
// Parallelism: OpenMP over (expert, 16-column tile) work items with dynamic scheduling, so a
// decode step with a few rows per expert still spreads over every core, and experts of uneven
// load balance.

#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kTile = 16;  // output columns per packed tile
constexpr int kRows = 6;       // rows per micro-kernel call

inline __m256 widen_bf16(const uint16_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load_w(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load_w(const uint16_t* p) { return widen_bf16(p); }

// c[m][0..16) = sum_k a[m * lda + k] * w[k * 16 + 0..16), m < M.
template <int M, typename W>
inline void micro_kernel(const float* a, int64_t lda, const W* w, int64_t K, float* c) {
  __m256 lo[M], hi[M];
  for (int m = 0; m < M; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 w0 = load_w(w + k * kTile);
    const __m256 w1 = load_w(w + k * kTile + 8);
    for (int m = 0; m < M; ++m) {
      const __m256 x = _mm256_broadcast_ss(a + m * lda + k);
      lo[m] = _mm256_fmadd_ps(x, w0, lo[m]);
      hi[m] = _mm256_fmadd_ps(x, w1, hi[m]);
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(c + m * kTile, lo[m]);
    _mm256_storeu_ps(c + m * kTile + 8, hi[m]);
  }
}

// The rows [0, n) of a (n <= kRows) times one packed tile -> c [n][16].
template <typename W>
inline void tile_rows(const float* a, int64_t lda, int n, const W* w, int64_t K, float* c) {
  switch (n) {
    case 1: micro_kernel<1>(a, lda, w, K, c); break;
    case 2: micro_kernel<2>(a, lda, w, K, c); break;
    case 3: micro_kernel<3>(a, lda, w, K, c); break;
    case 4: micro_kernel<4>(a, lda, w, K, c); break;
    case 5: micro_kernel<5>(a, lda, w, K, c); break;
    default: micro_kernel<6>(a, lda, w, K, c); break;
  }
}

struct Activation {
  bool clamped;     // gpt-oss: (up + 1) * gate * sigmoid(alpha * gate)
  bool has_limit;   // gpt-oss clamp of gate (max) and up (both sides)
  float alpha;
  float limit;

  inline float operator()(float gate, float up) const {
    if (!clamped) return gate / (1.0f + std::exp(-gate)) * up;
    if (has_limit) {
      gate = std::min(gate, limit);
      up = std::max(-limit, std::min(up, limit));
    }
    return (up + 1.0f) * (gate / (1.0f + std::exp(-alpha * gate)));
  }
};

struct Item {
  int32_t expert;
  int32_t tile;
};

template <typename W>
void run_experts(
    const float* x,                 // [P, H] rows sorted by expert
    const W* w13,                   // [E, 2, Ip/16, H, 16]
    const W* w2,                    // [E, Hp/16, I, 16]
    const float* b13,               // [E, 2, Ip] or null
    const float* b2,                // [E, Hp] or null
    const std::vector<int64_t>& offsets,  // [E + 1] row ranges per expert
    int64_t H, int64_t I, int64_t Ip, int64_t Hp, const Activation& act,
    float* inter,                   // [P, Ip] scratch
    float* y) {                     // [P, Hp] out
  const int64_t E = static_cast<int64_t>(offsets.size()) - 1;
  const int64_t up_tiles = Ip / kTile, h_tiles = Hp / kTile;
  std::vector<Item> items;
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (int64_t t = 0; t < up_tiles; ++t) items.push_back({int32_t(e), int32_t(t)});
  }
  const int threads = at::get_num_threads();
  const int64_t n1 = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n1; ++i) {
    const int64_t e = items[i].expert, t = items[i].tile;
    const W* wg = w13 + ((e * 2 + 0) * up_tiles + t) * H * kTile;
    const W* wu = w13 + ((e * 2 + 1) * up_tiles + t) * H * kTile;
    const float* bg = b13 ? b13 + (e * 2 + 0) * Ip + t * kTile : nullptr;
    const float* bu = b13 ? b13 + (e * 2 + 1) * Ip + t * kTile : nullptr;
    alignas(32) float g[kRows * kTile];
    alignas(32) float u[kRows * kTile];
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, offsets[e + 1] - r));
      tile_rows(x + r * H, H, n, wg, H, g);
      tile_rows(x + r * H, H, n, wu, H, u);
      for (int m = 0; m < n; ++m) {
        float* out = inter + (r + m) * Ip + t * kTile;
        for (int c = 0; c < kTile; ++c) {
          const float gv = g[m * kTile + c] + (bg ? bg[c] : 0.0f);
          const float uv = u[m * kTile + c] + (bu ? bu[c] : 0.0f);
          out[c] = act(gv, uv);
        }
      }
    }
  }
  items.clear();
  for (int64_t e = 0; e < E; ++e) {
    if (offsets[e + 1] == offsets[e]) continue;
    for (int64_t t = 0; t < h_tiles; ++t) items.push_back({int32_t(e), int32_t(t)});
  }
  const int64_t n2 = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t i = 0; i < n2; ++i) {
    const int64_t e = items[i].expert, t = items[i].tile;
    const W* wd = w2 + (e * h_tiles + t) * I * kTile;
    const float* bd = b2 ? b2 + e * Hp + t * kTile : nullptr;
    alignas(32) float c[kRows * kTile];
    for (int64_t r = offsets[e]; r < offsets[e + 1]; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, offsets[e + 1] - r));
      tile_rows(inter + r * Ip, Ip, n, wd, I, c);
      for (int m = 0; m < n; ++m) {
        float* out = y + (r + m) * Hp + t * kTile;
        for (int col = 0; col < kTile; ++col) out[col] = c[m * kTile + col] + (bd ? bd[col] : 0.0f);
      }
    }
  }
}

template <typename A>
inline float to_float(A v) { return static_cast<float>(v); }

// hidden [T, H] (float32 or bfloat16); w13 packed [E, 2, Ip/16, H, 16]; w2 packed
// [E, Hp/16, I, 16] (both float32 or both bfloat16); topk_weights [T, k] float32; topk_ids
// [T, k] int32 or int64 (ids outside [0, E) are skipped); b13 [E, 2, Ip] / b2 [E, Hp] float32
// or empty. Returns [T, H] in hidden's dtype.
torch::Tensor fused_moe(
    torch::Tensor hidden, torch::Tensor w13, torch::Tensor w2, torch::Tensor topk_weights,
    torch::Tensor topk_ids, torch::Tensor b13, torch::Tensor b2, int64_t intermediate,
    bool clamped, double alpha, bool has_limit, double limit) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "hidden must be contiguous [T, H]");
  TORCH_CHECK(w13.dim() == 5 && w13.size(1) == 2 && w13.size(4) == kTile && w13.is_contiguous(),
              "w13 must be packed [E, 2, Ip/16, H, 16]");
  TORCH_CHECK(w2.dim() == 4 && w2.size(3) == kTile && w2.is_contiguous(),
              "w2 must be packed [E, Hp/16, I, 16]");
  TORCH_CHECK(w13.scalar_type() == w2.scalar_type(), "w13 and w2 must share a dtype");
  const int64_t T = hidden.size(0), H = hidden.size(1), E = w13.size(0);
  const int64_t I = intermediate, Ip = w13.size(2) * kTile, Hp = w2.size(1) * kTile;
  TORCH_CHECK(w13.size(3) == H && w2.size(0) == E && w2.size(2) == I && Hp >= H && Ip >= I,
              "packed weight shapes do not match hidden [T, H] and intermediate");
  TORCH_CHECK(topk_ids.dim() == 2 && topk_ids.size(0) == T, "topk_ids must be [T, k]");
  TORCH_CHECK(topk_weights.sizes() == topk_ids.sizes(), "topk_weights must match topk_ids");
  const int64_t k = topk_ids.size(1);
  auto ids = topk_ids.to(torch::kInt64).contiguous();
  auto weights = topk_weights.to(torch::kFloat32).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();

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
  auto out = torch::zeros({T, H}, hidden.options());
  if (P == 0) return out;

  auto opts = torch::TensorOptions().dtype(torch::kFloat32);
  auto x = torch::empty({P, H}, opts);
  auto inter = torch::empty({P, Ip}, opts);
  auto y = torch::empty({P, Hp}, opts);
  float* xs = x.data_ptr<float>();
  const bool bf16_in = hidden.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(bf16_in || hidden.scalar_type() == torch::kFloat32,
              "hidden must be float32 or bfloat16");
  at::parallel_for(0, P, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* dst = xs + r * H;
      if (bf16_in) {
        const at::BFloat16* src = hidden.data_ptr<at::BFloat16>() + token_of_row[r] * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<float>(src[h]);
      } else {
        std::memcpy(dst, hidden.data_ptr<float>() + token_of_row[r] * H, H * sizeof(float));
      }
    }
  });

  const Activation act{clamped, has_limit, static_cast<float>(alpha), static_cast<float>(limit)};
  const float* b13p = b13.numel() ? b13.data_ptr<float>() : nullptr;
  const float* b2p = b2.numel() ? b2.data_ptr<float>() : nullptr;
  if (b13p) TORCH_CHECK(b13.numel() == E * 2 * Ip && b2.numel() == E * Hp, "bias shapes");
  if (w13.scalar_type() == torch::kBFloat16) {
    run_experts(xs, reinterpret_cast<const uint16_t*>(w13.data_ptr<at::BFloat16>()),
                reinterpret_cast<const uint16_t*>(w2.data_ptr<at::BFloat16>()), b13p, b2p,
                offsets, H, I, Ip, Hp, act, inter.data_ptr<float>(), y.data_ptr<float>());
  } else {
    TORCH_CHECK(w13.scalar_type() == torch::kFloat32, "weights must be float32 or bfloat16");
    run_experts(xs, w13.data_ptr<float>(), w2.data_ptr<float>(), b13p, b2p, offsets, H, I, Ip,
                Hp, act, inter.data_ptr<float>(), y.data_ptr<float>());
  }

  // Every token sums its pairs' rows times their router weights (float32, then hidden's dtype).
  const float* ys = y.data_ptr<float>();
  at::parallel_for(0, T, 16, [&](int64_t begin, int64_t end) {
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
      if (!any) continue;
      if (bf16_in) {
        at::BFloat16* dst = out.data_ptr<at::BFloat16>() + t * H;
        for (int64_t h = 0; h < H; ++h) dst[h] = static_cast<at::BFloat16>(acc[h]);
      } else {
        std::memcpy(out.data_ptr<float>() + t * H, acc.data(), H * sizeof(float));
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fused_moe", &fused_moe, "Fused MoE experts on packed float32/bfloat16 weights (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
