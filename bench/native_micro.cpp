// Micro-benchmarks of the native CPU kernels' inner loops, one thread, outside Python: what the
// register-blocked dense micro-kernel does per row count, what the 4-bit kernels decode per
// 64 code bytes, and what a plain load loop reads from L3/DRAM (the memory's limit).
//
// Built against kernels/native/csrc with one variant's flags (kernels/native/build.py ISA_FLAGS):
//
//   FLAGS=$(python -c "from kernels.native.build import cxxflags; print(*cxxflags('avx512'))")
//   g++ $FLAGS -Ikernels/native/csrc bench/native_micro.cpp -o /tmp/native_micro && /tmp/native_micro
//
// (the AVX2 build: cxxflags('avx2'); its 4-bit line has no 64-byte-chunk kernel). Each figure
// is the best of 30 repetitions (the machine is shared: the best is the least disturbed).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "q4.h"

using namespace moe_engine;

// Keeps the compiler from dropping a kernel whose results are never read.
inline void escape(const void* p) { asm volatile("" : : "r"(p) : "memory"); }

template <typename F>
double best_seconds(F&& f, int reps = 30) {
  double best = 1e30;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0)
                              .count());
  }
  return best;
}

// GFLOP/s of micro_kernel<M> over 48 tiles of K = 512 (the qkv projection's weights, 786 kB
// as bfloat16: L2-resident), weights of type W.
template <int M, typename W>
double dense_gflops(const std::vector<W>& w, const std::vector<float>& x) {
  const int64_t K = 512, tiles = 48;
  alignas(64) float c[M * kTile];
  const double s = best_seconds([&] {
    for (int64_t t = 0; t < tiles; ++t) {
      micro_kernel<M>(x.data(), K, w.data() + t * K * kTile, K, c);
      escape(c);
    }
  });
  return 2.0 * M * K * tiles * kTile / s / 1e9;
}

template <typename W>
void dense_sweep(const char* name, W one) {
  std::vector<W> w(48 * 512 * kTile, one);
  std::vector<float> x(16 * 512, 0.01f);
  std::printf("dense %s weights, L2-hot, GFLOP/s: M=1 %.0f, 2 %.0f, 4 %.0f, 6 %.0f", name,
              dense_gflops<1>(w, x), dense_gflops<2>(w, x), dense_gflops<4>(w, x),
              dense_gflops<6>(w, x));
  if constexpr (kRows >= 12) {
    std::printf(", 8 %.0f, 12 %.0f", dense_gflops<(kRows >= 12 ? 8 : 1)>(w, x),
                dense_gflops<(kRows >= 12 ? 12 : 1)>(w, x));
  }
  std::printf("\n");
}

// ns per 64 code bytes (128 weights) of the int4 kernels (group 128, float32 scales) over 32
// tiles of K = 512 (128 kB of codes: L2-resident), `n` rows.
void q4_line() {
  const int64_t K = 512, G = 128, tiles = 32;
  std::vector<uint8_t> codes(tiles * K / 2 * kTile);
  for (auto& b : codes) b = static_cast<uint8_t>(std::rand());
  std::vector<float> scales(tiles * K / G * kTile, 0.01f), a(2 * K, 0.5f);
  alignas(64) float c[2 * kTile];
  const Q4Weights<Q4::kInt4> w{codes.data(), scales.data(), nullptr, K, G};
  auto ns = [&](auto&& kernel) {
    const double s = best_seconds([&] {
      for (int64_t t = 0; t < tiles; ++t) {
        kernel(t);
        escape(c);
      }
    });
    return s / (tiles * K / 8) * 1e9;
  };
  const double one = ns([&](int64_t t) { w.rows(t, a.data(), K, 1, c); });
  const double two = ns([&](int64_t t) { w.rows(t, a.data(), K, 2, c); });
  std::printf("int4 (group 128), L2-hot, ns per 64 code bytes: 1 row %.2f (%.1f GB/s), 2 rows "
              "%.2f (%.1f GB/s)\n", one, 64 / one, two, 64 / two);
#if MOE_ENGINE_VECTOR_BITS == 512
  const double pair = ns([&](int64_t t) {
    micro_kernel_q4<1, Q4::kInt4, true, false>(w, t, a.data(), K, c);
  });
  std::printf("  the k-pair kernel at 1 row (what the 64-byte-chunk kernel replaced): %.2f "
              "(%.1f GB/s)\n", pair, 64 / pair);
#endif
}

// GB/s of a 4-accumulator load loop over 64 MB of buffers of `bytes`, rotated (L3/DRAM).
void read_line(size_t bytes) {
  const size_t n = bytes / 4, copies = std::max<size_t>(1, size_t(64e6) / bytes);
  std::vector<std::vector<float>> bufs(copies, std::vector<float>(n, 1.0f));
  volatile float sink = 0;
  const double s = best_seconds([&] {
    for (auto& b : bufs) {
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (size_t i = 0; i + 32 <= n; i += 32) {
        a0 = _mm256_add_ps(a0, _mm256_loadu_ps(&b[i]));
        a1 = _mm256_add_ps(a1, _mm256_loadu_ps(&b[i + 8]));
        a2 = _mm256_add_ps(a2, _mm256_loadu_ps(&b[i + 16]));
        a3 = _mm256_add_ps(a3, _mm256_loadu_ps(&b[i + 24]));
      }
      alignas(32) float t[8];
      _mm256_store_ps(t, _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
      sink = sink + t[0];
    }
  }, 5);
  std::printf("read loop, %zu buffers of %zu kB rotated: %.1f GB/s\n", copies, bytes / 1000,
              copies * bytes / s / 1e9);
}

int main() {
  std::printf("build: %d-bit vectors, kRows %d\n", MOE_ENGINE_VECTOR_BITS, kRows);
  dense_sweep("bf16", uint16_t{0x3C00});
  dense_sweep("f32", 0.5f);
  q4_line();
  read_line(786432);
  read_line(8388608);
}
