// y = x @ W.T (+ bias) for weights packed once at load, bfloat16 or float32, float32 sums.
//
// Packed layout: blocks of 64 output features, [ceil(n/64)][k/S][64][S], S the inputs one
// multiply-add takes per lane: bfloat16 S = 2 (pairs of consecutive inputs of 64 features
// side by side, what one AVX-512 BF16 dot instruction, vdpbf16ps, multiplies against a
// broadcast pair of x), float32 S = 1 (an FMA against a broadcast element). A block is one
// contiguous stream, so a decode step (1-4 rows of x) reads the weights front to back at
// close to memory speed; more rows reuse each loaded block from cache. Measured on this
// machine (docs/performance/history.md): bfloat16 1.3-1.6x oneDNN's packed product at 1-8 rows,
// on par at 128, about 0.9x at 2048. Each output is one float32 chain over k in order, so
// float32 results differ from MKL's blocked sums in the last bits.
#include <string.h>

#include "blocks.h"
#include "simd.h"

namespace {

using blocks::kBlock;

// One multiply-add step of dtype T: S inputs of one row against 64 packed features.
template <typename T>
struct Step;

template <>
struct Step<uint16_t> {
  static constexpr int64_t S = 2;
  static __m512i broadcast(const uint16_t* x) {
    int32_t pair;
    memcpy(&pair, x, sizeof pair);
    return _mm512_set1_epi32(pair);
  }
  static __m512 fma(__m512 acc, __m512i x, const uint16_t* w) {
    return _mm512_dpbf16_ps(acc, (__m512bh)x, (__m512bh)_mm512_loadu_si512(w));
  }
};

template <>
struct Step<float> {
  static constexpr int64_t S = 1;
  static __m512i broadcast(const float* x) { return _mm512_castps_si512(_mm512_set1_ps(*x)); }
  static __m512 fma(__m512 acc, __m512i x, const float* w) {
    return _mm512_fmadd_ps(_mm512_castsi512_ps(x), _mm512_loadu_ps(w), acc);
  }
};

// One tile: MR rows of x against one packed block, float32 accumulators in registers.
template <typename T, int MR>
inline void tile(const T* x, int64_t x_stride, const T* block, int64_t k_steps, const float* bias, T* y,
                 int64_t y_stride, int64_t valid) {
  constexpr int64_t S = Step<T>::S;
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t kk = 0; kk < k_steps; ++kk) {
    const T* w = block + kk * kBlock * S;
    for (int r = 0; r < MR; ++r) {
      const __m512i xb = Step<T>::broadcast(x + r * x_stride + S * kk);
      for (int j = 0; j < 4; ++j) acc[r][j] = Step<T>::fma(acc[r][j], xb, w + j * 16 * S);
    }
  }
  blocks::store_tile<MR>(acc, nullptr, bias, y, y_stride, valid);
}

template <typename T>
int64_t packed_numel(int64_t n, int64_t k) { return blocks::count(n) * kBlock * k; }

// w [n, k] row-major (k a multiple of S) -> packed, zero-padded to whole blocks.
template <typename T>
void pack(const T* w, int64_t n, int64_t k, T* out) { blocks::pack<Step<T>::S>(w, n, k, out); }

// y [m, n] (row stride y_stride) = x [m, k] (row stride x_stride) @ W.T + bias (float32, or null).
// Threads split the output blocks: each streams its share of the weights once.
template <typename T>
void linear(const T* x, int64_t m, int64_t k, int64_t x_stride, const T* packed, int64_t n, const float* bias, T* y,
            int64_t y_stride, int threads) {
  const int64_t k_steps = k / Step<T>::S;
  blocks::for_each(n, bias, y, threads, [&](int64_t b, int64_t valid, const float* bb, T* yb) {
    const T* block = packed + b * k * kBlock;
    int64_t r = 0;
    for (; r + 6 <= m; r += 6)
      tile<T, 6>(x + r * x_stride, x_stride, block, k_steps, bb, yb + r * y_stride, y_stride, valid);
    switch (m - r) {
      case 5: tile<T, 5>(x + r * x_stride, x_stride, block, k_steps, bb, yb + r * y_stride, y_stride, valid); break;
      case 4: tile<T, 4>(x + r * x_stride, x_stride, block, k_steps, bb, yb + r * y_stride, y_stride, valid); break;
      case 3: tile<T, 3>(x + r * x_stride, x_stride, block, k_steps, bb, yb + r * y_stride, y_stride, valid); break;
      case 2: tile<T, 2>(x + r * x_stride, x_stride, block, k_steps, bb, yb + r * y_stride, y_stride, valid); break;
      case 1: tile<T, 1>(x + r * x_stride, x_stride, block, k_steps, bb, yb + r * y_stride, y_stride, valid); break;
    }
  });
}

}  // namespace

extern "C" {

int64_t llmbus_packed_numel_bf16(int64_t n, int64_t k) { return packed_numel<uint16_t>(n, k); }
int64_t llmbus_packed_numel_f32(int64_t n, int64_t k) { return packed_numel<float>(n, k); }

void llmbus_pack_bf16(const uint16_t* w, int64_t n, int64_t k, uint16_t* out) { pack(w, n, k, out); }
void llmbus_pack_f32(const float* w, int64_t n, int64_t k, float* out) { pack(w, n, k, out); }

void llmbus_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                        int64_t n, const float* bias, uint16_t* y, int64_t y_stride, int threads) {
  linear(x, m, k, x_stride, packed, n, bias, y, y_stride, threads);
}

void llmbus_linear_f32(const float* x, int64_t m, int64_t k, int64_t x_stride, const float* packed, int64_t n,
                       const float* bias, float* y, int64_t y_stride, int threads) {
  linear(x, m, k, x_stride, packed, n, bias, y, y_stride, threads);
}

}  // extern "C"
