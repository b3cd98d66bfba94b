// y = x @ W.T (+ bias) in bfloat16 with float32 sums, for weights packed once at load.
//
// Packed layout: blocks of 64 output features, [ceil(n/64)][k/2][64][2]: pairs of
// consecutive inputs of 64 features side by side, which is what one AVX-512 BF16 dot
// instruction (vdpbf16ps) multiplies against a broadcast pair of x. A block is one
// contiguous stream, so a decode step (1-4 rows of x) reads the weights front to back at
// close to memory speed; more rows reuse each loaded block from cache. Measured on this
// machine against oneDNN's packed product (docs/performance.md): 1.3-1.6x faster at 1-8
// rows, on par at 128, about 0.9x at 2048.
#include <string.h>

#include "simd.h"

namespace {

constexpr int64_t kBlock = 64;  // output features per packed block: four 16-lane vectors

// One tile: MR rows of x against one packed block, float32 accumulators in registers.
template <int MR>
inline void tile(const uint16_t* x, int64_t x_stride, const uint16_t* block, int64_t k_pairs,
                 const float* bias, uint16_t* y, int64_t y_stride, int64_t valid) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k_pairs; ++kk) {
    const uint16_t* w = block + kk * kBlock * 2;
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(w);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(w + 32);
    const __m512bh w2 = (__m512bh)_mm512_loadu_si512(w + 64);
    const __m512bh w3 = (__m512bh)_mm512_loadu_si512(w + 96);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      memcpy(&pair, x + r * x_stride + 2 * kk, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], xb, w2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], xb, w3);
    }
  }
  for (int j = 0; j < 4; ++j) {
    const int64_t left = valid - j * 16;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
    for (int r = 0; r < MR; ++r) store_bf16x16(y + r * y_stride + j * 16, _mm512_add_ps(acc[r][j], b), mask);
  }
}

}  // namespace

extern "C" {

int64_t llmbus_packed_bf16_numel(int64_t n, int64_t k) { return (n + kBlock - 1) / kBlock * kBlock * k; }

// w [n, k] row-major (k even) -> packed, zero-padded to whole blocks.
void llmbus_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, k_pairs = k / 2;
#pragma omp parallel for
  for (int64_t b = 0; b < blocks; ++b) {
    uint16_t* dst = out + b * k_pairs * kBlock * 2;
    for (int64_t kk = 0; kk < k_pairs; ++kk)
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t row = b * kBlock + j;
        dst[(kk * kBlock + j) * 2] = row < n ? w[row * k + 2 * kk] : 0;
        dst[(kk * kBlock + j) * 2 + 1] = row < n ? w[row * k + 2 * kk + 1] : 0;
      }
  }
}

// y [m, n] (row stride y_stride) = x [m, k] (row stride x_stride) @ W.T + bias (float32, or null).
// Threads split the output blocks: each streams its share of the weights once.
void llmbus_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                        int64_t n, const float* bias, uint16_t* y, int64_t y_stride, int threads) {
  const int64_t blocks = (n + kBlock - 1) / kBlock, k_pairs = k / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* block = packed + b * k_pairs * kBlock * 2;
    const int64_t valid = n - b * kBlock < kBlock ? n - b * kBlock : kBlock;
    const float* bb = bias ? bias + b * kBlock : nullptr;
    uint16_t* yb = y + b * kBlock;
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) tile<4>(x + r * x_stride, x_stride, block, k_pairs, bb, yb + r * y_stride, y_stride, valid);
    switch (m - r) {
      case 3: tile<3>(x + r * x_stride, x_stride, block, k_pairs, bb, yb + r * y_stride, y_stride, valid); break;
      case 2: tile<2>(x + r * x_stride, x_stride, block, k_pairs, bb, yb + r * y_stride, y_stride, valid); break;
      case 1: tile<1>(x + r * x_stride, x_stride, block, k_pairs, bb, yb + r * y_stride, y_stride, valid); break;
    }
  }
}

}  // extern "C"
