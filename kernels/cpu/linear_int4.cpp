// y = x @ W.T (+ bias) for 4-bit weights, bfloat16 x and y, float32 sums.
//
// Each weight is level * step + low, level 0..15, with one step and one low per output and
// group of 32 inputs (GGUF's Q4_1 grid; SmolLM2's layers come on it exactly). A decode
// step reads every weight once, so 4 bits a weight plus two float16 per group (5 bits in
// all, as Q4_1) read 3.2x fewer bytes than bfloat16.
//
// Per group, the kernel sums x * level with the bfloat16 dot instruction (vdpbf16ps: the
// levels are small integers, exact in bfloat16, so each product is exact), then
//   y += step * sum(x * level) + low * sum(x),
// with sum(x) over the group's inputs computed once per row. The nibbles become bfloat16
// through one table lookup each (vpermw), so the arithmetic per weight stays small next
// to the bytes read.
//
// Packed layout, one contiguous stream per block of 64 outputs (zero-padded):
//   [ceil(n/64) blocks][k/32 groups] { nibbles [16 input pairs][64 bytes],
//                                      step float16 [64], low float16 [64] }
// Byte i of a pair's first 32 holds input 2p + i%2 of output i/2 (low nibble) and of
// output 16 + i/2 (high nibble); the next 32 bytes likewise for outputs 32..63. One
// vpmovzxbw and one vpermw (after a shift, for the high nibbles) turn each half into the
// input-pair-interleaved vectors vdpbf16ps takes.
//
// Measured (SmolLM2's layer products in a row, 1 row, 106 M weights): 3.0-3.5 ms against
// bfloat16's 6.7-8.9 ms, 2.2-2.7x; 4 rows 1.6x; from 16 rows on bfloat16's rate or within
// 12% of it. Also tried: no shuffle at all (a nibble n as bfloat16 bits 0x4300 | n, which
// is 128 + n, the 128 taken off per group) and half blocks for 4-6 rows: no faster here.
#include <string.h>

#include <vector>

#include "blocks.h"
#include "simd.h"

namespace {

using blocks::kBlock;
constexpr int64_t kGroup = 32;   // inputs per step/low
constexpr int64_t kPairBytes = kBlock;  // one input pair for 64 outputs: 128 nibbles
constexpr int64_t kGroupBytes = (kGroup / 2) * kPairBytes + 2 * kBlock * 2;  // nibbles + steps + lows

// bfloat16 of (i & 15) for word i: vpermw reads the low 5 bits of each index word, so the
// byte holding two nibbles looks up its low nibble directly.
inline __m512i level_table() {
  alignas(64) uint16_t table[32];
  for (int i = 0; i < 32; ++i) {
    const float v = (float)(i & 15);
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    table[i] = (uint16_t)(bits >> 16);  // exact: small integers
  }
  return _mm512_load_si512(table);
}

// MR rows of x against one block: per group, 16 pair steps into acc, then scaled into total.
template <int MR>
inline void tile(const uint16_t* x, int64_t x_stride, const uint8_t* block, int64_t groups, const float* sums,
                 int64_t sums_stride, const float* bias, uint16_t* y, int64_t y_stride, int64_t valid,
                 __m512i table) {
  __m512 total[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) total[r][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = block + g * kGroupBytes;
    __m512 acc[MR][4];
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
    for (int p = 0; p < kGroup / 2; ++p) {
      const uint8_t* w = gp + p * kPairBytes;
      const __m512i b01 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)w));
      const __m512i b23 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + 32)));
      __m512bh wv[4];
      wv[0] = (__m512bh)_mm512_permutexvar_epi16(b01, table);
      wv[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b01, 4), table);
      wv[2] = (__m512bh)_mm512_permutexvar_epi16(b23, table);
      wv[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b23, 4), table);
      for (int r = 0; r < MR; ++r) {
        int32_t pair;
        memcpy(&pair, x + r * x_stride + g * kGroup + 2 * p, sizeof pair);
        const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
        for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wv[j]);
      }
    }
    const uint8_t* scales = gp + (kGroup / 2) * kPairBytes;
    for (int j = 0; j < 4; ++j) {
      const __m512 step = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 32 * j)));
      const __m512 low = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 2 * kBlock + 32 * j)));
      for (int r = 0; r < MR; ++r) {
        total[r][j] = _mm512_fmadd_ps(step, acc[r][j], total[r][j]);
        total[r][j] = _mm512_fmadd_ps(low, _mm512_set1_ps(sums[r * sums_stride + g]), total[r][j]);
      }
    }
  }
  blocks::store_tile<MR>(total, nullptr, bias, y, y_stride, valid);
}

