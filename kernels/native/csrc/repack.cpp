// Load-time repack of expert weights into the fused MoE kernel's tiles (csrc/moe_cpu.cpp), in
// one pass from the checkpoint's rows: the torch path (kernels/moe/native.py `pack_q4_tiles`,
// `pack_tiles`) unpacks every 4-bit code into a byte, pads, transposes and gathers columns,
// four full-size temporaries per projection (measured in bench/NOTES.md section 29: 10 s of a
// gpt-oss-20b layer's 0.4 GB of MXFP4 experts on this project's 2-core machine).
//
// Both functions write tiles of 16 output rows stored k-major: tile t of expert e holds rows
// 16t .. 16t + 15 (rows past N are zero: padding), and for each k the 16 rows' values
// contiguously. The results are byte for byte those of the torch path.
//
// 4-bit codes (moe_pack_q4_tiles): a source row is K codes as K/2 bytes, code 2j in the low
// nibble of byte j and 2j + 1 in its high nibble (quant/packing.py; gpt-oss's MXFP4 blocks and
// quant.int4 alike). The tile row of codes k = 2j, 2j + 1 is 16 bytes: for k = 2j, byte i holds
// column kLow[i] in its low nibble and kHigh[i] in its high one; bytes 8-15 the same for 2j + 1
// (kernels/moe/native.py Q4_LOW_COLUMNS / Q4_HIGH_COLUMNS). Per 16 source bytes of the 16 rows
// of a tile, a 16 x 16 byte transpose (SSE unpacks) gives each j's 16 column bytes, and two
// shuffles and four masks give the tile row.

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <new>
#include <vector>

#include "moe_engine_cpu.h"
#include "thread_pool.h"

namespace {

constexpr int64_t kTile = 16;

// out[j] = byte j of each of the 16 rows r[0..15] (out[j] byte c = r[c][j]).
inline void transpose16(const __m128i r[16], __m128i out[16]) {
  __m128i a[16], b[16], c[16];
  for (int i = 0; i < 8; ++i) {  // rows 2i, 2i + 1 interleaved: bytes 0-7, then 8-15
    a[2 * i] = _mm_unpacklo_epi8(r[2 * i], r[2 * i + 1]);
    a[2 * i + 1] = _mm_unpackhi_epi8(r[2 * i], r[2 * i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // rows 4g .. 4g + 3; b[4g + m]: bytes 4m .. 4m + 3
    b[4 * g] = _mm_unpacklo_epi16(a[4 * g], a[4 * g + 2]);
    b[4 * g + 1] = _mm_unpackhi_epi16(a[4 * g], a[4 * g + 2]);
    b[4 * g + 2] = _mm_unpacklo_epi16(a[4 * g + 1], a[4 * g + 3]);
    b[4 * g + 3] = _mm_unpackhi_epi16(a[4 * g + 1], a[4 * g + 3]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7; c[8h + q]: bytes 2q, 2q + 1
    for (int m = 0; m < 4; ++m) {
      c[8 * h + 2 * m] = _mm_unpacklo_epi32(b[8 * h + m], b[8 * h + 4 + m]);
      c[8 * h + 2 * m + 1] = _mm_unpackhi_epi32(b[8 * h + m], b[8 * h + 4 + m]);
    }
  }
  for (int q = 0; q < 8; ++q) {
    out[2 * q] = _mm_unpacklo_epi64(c[q], c[8 + q]);
    out[2 * q + 1] = _mm_unpackhi_epi64(c[q], c[8 + q]);
  }
}

// The 16-byte tile row of codes 2j, 2j + 1 from w (byte c: column c's source byte j).
inline __m128i q4_tile_row(__m128i w) {
  const __m128i low_cols = _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 0, 1, 2, 3, 8, 9, 10, 11);
  const __m128i high_cols = _mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 4, 5, 6, 7, 12, 13, 14,
                                          15);
  const __m128i lo4 = _mm_set1_epi8(0x0F), hi4 = _mm_set1_epi8(static_cast<char>(0xF0));
  const __m128i a = _mm_shuffle_epi8(w, low_cols), b = _mm_shuffle_epi8(w, high_cols);
  const __m128i first = _mm_or_si128(_mm_and_si128(a, lo4),
                                     _mm_slli_epi16(_mm_and_si128(b, lo4), 4));
  const __m128i second = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(a, 4), lo4),
                                      _mm_and_si128(b, hi4));
  return _mm_unpacklo_epi64(first, second);
}

