// 4-bit weight decoding for AVX-512 (MXFP4 and int4), the `Q4Weights` of moe_cpu.cpp's
// AVX-512 build (q4.h chooses it; the AVX2 twin is q4_avx2.h). Same packed bytes, same
// interface, same decoded values.
//
// Layout (moe_cpu.cpp's header comment): per k pair 16 bytes, bytes 0-7 for k and 8-15 for
// k + 1; byte i holds column L(i) = i + 4 * (i / 4) in its low nibble and L(i) + 4 in its high
// nibble. Decoding a pair:
//   1. interleave the two halves bytewise (vpunpcklbw with the pair shifted by 8 bytes), and
//      zero-extend to 16 dwords: dword 2i is byte i of k, dword 2i + 1 byte i of k + 1;
//   2. look the low nibble up in a 16-entry float32 table with vpermps, which reads only the
//      low 4 bits of each index (so no mask is needed), and the high nibble after a 4-bit
//      shift: two vectors of 16 weights whose lane j holds column L(j / 2) (low) or
//      L(j / 2) + 4 (high) of k + j % 2, already float32.
//   * MXFP4 (OCP Microscaling Formats (MX) Specification v1.0, 2023): the table holds the 16
//     E2M1 values, scales 2^(s - 127) from the E8M0 bytes (0 -> 2^-127, 255 -> NaN).
//   * int4 (quant/int4.py): the table holds q - 8 (symmetric) or q, minus the zero points as
//     float32 (asymmetric; exact, small integers); scales float32, bfloat16 (a shift) or
//     float16 (vcvtph2ps).
// The activations of a pair are one 64-bit broadcast per row, (x[k], x[k + 1]) in every lane
// pair; scales and zero points are permuted once per block into the lanes' column order, and
// the two accumulators (low, high) of a row back into columns 0-15 once per tile (adding each
// lane pair: its k and k + 1 halves). The decoded weights are exactly quant/'s dequantized
// values; with one or two rows a block's products are summed unscaled and scaled once per block
// (q4_avx2.h's kBlockScale, unrolled over k pairs for 8 independent FMA chains), with more rows
// the decoded weights are scaled, shared by the rows. One and two rows with G % 8 == 0 (every
// checkpoint's block size) run q4_avx512_x8.h's kernel instead: measured 1.6x this one's speed
// at one row (bench/NOTES.md section 11).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "gemm.h"

namespace moe_engine {

// Lane j of a decoded vector holds column low_lane_columns()[j] (low nibbles) or that + 4.
MOE_ENGINE_INLINE __m512i low_lane_columns() {
  return _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 8, 8, 9, 9, 10, 10, 11, 11);
}
MOE_ENGINE_INLINE __m512i high_lane_columns() {
  return _mm512_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7, 12, 12, 13, 13, 14, 14, 15, 15);
}

// Column c of k (even lanes; +1: k + 1, odd lanes) in (low, high) = permutex2var's (a, b).
MOE_ENGINE_INLINE __m512i even_lanes_to_columns() {
  return _mm512_setr_epi32(0, 2, 4, 6, 16, 18, 20, 22, 8, 10, 12, 14, 24, 26, 28, 30);
}

// 16 scales of the format's dtype (natural column order) -> float32.
template <Q4 F>
MOE_ENGINE_INLINE __m512 load_scales16(const void* scales, int64_t at) {
  if constexpr (F == Q4::kMxfp4) {
    const auto* s8 = static_cast<const uint8_t*>(scales) + at;
    const __m512i s = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s8)));
    __m512i bits = _mm512_slli_epi32(s, 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_setzero_si512()),
                                 _mm512_set1_epi32(0x00400000));  // 2^-127, a subnormal
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(s, _mm512_set1_epi32(255)),
                                 _mm512_set1_epi32(0x7FC00000));  // NaN
    return _mm512_castsi512_ps(bits);
  } else {
    const auto* p16 = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(scales) + at);
    if constexpr (F == Q4::kInt4Bf16) {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
          _mm256_loadu_si256(p16)), 16));
    } else if constexpr (F == Q4::kInt4F16) {
      return _mm512_cvtph_ps(_mm256_loadu_si256(p16));
    } else {
      return _mm512_loadu_ps(static_cast<const float*>(scales) + at);
    }
  }
}

// One block's values in the decoded vectors' lane order: scales, and (asymmetric int4) zero
// points as float32.
struct Q4Block {
  __m512 sl, sh, zl, zh;
};

template <Q4 F>
struct Q4Weights {
  const uint8_t* codes;   // [tiles][K / 2][16]
  const void* scales;     // MXFP4: uint8 E8M0; int4: float32/bf16/fp16 (F); [tiles][K / G][16]
  const uint8_t* zeros;   // int4 asymmetric: uint8 [tiles][K / G][16]; else null (z = 8)
  int64_t K, G;