int64_t packed_bytes(int64_t n, int64_t k) { return blocks::count(n) * (k / kGroup) * kGroupBytes; }

// levels [n, k] (0..15), step and low [n, k/32] float32 -> packed (see the layout above).
void pack(const uint8_t* levels, const float* step, const float* low, int64_t n, int64_t k, uint8_t* out) {
  const int64_t groups = k / kGroup;
#pragma omp parallel for
  for (int64_t b = 0; b < blocks::count(n); ++b) {
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* gp = out + (b * groups + g) * kGroupBytes;
      for (int64_t p = 0; p < kGroup / 2; ++p) {
        uint8_t* w = gp + p * kPairBytes;
        // Word i of the widened half h (bytes 32h..32h+31) feeds lane i/2 of vectors 2h
        // (low nibble) and 2h+1 (high nibble), input 2p + i%2: dot lanes are output pairs.
        for (int64_t h = 0; h < 2; ++h)
          for (int64_t i = 0; i < 32; ++i) {
            const int64_t in = g * kGroup + 2 * p + i % 2;
            const int64_t out_lo = b * kBlock + (2 * h) * 16 + i / 2, out_hi = out_lo + 16;
            const uint8_t lo = out_lo < n ? levels[out_lo * k + in] & 15 : 0;
            const uint8_t hi = out_hi < n ? levels[out_hi * k + in] & 15 : 0;
            w[32 * h + i] = (uint8_t)(lo | hi << 4);
          }
      }
      uint16_t* steps = (uint16_t*)(gp + (kGroup / 2) * kPairBytes);
      uint16_t* lows = steps + kBlock;
      for (int64_t j = 0; j < kBlock; j += 16) {
        float s[16], l[16];
        for (int64_t i = 0; i < 16; ++i) {
          const int64_t o = b * kBlock + j + i;
          s[i] = o < n ? step[o * groups + g] : 0.0f;
          l[i] = o < n ? low[o * groups + g] : 0.0f;
        }
        _mm256_storeu_si256((__m256i*)(steps + j), _mm512_cvtps_ph(_mm512_loadu_ps(s), _MM_FROUND_TO_NEAREST_INT));
        _mm256_storeu_si256((__m256i*)(lows + j), _mm512_cvtps_ph(_mm512_loadu_ps(l), _MM_FROUND_TO_NEAREST_INT));
      }
    }
  }
}

// y [m, n] = x [m, k] @ W.T + bias; threads split the output blocks, as in linear.cpp.
// Rows from which a block is expanded to bfloat16 once and multiplied by linear.cpp's
// tiles. Measured on SmolLM2's layers: expanding costs ~5 ms a pass over their 106 M
// weights (~45 ps a weight, two threads), and the int4 tiles run 5-12% behind the bfloat16
// ones from 32 rows on, so the two meet around 64-96 rows; at 512 rows expanding is 6-10%
// ahead.
constexpr int64_t kExpandRows = 80;

