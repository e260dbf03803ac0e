// 4-bit weight decoding for AVX2 (MXFP4 and int4), the `Q4Weights` of moe_cpu.cpp's AVX2
// build (q4.h chooses it; the AVX-512 twin is q4_avx512.h).
//
// Layout (moe_cpu.cpp's header comment): codes [tiles][K / 2][16] bytes, per k 8 bytes, byte i
// holding column i + 4 * (i / 4) in its low nibble and that column + 4 in its high nibble, the
// 8 bytes of an even k followed by those of k + 1; scales (and zero points) [tiles][K / G][16].
// This order turns 16 bytes (two k) into four vectors of 8 columns with in-lane shuffles only:
// the low nibbles go to the low 128-bit lane and the high nibbles to the high lane, and
// unpacking bytes then words against zero yields (k, 0-7), (k, 8-15), (k+1, 0-7), (k+1, 8-15).
//   * MXFP4: a code is decoded by two 16-entry byte tables (vpshufb): the low and high byte of
//     the bfloat16 of its E2M1 value (every E2M1 value is a bfloat16), so the float32 weight
//     needs no conversion instruction.
//   * int4: q - z is formed in int8, unpacked into the top byte of an int32 (so exactly
//     (q - z) * 2^24) and converted; the 2^-24 is folded into the scale (exact for
//     |scale| >= 2^-102; the one- and two-row kernels' block sums of x * (q - z) * 2^24 stay
//     finite for |x| < 2^100 / G).
// With one or two rows the kernel accumulates a block's products with the unscaled values and
// multiplies the block's partial sums by the column scales once (measured 5-10% faster at
// decode sizes than scaling every weight; the sum rounds differently, within float32
// rounding); with 3-6 rows it scales the decoded weights, shared by the rows.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "gemm.h"

namespace moe_engine {

// Eight int4 scales of the format's dtype -> float32 (exact for all three).
template <Q4 F>
MOE_ENGINE_INLINE __m256 load_scales(const void* scales, int64_t at) {
  if constexpr (F == Q4::kInt4Bf16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(scales) + at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
  } else if constexpr (F == Q4::kInt4F16) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
        static_cast<const uint16_t*>(scales) + at)));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(scales) + at);
  }
}

// bfloat16 bit patterns of the 16 E2M1 values (OCP MX v1.0: codes 0-7 are 0, 0.5, 1, 1.5, 2, 3,
// 4, 6; codes 8-15 the same with the sign bit), split into low and high bytes, repeated in both
// 128-bit lanes for vpshufb.
MOE_ENGINE_INLINE __m256i e2m1_bf16_low_bytes() {
  const __m128i t = _mm_setr_epi8(0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40, char(0x80),
                                  char(0xC0), 0x00, 0x00, char(0x80), char(0xC0), 0x00, 0x40,
                                  char(0x80), char(0xC0));
  return _mm256_broadcastsi128_si256(t);
}
MOE_ENGINE_INLINE __m256i e2m1_bf16_high_bytes() {
  const __m128i t = _mm_setr_epi8(0x00, 0x3F, 0x3F, 0x3F, 0x40, 0x40, 0x40, 0x40, char(0x80),
                                  char(0xBF), char(0xBF), char(0xBF), char(0xC0), char(0xC0),
                                  char(0xC0), char(0xC0));
  return _mm256_broadcastsi128_si256(t);
}

// Eight E8M0 scale bytes -> 2^(s - 127) as float32 (s = 0: 2^-127, a subnormal; s = 255: NaN).
MOE_ENGINE_INLINE __m256 e8m0_to_ps(const uint8_t* s8) {
  const __m256i s = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s8)));
  __m256i bits = _mm256_slli_epi32(s, 23);
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x00400000),
                            _mm256_cmpeq_epi32(s, _mm256_setzero_si256()));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC00000),
                            _mm256_cmpeq_epi32(s, _mm256_set1_epi32(255)));
  return _mm256_castsi256_ps(bits);
}

// Per-block decoding state of one tile: the scale of columns 0-7 and 8-15, and the table
// registers (MXFP4: E2M1 byte tables; int4: the zero points in the nibble vector's order).
struct Q4Block {
  __m256 s0, s1;
  __m256i t0, t1;
};

// Zero points z[0..16) (natural column order) arranged like the nibble vector of a k pair: low
// lane bytes 0-3, 4-7, 8-11, 12-15 = columns 0-3, 8-11, 0-3, 8-11; high lane = columns 4-7,
// 12-15, 4-7, 12-15.
MOE_ENGINE_INLINE __m256i arrange_zeros(const uint8_t* z) {
  const __m256i b =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(z)));
  const __m256i perm = _mm256_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11,
                                        4, 5, 6, 7, 12, 13, 14, 15, 4, 5, 6, 7, 12, 13, 14, 15);
  return _mm256_shuffle_epi8(b, perm);
}