  // The code -> value table: E2M1 (MXFP4), q - 8 (symmetric int4) or q (asymmetric).
  MOE_ENGINE_INLINE __m512 table() const {
    if constexpr (F == Q4::kMxfp4) {
      return _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f, -0.5f,
                            -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
    } else {
      const __m512 q = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      return zeros ? q : _mm512_sub_ps(q, _mm512_set1_ps(8.0f));
    }
  }

  MOE_ENGINE_INLINE Q4Block block(int64_t tile, int64_t g) const {
    const int64_t at = (tile * (K / G) + g) * kTile;
    const __m512 s = load_scales16<F>(scales, at);
    Q4Block b;
    b.sl = _mm512_permutexvar_ps(low_lane_columns(), s);
    b.sh = _mm512_permutexvar_ps(high_lane_columns(), s);
    b.zl = b.zh = _mm512_setzero_ps();
    if (F != Q4::kMxfp4 && zeros) {
      const __m512 z = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(zeros + at))));
      b.zl = _mm512_permutexvar_ps(low_lane_columns(), z);
      b.zh = _mm512_permutexvar_ps(high_lane_columns(), z);
    }
    return b;
  }

  // Sixteen code bytes (a k pair) -> low and high vectors, unscaled (lane order above);
  // kZeros: asymmetric int4 (zeros not null), the zero points subtracted.
  template <bool kZeros>
  MOE_ENGINE_INLINE static void decode_pair(const uint8_t* p, __m512 t, const Q4Block& b,
                                            __m512& wl, __m512& wh) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m512i d = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(raw, _mm_srli_si128(raw, 8)));
    wl = _mm512_permutexvar_ps(d, t);
    wh = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), t);
    if constexpr (kZeros) {
      wl = _mm512_sub_ps(wl, b.zl);
      wh = _mm512_sub_ps(wh, b.zh);
    }
  }

  MOE_ENGINE_INLINE void rows(int64_t tile, const float* a, int64_t lda, int n, float* c) const;

  // Dequantize tile `tile` to float32 out [K][16] (the dense layout).
  MOE_ENGINE_INLINE void dequantize(int64_t tile, float* out) const {
    if (F != Q4::kMxfp4 && zeros) return dequantize_as<true>(tile, out);
    dequantize_as<false>(tile, out);
  }

  template <bool kZeros>
  MOE_ENGINE_INLINE void dequantize_as(int64_t tile, float* out) const {
    const uint8_t* p = codes + tile * (K / 2) * kTile;
    const __m512 t = table();
    const __m512i even = even_lanes_to_columns();
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
    for (int64_t g = 0; g < K / G; ++g) {
      const Q4Block b = block(tile, g);
      for (int64_t k = g * G; k < (g + 1) * G; k += 2, p += kTile) {
        __m512 wl, wh;
        decode_pair<kZeros>(p, t, b, wl, wh);
        wl = _mm512_mul_ps(wl, b.sl);
        wh = _mm512_mul_ps(wh, b.sh);
        _mm512_storeu_ps(out + k * kTile, _mm512_permutex2var_ps(wl, even, wh));
        _mm512_storeu_ps(out + (k + 1) * kTile, _mm512_permutex2var_ps(wl, odd, wh));
      }
    }
  }
};

// (x[k], x[k + 1]) in every lane pair.
MOE_ENGINE_INLINE __m512 pair_broadcast(const float* x) {
  double d;
  std::memcpy(&d, x, sizeof d);
  return _mm512_castpd_ps(_mm512_set1_pd(d));
}

// Low and high accumulators (lane order) -> c[0..16) in column order.
MOE_ENGINE_INLINE void store_columns(__m512 l, __m512 h, float* c) {
  l = _mm512_add_ps(l, _mm512_permute_ps(l, 0xB1));  // k + (k + 1), in both lanes of a pair
  h = _mm512_add_ps(h, _mm512_permute_ps(h, 0xB1));
  _mm512_storeu_ps(c, _mm512_permutex2var_ps(l, even_lanes_to_columns(), h));
}