// The same for one j, one byte at a time (a row's tail of fewer than 16 bytes).
inline void q4_tile_row_scalar(const uint8_t w[16], uint8_t* out) {
  static constexpr int kLow[8] = {0, 1, 2, 3, 8, 9, 10, 11};
  static constexpr int kHigh[8] = {4, 5, 6, 7, 12, 13, 14, 15};
  for (int i = 0; i < 8; ++i) {
    const uint8_t a = w[kLow[i]], b = w[kHigh[i]];
    out[i] = static_cast<uint8_t>((a & 0x0F) | ((b & 0x0F) << 4));
    out[8 + i] = static_cast<uint8_t>((a >> 4) | (b & 0xF0));
  }
}

// One tile: rows[c] the 16 source rows (half = K/2 bytes each) -> dst [half, 16] bytes.
void q4_tile(const uint8_t* const rows[16], int64_t half, uint8_t* dst) {
  int64_t j = 0;
  __m128i r[16], w[16];
  for (; j + 16 <= half; j += 16) {
    for (int c = 0; c < 16; ++c)
      r[c] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[c] + j));
    transpose16(r, w);
    for (int q = 0; q < 16; ++q)
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (j + q) * kTile), q4_tile_row(w[q]));
  }
  for (; j < half; ++j) {
    uint8_t col[16];
    for (int c = 0; c < 16; ++c) col[c] = rows[c][j];
    q4_tile_row_scalar(col, dst + j * kTile);
  }
}

// One tile of elements of type T: rows[c] the 16 source rows of K elements -> dst [K, 16].
template <typename T>
void value_tile(const uint8_t* const rows[16], int64_t K, uint8_t* dst) {
  const T* src[16];
  for (int c = 0; c < 16; ++c) src[c] = reinterpret_cast<const T*>(rows[c]);
  T* out = reinterpret_cast<T*>(dst);
  for (int64_t k = 0; k < K; ++k)
    for (int c = 0; c < 16; ++c) out[k * kTile + c] = src[c][k];
}

// Runs tile(rows of tile, dst of tile) for every (expert, tile), rows past N reading `zeros`.
template <typename F>
void for_each_tile(const int64_t* experts, int64_t E, int64_t N, int64_t row_stride,
                   const uint8_t* zeros, uint8_t* dst, int64_t dst_expert_stride,
                   int64_t tile_bytes, int32_t threads, const F& tile) {
  const int64_t tiles = (N + kTile - 1) / kTile;
  moe_engine::parallel_items(E * tiles, threads, [&](int64_t item, int) {
    const int64_t e = item / tiles, t = item % tiles;
    const uint8_t* base = reinterpret_cast<const uint8_t*>(experts[e]);
    const uint8_t* rows[16];
    for (int c = 0; c < 16; ++c) {
      const int64_t n = t * kTile + c;
      rows[c] = n < N ? base + n * row_stride : zeros;
    }
    tile(rows, dst + e * dst_expert_stride + t * tile_bytes);
  });
}

}  // namespace

int32_t moe_pack_q4_tiles(const int64_t* experts, int64_t E, int64_t N, int64_t K,
                          int64_t row_stride, void* dst, int64_t dst_expert_stride,
                          int32_t threads) {
  if (E < 0 || N < 0 || K < 0 || K % 2 || row_stride < K / 2) return kBadArgument;
  const int64_t half = K / 2;
  std::vector<uint8_t> zeros;
  try {
    zeros.assign(static_cast<size_t>(half) + 16, 0);
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  for_each_tile(experts, E, N, row_stride, zeros.data(), static_cast<uint8_t*>(dst),
                dst_expert_stride, half * kTile, threads,
                [&](const uint8_t* const rows[16], uint8_t* out) { q4_tile(rows, half, out); });
  return kOk;
}

int32_t moe_pack_tiles(const int64_t* experts, int64_t E, int64_t N, int64_t K,
                       int64_t elem_bytes, int64_t row_stride, void* dst,
                       int64_t dst_expert_stride, int32_t threads) {
  if (E < 0 || N < 0 || K < 0 || row_stride < K * elem_bytes) return kBadArgument;
  if (elem_bytes != 1 && elem_bytes != 2 && elem_bytes != 4) return kBadArgument;
  std::vector<uint8_t> zeros;
  try {
    zeros.assign(static_cast<size_t>(K * elem_bytes) + 16, 0);
  } catch (const std::bad_alloc&) {
    return kOutOfMemory;
  }
  auto run = [&](auto element) {
    using T = decltype(element);
    for_each_tile(experts, E, N, row_stride, zeros.data(), static_cast<uint8_t*>(dst),
                  dst_expert_stride, K * elem_bytes * kTile, threads,
                  [&](const uint8_t* const rows[16], uint8_t* out) {
                    value_tile<T>(rows, K, out);
                  });
  };
  if (elem_bytes == 1) run(uint8_t{});
  else if (elem_bytes == 2) run(uint16_t{});
  else run(uint32_t{});
  return kOk;
}
