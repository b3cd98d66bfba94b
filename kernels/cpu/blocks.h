// The block layout the products share (linear.cpp, linear_int8.cpp, linear_int4.cpp): the
// weights in blocks of 64 outputs, one contiguous stream per block, threads splitting the
// blocks between them.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include <vector>

#include "kernels.h"
#include "simd.h"

namespace blocks {

constexpr int64_t kBlock = 64;  // outputs per block: four 16-lane vectors

inline int64_t count(int64_t n) { return (n + kBlock - 1) / kBlock; }

// w [n, k] row-major -> [count(n)][k/S][64][S], zero-padded to whole blocks: S consecutive
// inputs of 64 outputs side by side, what one multiply-add step takes per lane.
template <int64_t S, typename E>
void pack(const E* w, int64_t n, int64_t k, E* out) {
  const int64_t k_steps = k / S;
#pragma omp parallel for
  for (int64_t b = 0; b < count(n); ++b) {
    E* dst = out + b * k * kBlock;
    for (int64_t kk = 0; kk < k_steps; ++kk)
      for (int64_t j = 0; j < kBlock; ++j) {
        const int64_t row = b * kBlock + j;
        for (int64_t i = 0; i < S; ++i) dst[(kk * kBlock + j) * S + i] = row < n ? w[row * k + S * kk + i] : E(0);
      }
  }
}

// One tile's float32 sums out to MR rows of a block's outputs: acc * scale (per output, or
// none) + bias (or none), the outputs past `valid` masked off. Every product ends so.
template <int MR, typename T>
inline void store_tile(const __m512 (&acc)[MR][4], const float* scale, const float* bias, T* y, int64_t y_stride,
                       int64_t valid) {
  for (int j = 0; j < 4; ++j) {
    const int64_t left = valid - j * 16;
    if (left <= 0) break;
    const __mmask16 mask = tail_mask(left);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + j * 16) : _mm512_setzero_ps();
    if (scale) {
      const __m512 s = _mm512_maskz_loadu_ps(mask, scale + j * 16);
      for (int r = 0; r < MR; ++r) store16(y + r * y_stride + j * 16, _mm512_fmadd_ps(acc[r][j], s, b), mask);
    } else {
      for (int r = 0; r < MR; ++r) store16(y + r * y_stride + j * 16, _mm512_add_ps(acc[r][j], b), mask);
    }
  }
}

// fn(b, valid, bias_b, y_b) for every block b of n outputs, the blocks split between the
// threads: valid is how many of its 64 outputs exist, bias_b (or null) and y_b its slices.
template <typename Y, typename Fn>
void for_each(int64_t n, const float* bias, Y* y, int threads, Fn fn) {
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t b = 0; b < count(n); ++b)
    fn(b, n - b * kBlock < kBlock ? n - b * kBlock : kBlock, bias ? bias + b * kBlock : nullptr, y + b * kBlock);
}

// y [m, n] = x [m, k] @ W.T + bias for a quantized W whose blocks expand(b, panel) writes
// out as bfloat16 in linear.cpp's layout: each thread expands its blocks one at a time into
// its own panel and multiplies with the bfloat16 kernel (called with one thread: inside
// this parallel region it runs in the calling thread). The int4 and int8 products take
// this path for many rows.
template <typename Expand>
void expanded_product(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, int64_t n, const float* bias,
                      uint16_t* y, int64_t y_stride, int threads, Expand expand) {
#pragma omp parallel num_threads(threads)
  {
    std::vector<uint16_t> panel((size_t)(k * kBlock));
#pragma omp for schedule(static)
    for (int64_t b = 0; b < count(n); ++b) {
      expand(b, panel.data());
      const int64_t valid = n - b * kBlock < kBlock ? n - b * kBlock : kBlock;
      llmbus_linear_bf16(x, m, k, x_stride, panel.data(), valid, bias ? bias + b * kBlock : nullptr, y + b * kBlock,
                         y_stride, 1);
    }
  }
}

}  // namespace blocks
