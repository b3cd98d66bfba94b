// y = x @ (W * scale).T (+ bias) for int8 weights with one float32 scale per output,
// bfloat16 x and y, float32 sums.
//
// Half of bfloat16's bytes per weight. An int8 value is exact in bfloat16 (8 bits of
// precision), so each block of weights is widened to bfloat16 in registers (sign-extend,
// convert to float32, round to bfloat16: exact) and multiplied with vdpbf16ps as in
// linear.cpp; the scale multiplies each output's float32 sum once at the end.
//
// From kExpandRows rows on, each block is expanded to bfloat16 once per call (level *
// scale, rounded once) and multiplied by linear.cpp's tiles instead.
//
// Packed layout: linear.cpp's, in int8: blocks of 64 outputs, [ceil(n/64)][k/2][64][2], one
// contiguous stream per block, then the scales, float32 [ceil(n/64) * 64], so that one
// pointer holds the whole weight (as the fused decode layer passes it). 1-6-row tiles
// share each widened vector between rows.
#include <string.h>

#include "blocks.h"
#include "simd.h"

namespace {

using blocks::kBlock;

// 16 int8 weights -> 16 float32 (exact).
inline __m512 to_f32(const int8_t* w) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)w)));
}

// 32 int8 weights (16 outputs x an input pair) -> 32 bfloat16, same order.
inline __m512bh widen(const int8_t* w) {
  return _mm512_cvtne2ps_pbh(to_f32(w + 16), to_f32(w));  // the second fills the low 16 elements
}

template <int MR>
inline void tile(const uint16_t* x, int64_t x_stride, const int8_t* block, int64_t k_steps, const float* scale,
                 const float* bias, uint16_t* y, int64_t y_stride, int64_t valid) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k_steps; ++kk) {
    const int8_t* w = block + kk * kBlock * 2;
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = widen(w + 32 * j);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      memcpy(&pair, x + r * x_stride + 2 * kk, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
    }
  }
  blocks::store_tile<MR>(acc, scale, bias, y, y_stride, valid);
}

int64_t padded(int64_t n) { return blocks::count(n) * kBlock; }
int64_t packed_bytes(int64_t n, int64_t k) { return padded(n) * (k + (int64_t)sizeof(float)); }

// w [n, k] int8 (k even) and scale [n] -> packed, zero-padded to whole blocks.
void pack(const int8_t* w, const float* scale, int64_t n, int64_t k, int8_t* out) {
  blocks::pack<2>(w, n, k, out);
  float* scales = (float*)(out + padded(n) * k);
  for (int64_t o = 0; o < padded(n); ++o) scales[o] = o < n ? scale[o] : 0.0f;
}

// Rows from which a block is expanded to bfloat16 once (level * scale, rounded once) and
// multiplied by linear.cpp's tiles, which run faster than widening in every tile (as in
// linear_int4.cpp; there the two meet around 64-96 rows).
constexpr int64_t kExpandRows = 80;

// One block's weights as bfloat16 in linear.cpp's packed layout ([k/2][64][2]).
void expand_block(const int8_t* block, int64_t k_steps, const float* scale, uint16_t* panel) {
  // Element i of a 16-weight half holds output i/2: each output's scale, twice.
  const __m512i pairs_lo = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i pairs_hi = _mm512_add_epi32(pairs_lo, _mm512_set1_epi32(8));
  __m512 s_lo[4], s_hi[4];
  for (int j = 0; j < 4; ++j) {
    const __m512 s = _mm512_loadu_ps(scale + 16 * j);
    s_lo[j] = _mm512_permutexvar_ps(pairs_lo, s);
    s_hi[j] = _mm512_permutexvar_ps(pairs_hi, s);
  }
  for (int64_t kk = 0; kk < k_steps; ++kk) {
    const int8_t* w = block + kk * kBlock * 2;
    for (int j = 0; j < 4; ++j) {
      const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_mul_ps(to_f32(w + 32 * j + 16), s_hi[j]),
                                             _mm512_mul_ps(to_f32(w + 32 * j), s_lo[j]));
      _mm512_storeu_si512(panel + kk * kBlock * 2 + 32 * j, (__m512i)v);
    }
  }
}

void linear(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* packed, int64_t n,
            const float* bias, uint16_t* y, int64_t y_stride, int threads) {
  const int64_t k_steps = k / 2;
  const float* scale = (const float*)(packed + padded(n) * k);
  if (m >= kExpandRows)
    return blocks::expanded_product(x, m, k, x_stride, n, bias, y, y_stride, threads, [&](int64_t b, uint16_t* panel) {
      expand_block(packed + b * k * kBlock, k_steps, scale + b * kBlock, panel);
    });
  blocks::for_each(n, bias, y, threads, [&](int64_t b, int64_t valid, const float* bb, uint16_t* yb) {
    const int8_t* block = packed + b * k * kBlock;
    const float* sb = scale + b * kBlock;
    int64_t r = 0;
    for (; r + 6 <= m; r += 6)
      tile<6>(x + r * x_stride, x_stride, block, k_steps, sb, bb, yb + r * y_stride, y_stride, valid);
    const uint16_t* xr = x + r * x_stride;
    uint16_t* yr = yb + r * y_stride;
    switch (m - r) {
      case 5: tile<5>(xr, x_stride, block, k_steps, sb, bb, yr, y_stride, valid); break;
      case 4: tile<4>(xr, x_stride, block, k_steps, sb, bb, yr, y_stride, valid); break;
      case 3: tile<3>(xr, x_stride, block, k_steps, sb, bb, yr, y_stride, valid); break;
      case 2: tile<2>(xr, x_stride, block, k_steps, sb, bb, yr, y_stride, valid); break;
      case 1: tile<1>(xr, x_stride, block, k_steps, sb, bb, yr, y_stride, valid); break;
    }
  });
}

}  // namespace

extern "C" {

int64_t llmbus_int8_packed_bytes(int64_t n, int64_t k) { return packed_bytes(n, k); }

// From this many rows the product is linear.cpp's on bfloat16 weights (see expand_block).
int64_t llmbus_int8_expand_rows() { return kExpandRows; }

void llmbus_pack_int8(const int8_t* w, const float* scale, int64_t n, int64_t k, int8_t* out) {
  pack(w, scale, n, k, out);
}

void llmbus_linear_int8_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* packed,
                             int64_t n, const float* bias, uint16_t* y, int64_t y_stride, int threads) {
  linear(x, m, k, x_stride, packed, n, bias, y, y_stride, threads);
}

}  // extern "C"