template <Q4 F>
struct Q4Weights {
  const uint8_t* codes;   // [tiles][K / 2][16]
  const void* scales;     // MXFP4: uint8 E8M0; int4: float32/bf16/fp16 (F); [tiles][K / G][16]
  const uint8_t* zeros;   // int4 asymmetric: uint8 [tiles][K / G][16]; else null (z = 8)
  int64_t K, G;

  MOE_ENGINE_INLINE Q4Block block(int64_t tile, int64_t g) const {
    const int64_t at = (tile * (K / G) + g) * kTile;
    Q4Block b;
    if constexpr (F == Q4::kMxfp4) {
      const uint8_t* s = static_cast<const uint8_t*>(scales) + at;
      b.s0 = e8m0_to_ps(s);
      b.s1 = e8m0_to_ps(s + 8);
      b.t0 = e2m1_bf16_low_bytes();
      b.t1 = e2m1_bf16_high_bytes();
    } else {
      const __m256 unit = _mm256_set1_ps(1.0f / 16777216.0f);  // 2^-24
      b.s0 = _mm256_mul_ps(load_scales<F>(scales, at), unit);
      b.s1 = _mm256_mul_ps(load_scales<F>(scales, at + 8), unit);
      b.t0 = zeros ? arrange_zeros(zeros + at) : _mm256_set1_epi8(8);
      b.t1 = b.t0;
    }
    return b;
  }

  MOE_ENGINE_INLINE void rows(int64_t tile, const float* a, int64_t lda, int n, float* c) const;

  // Dequantize tile `tile` to float32 out [K][16] (the dense layout).
  MOE_ENGINE_INLINE void dequantize(int64_t tile, float* out) const;
};

// Sixteen code bytes (k and k + 1 of one tile) -> the four weight vectors (k, 0-7),
// (k, 8-15), (k+1, 0-7), (k+1, 8-15), unscaled: E2M1 values (MXFP4) or (q - z) * 2^24 (int4).
template <Q4 F>
MOE_ENGINE_INLINE void decode_pair(const uint8_t* p, const Q4Block& b, __m256& f0, __m256& f1,
                                   __m256& f2, __m256& f3) {
  const __m256i raw =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  // low lane: low nibbles; high lane: high nibbles (shifted down by 4)
  const __m256i n = _mm256_and_si256(_mm256_srlv_epi64(raw, _mm256_setr_epi64x(0, 0, 4, 4)),
                                     _mm256_set1_epi8(0x0F));
  const __m256i zero = _mm256_setzero_si256();
  __m256i lo, hi;
  if constexpr (F == Q4::kMxfp4) {
    const __m256i l = _mm256_shuffle_epi8(b.t0, n), h = _mm256_shuffle_epi8(b.t1, n);
    lo = _mm256_unpacklo_epi8(l, h);  // bfloat16 of bytes 0-7 of each lane
    hi = _mm256_unpackhi_epi8(l, h);  // bytes 8-15
  } else {
    const __m256i v = _mm256_sub_epi8(n, b.t0);
    lo = _mm256_unpacklo_epi8(zero, v);  // (q - z) * 2^8 as int16
    hi = _mm256_unpackhi_epi8(zero, v);
  }
  __m256i i0 = _mm256_unpacklo_epi16(zero, lo), i1 = _mm256_unpackhi_epi16(zero, lo);
  __m256i i2 = _mm256_unpacklo_epi16(zero, hi), i3 = _mm256_unpackhi_epi16(zero, hi);
  if constexpr (F == Q4::kMxfp4) {
    f0 = _mm256_castsi256_ps(i0);
    f1 = _mm256_castsi256_ps(i1);
    f2 = _mm256_castsi256_ps(i2);
    f3 = _mm256_castsi256_ps(i3);
  } else {
    f0 = _mm256_cvtepi32_ps(i0);
    f1 = _mm256_cvtepi32_ps(i1);
    f2 = _mm256_cvtepi32_ps(i2);
    f3 = _mm256_cvtepi32_ps(i3);
  }
}