// c[m][0..16) = sum_k a[m * lda + k] * w[k][0..16), m < M, w the dequantized tile `tile`.
// kBlockScale: each block's products summed unscaled, in U k pairs' separate accumulators
// (2 U M FMA chains: 8 at one and two rows), scaled once per block; else the decoded weights
// are scaled, each once, shared by the M rows.
template <int M, Q4 F, bool kBlockScale, bool kZeros>
MOE_ENGINE_INLINE void micro_kernel_q4(const Q4Weights<F>& w, int64_t tile, const float* a,
                                       int64_t lda, float* c) {
  const int64_t K = w.K, G = w.G;
  const __m512 t = w.table();
  __m512 lo[M], hi[M];
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
  const uint8_t* p = w.codes + tile * (K / 2) * kTile;
  for (int64_t g = 0; g < K / G; ++g) {
    const Q4Block b = w.block(tile, g);
    const int64_t end = (g + 1) * G;
    if constexpr (kBlockScale) {
      constexpr int U = M == 1 ? 4 : 2;
      __m512 pl[U][M], ph[U][M];
      for (int u = 0; u < U; ++u) {
        for (int m = 0; m < M; ++m) pl[u][m] = ph[u][m] = _mm512_setzero_ps();
      }
      auto pair = [&](int u, int64_t k) MOE_ENGINE_LAMBDA_INLINE {
        __m512 wl, wh;
        Q4Weights<F>::template decode_pair<kZeros>(p, t, b, wl, wh);
        p += kTile;
        for (int m = 0; m < M; ++m) {
          const __m512 x = pair_broadcast(a + m * lda + k);
          pl[u][m] = _mm512_fmadd_ps(x, wl, pl[u][m]);
          ph[u][m] = _mm512_fmadd_ps(x, wh, ph[u][m]);
        }
      };
      int64_t k = g * G;
      for (; k + 2 * U <= end; k += 2 * U) {
        prefetch_weights<U>(p);
        for (int u = 0; u < U; ++u) pair(u, k + 2 * u);
      }
      for (; k < end; k += 2) pair(0, k);
      for (int m = 0; m < M; ++m) {
        for (int u = 1; u < U; ++u) {
          pl[0][m] = _mm512_add_ps(pl[0][m], pl[u][m]);
          ph[0][m] = _mm512_add_ps(ph[0][m], ph[u][m]);
        }
        lo[m] = _mm512_fmadd_ps(pl[0][m], b.sl, lo[m]);
        hi[m] = _mm512_fmadd_ps(ph[0][m], b.sh, hi[m]);
      }
    } else {
      for (int64_t k = g * G; k < end; k += 2, p += kTile) {
        prefetch_weights<1>(p);
        __m512 wl, wh;
        Q4Weights<F>::template decode_pair<kZeros>(p, t, b, wl, wh);
        wl = _mm512_mul_ps(wl, b.sl);
        wh = _mm512_mul_ps(wh, b.sh);
        for (int m = 0; m < M; ++m) {
          const __m512 x = pair_broadcast(a + m * lda + k);
          lo[m] = _mm512_fmadd_ps(x, wl, lo[m]);
          hi[m] = _mm512_fmadd_ps(x, wh, hi[m]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) store_columns(lo[m], hi[m], c + m * kTile);
}

}  // namespace moe_engine

#include "q4_avx512_x8.h"  // needs load_scales16 and Q4Weights above

namespace moe_engine {

// Out of line (the switch's 12 kernels inlined at every call site made moe_cpu.cpp take 50 s to
// compile); one call per tile and row block costs nothing beside the kernel's K loop.
template <Q4 F, bool kZeros>
__attribute__((noinline)) void q4_rows(const Q4Weights<F>& w, int64_t tile, const float* a,
                                       int64_t lda, int n, float* c) {
  const bool x8 = w.G % 8 == 0;  // q4_avx512_x8.h
  switch (n) {
    case 1:
      if (x8) return micro_kernel_q4x8<1, F, kZeros>(w, tile, a, lda, c);
      return micro_kernel_q4<1, F, true, kZeros>(w, tile, a, lda, c);
    case 2:
      if (x8) return micro_kernel_q4x8<2, F, kZeros>(w, tile, a, lda, c);
      return micro_kernel_q4<2, F, true, kZeros>(w, tile, a, lda, c);
    case 3: micro_kernel_q4<3, F, false, kZeros>(w, tile, a, lda, c); break;
    case 4: micro_kernel_q4<4, F, false, kZeros>(w, tile, a, lda, c); break;
    case 5: micro_kernel_q4<5, F, false, kZeros>(w, tile, a, lda, c); break;
    case 6: micro_kernel_q4<6, F, false, kZeros>(w, tile, a, lda, c); break;
    case 7: micro_kernel_q4<7, F, false, kZeros>(w, tile, a, lda, c); break;
    case 8: micro_kernel_q4<8, F, false, kZeros>(w, tile, a, lda, c); break;
    case 9: micro_kernel_q4<9, F, false, kZeros>(w, tile, a, lda, c); break;
    case 10: micro_kernel_q4<10, F, false, kZeros>(w, tile, a, lda, c); break;
    case 11: micro_kernel_q4<11, F, false, kZeros>(w, tile, a, lda, c); break;
    default: micro_kernel_q4<12, F, false, kZeros>(w, tile, a, lda, c); break;
  }
}

template <Q4 F>
MOE_ENGINE_INLINE void Q4Weights<F>::rows(int64_t tile, const float* a, int64_t lda, int n,
                                          float* c) const {
  if constexpr (F != Q4::kMxfp4) {
    if (zeros) return q4_rows<F, true>(*this, tile, a, lda, n, c);
  }
  q4_rows<F, false>(*this, tile, a, lda, n, c);
}

}  // namespace moe_engine