// One block's weights as bfloat16, level * step + low rounded once, in linear.cpp's packed
// layout ([k/2 pairs][64 outputs][2]): on a Q4 checkpoint these are the bfloat16 model's
// own weights, so the product is the bfloat16 model's.
void expand_block(const uint8_t* block, int64_t groups, uint16_t* panel, __m512i table) {
  const __m512i high_words = _mm512_set1_epi32((int)0xFFFF0000u);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* gp = block + g * kGroupBytes;
    const uint8_t* scales = gp + (kGroup / 2) * kPairBytes;
    __m512 step[4], low[4];
    for (int j = 0; j < 4; ++j) {
      step[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 32 * j)));
      low[j] = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + 2 * kBlock + 32 * j)));
    }
    for (int p = 0; p < kGroup / 2; ++p) {
      const uint8_t* w = gp + p * kPairBytes;
      const __m512i b01 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)w));
      const __m512i b23 = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(w + 32)));
      const __m512i levels[4] = {
          _mm512_permutexvar_epi16(b01, table), _mm512_permutexvar_epi16(_mm512_srli_epi16(b01, 4), table),
          _mm512_permutexvar_epi16(b23, table), _mm512_permutexvar_epi16(_mm512_srli_epi16(b23, 4), table)};
      uint16_t* out = panel + (g * (kGroup / 2) + p) * kBlock * 2;
      for (int j = 0; j < 4; ++j) {
        // Lane L holds output 16j + L's pair: the even input in its low word, the odd in its high.
        const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(levels[j], 16));
        const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(levels[j], high_words));
        const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(even, step[j], low[j])));
        const __m512i o = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(odd, step[j], low[j])));
        _mm512_storeu_si512(out + 32 * j, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
      }
    }
  }
}

// y [m, n] = x [m, k] @ W.T + bias; threads split the output blocks, as in linear.cpp.
void linear(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* packed, int64_t n,
            const float* bias, uint16_t* y, int64_t y_stride, int threads) {
  const int64_t groups = k / kGroup;
  const __m512i table = level_table();
  if (m >= kExpandRows)
    return blocks::expanded_product(x, m, k, x_stride, n, bias, y, y_stride, threads, [&](int64_t b, uint16_t* panel) {
      expand_block(packed + b * groups * kGroupBytes, groups, panel, table);
    });
  // sum(x) per row and group, for the lows.
  std::vector<float> sums((size_t)(m * groups));
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      __m512 s = _mm512_add_ps(load16(x + r * x_stride + g * kGroup), load16(x + r * x_stride + g * kGroup + 16));
      sums[r * groups + g] = _mm512_reduce_add_ps(s);
    }
  blocks::for_each(n, bias, y, threads, [&](int64_t b, int64_t valid, const float* bb, uint16_t* yb) {
    const uint8_t* block = packed + b * groups * kGroupBytes;
    int64_t r = 0;
    for (; r + 3 <= m; r += 3)
      tile<3>(x + r * x_stride, x_stride, block, groups, sums.data() + r * groups, groups, bb, yb + r * y_stride,
              y_stride, valid, table);
    if (m - r == 2)
      tile<2>(x + r * x_stride, x_stride, block, groups, sums.data() + r * groups, groups, bb, yb + r * y_stride,
              y_stride, valid, table);
    else if (m - r == 1)
      tile<1>(x + r * x_stride, x_stride, block, groups, sums.data() + r * groups, groups, bb, yb + r * y_stride,
              y_stride, valid, table);
  });
}

}  // namespace

extern "C" {

int64_t llmbus_int4_packed_bytes(int64_t n, int64_t k) { return packed_bytes(n, k); }

// From this many rows the product is linear.cpp's on bfloat16 weights (see expand_block).
int64_t llmbus_int4_expand_rows() { return kExpandRows; }

void llmbus_pack_int4(const uint8_t* levels, const float* step, const float* low, int64_t n, int64_t k,
                      uint8_t* out) {
  pack(levels, step, low, n, k, out);
}

void llmbus_linear_int4_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* packed,
                             int64_t n, const float* bias, uint16_t* y, int64_t y_stride, int threads) {
  linear(x, m, k, x_stride, packed, n, bias, y, y_stride, threads);
}

}  // extern "C"