// c[m][0..16) = sum_k a[m * lda + k] * w[k][0..16), m < M, w the dequantized tile `tile`.
// kBlockScale: accumulate each block's partial sums of x * code and scale them once per block
// (M <= 2); else scale the decoded weights (each weight once, shared by the M rows).
template <int M, Q4 F, bool kBlockScale>
MOE_ENGINE_INLINE void micro_kernel_q4(const Q4Weights<F>& w, int64_t tile, const float* a,
                                       int64_t lda, float* c) {
  const int64_t K = w.K, G = w.G;
  __m256 lo[M], hi[M];
  for (int m = 0; m < M; ++m) {
    lo[m] = _mm256_setzero_ps();
    hi[m] = _mm256_setzero_ps();
  }
  const uint8_t* p = w.codes + tile * (K / 2) * kTile;
  for (int64_t g = 0; g < K / G; ++g) {
    const Q4Block b = w.block(tile, g);
    if constexpr (kBlockScale) {
      // two accumulators per row and half (even and odd k): independent FMA chains (a second
      // set over U k pairs measured no faster: this kernel is bound by decoding, not by the
      // FMA latency)
      __m256 pl0[M], ph0[M], pl1[M], ph1[M];
      for (int m = 0; m < M; ++m) {
        pl0[m] = ph0[m] = pl1[m] = ph1[m] = _mm256_setzero_ps();
      }
      for (int64_t k = g * G; k < (g + 1) * G; k += 2, p += kTile) {
        __m256 f0, f1, f2, f3;
        decode_pair<F>(p, b, f0, f1, f2, f3);
        for (int m = 0; m < M; ++m) {
          const __m256 x0 = _mm256_broadcast_ss(a + m * lda + k);
          const __m256 x1 = _mm256_broadcast_ss(a + m * lda + k + 1);
          pl0[m] = _mm256_fmadd_ps(x0, f0, pl0[m]);
          ph0[m] = _mm256_fmadd_ps(x0, f1, ph0[m]);
          pl1[m] = _mm256_fmadd_ps(x1, f2, pl1[m]);
          ph1[m] = _mm256_fmadd_ps(x1, f3, ph1[m]);
        }
      }
      for (int m = 0; m < M; ++m) {
        lo[m] = _mm256_fmadd_ps(_mm256_add_ps(pl0[m], pl1[m]), b.s0, lo[m]);
        hi[m] = _mm256_fmadd_ps(_mm256_add_ps(ph0[m], ph1[m]), b.s1, hi[m]);
      }
    } else {
      for (int64_t k = g * G; k < (g + 1) * G; k += 2, p += kTile) {
        __m256 f0, f1, f2, f3;
        decode_pair<F>(p, b, f0, f1, f2, f3);
        f0 = _mm256_mul_ps(f0, b.s0);
        f1 = _mm256_mul_ps(f1, b.s1);
        f2 = _mm256_mul_ps(f2, b.s0);
        f3 = _mm256_mul_ps(f3, b.s1);
        for (int m = 0; m < M; ++m) {
          const __m256 x0 = _mm256_broadcast_ss(a + m * lda + k);
          const __m256 x1 = _mm256_broadcast_ss(a + m * lda + k + 1);
          lo[m] = _mm256_fmadd_ps(x0, f0, lo[m]);
          hi[m] = _mm256_fmadd_ps(x0, f1, hi[m]);
          lo[m] = _mm256_fmadd_ps(x1, f2, lo[m]);
          hi[m] = _mm256_fmadd_ps(x1, f3, hi[m]);
        }
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    _mm256_storeu_ps(c + m * kTile, lo[m]);
    _mm256_storeu_ps(c + m * kTile + 8, hi[m]);
  }
}

template <Q4 F>
MOE_ENGINE_INLINE void Q4Weights<F>::dequantize(int64_t tile, float* out) const {
  const uint8_t* p = codes + tile * (K / 2) * kTile;
  for (int64_t g = 0; g < K / G; ++g) {
    const Q4Block b = block(tile, g);
    for (int64_t k = g * G; k < (g + 1) * G; k += 2, p += kTile) {
      __m256 f0, f1, f2, f3;
      decode_pair<F>(p, b, f0, f1, f2, f3);
      float* o = out + k * kTile;
      _mm256_storeu_ps(o, _mm256_mul_ps(f0, b.s0));
      _mm256_storeu_ps(o + 8, _mm256_mul_ps(f1, b.s1));
      _mm256_storeu_ps(o + 16, _mm256_mul_ps(f2, b.s0));
      _mm256_storeu_ps(o + 24, _mm256_mul_ps(f3, b.s1));
    }
  }
}

template <Q4 F>
MOE_ENGINE_INLINE void Q4Weights<F>::rows(int64_t tile, const float* a, int64_t lda, int n,
                                          float* c) const {
  switch (n) {
    case 1: micro_kernel_q4<1, F, true>(*this, tile, a, lda, c); break;
    case 2: micro_kernel_q4<2, F, true>(*this, tile, a, lda, c); break;
    case 3: micro_kernel_q4<3, F, false>(*this, tile, a, lda, c); break;
    case 4: micro_kernel_q4<4, F, false>(*this, tile, a, lda, c); break;
    case 5: micro_kernel_q4<5, F, false>(*this, tile, a, lda, c); break;
    default: micro_kernel_q4<6, F, false>(*this, tile, a, lda, c); break;
  }
}

}  // namespace moe_engine
