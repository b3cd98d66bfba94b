// The elementwise steps between a decoder layer's matrix products, in bfloat16 or float32
// (one template each), each one pass over the activations instead of PyTorch's five to ten
// small ops (at one token those ops cost microseconds of dispatch each and about 2 ms per
// decode step in all).
//
// Each reproduces the roundings of the PyTorch ops it replaces (transformers' Llama):
// float32 arithmetic, rounded to bfloat16 wherever a bfloat16 PyTorch op stores a tensor
// (round_as<T>, a no-op in float32). The order of the float32 sum of squares in RMSNorm
// and the exponential in the activations differ from PyTorch's in the last bits.
#include <math.h>

#include "simd.h"

namespace {

// Rows are split over threads only when there are enough of them to pay for the fork.
constexpr int64_t kRowsPerThread = 16;

inline int threads_for(int64_t rows, int threads) {
  const int64_t useful = rows / kRowsPerThread;
  return useful < 1 ? 1 : (useful < threads ? (int)useful : threads);
}

template <typename T>
void add_rms_norm(const T* x, T* residual, const T* weight, float eps, T* out, int64_t rows, int64_t hidden,
                  int threads) {
#pragma omp parallel for num_threads(threads_for(rows, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * hidden;
    T* res = residual ? residual + r * hidden : nullptr;
    T* o = out + r * hidden;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = tail_mask(hidden - i);
      __m512 v = load16(xr + i, m);
      if (res) {
        v = round_as<T>(_mm512_add_ps(v, load16(res + i, m)));
        store16(res + i, v, m);
      }
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const T* src = res ? res : xr;
    if (!weight) {  // no norm (OLMo 2 has none before a branch): the sum, or x, as it is
      if (o != src)
        for (int64_t i = 0; i < hidden; ++i) o[i] = src[i];
      continue;
    }
    const float inv_rms = 1.0f / sqrtf(_mm512_reduce_add_ps(squares) / (float)hidden + eps);
    const __m512 scale = _mm512_set1_ps(inv_rms);
    for (int64_t i = 0; i < hidden; i += 16) {
      const __mmask16 m = tail_mask(hidden - i);
      const __m512 normed = round_as<T>(_mm512_mul_ps(load16(src + i, m), scale));
      store16(o + i, _mm512_mul_ps(normed, load16(weight + i, m)), m);
    }
  }
}

template <typename T>
void rotary(T* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim, int64_t x_stride,
            const int64_t* positions, const float* cos_table, const float* sin_table, int threads) {
  const int64_t half = rotary_dim / 2;  // a partial rotary turns each head's leading rotary_dim only
#pragma omp parallel for num_threads(threads_for(rows, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const float* cos_row = cos_table + positions[r] * rotary_dim;
    const float* sin_row = sin_table + positions[r] * rotary_dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + r * x_stride + h * head_dim;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = tail_mask(half - i);
        const __m512 a = load16(v + i, m), b = load16(v + half + i, m);
        const __m512 cos_a = round_as<T>(_mm512_maskz_loadu_ps(m, cos_row + i));
        const __m512 cos_b = round_as<T>(_mm512_maskz_loadu_ps(m, cos_row + half + i));
        const __m512 sin_a = round_as<T>(_mm512_maskz_loadu_ps(m, sin_row + i));
        const __m512 sin_b = round_as<T>(_mm512_maskz_loadu_ps(m, sin_row + half + i));
        // first half: a * cos + b * sin_signed (negative); second half: b * cos + a * sin.
        const __m512 new_a =
            _mm512_add_ps(round_as<T>(_mm512_mul_ps(a, cos_a)), round_as<T>(_mm512_mul_ps(b, sin_a)));
        const __m512 new_b =
            _mm512_add_ps(round_as<T>(_mm512_mul_ps(b, cos_b)), round_as<T>(_mm512_mul_ps(a, sin_b)));
        store16(v + i, new_a, m);
        store16(v + half + i, new_b, m);
      }
    }
  }
}

// What act_and_mul applies to the gate: vLLM's SiluAndMul and GeluAndMul(approximate="tanh").
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

template <typename T>
void act_and_mul(const T* gate_up, T* out, int64_t rows, int64_t n, int64_t activation, int threads) {
  const __m512 one = _mm512_set1_ps(1.0f), zero = _mm512_setzero_ps(), half = _mm512_set1_ps(0.5f);
  const __m512 beta = _mm512_set1_ps(0.7978845608028654f), kappa = _mm512_set1_ps(0.044715f);  // sqrt(2/pi)
#pragma omp parallel for num_threads(threads_for(rows, threads))
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * n;
    const T* up = gate + n;
    T* o = out + r * n;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      const __m512 g = load16(gate + i, m);
      __m512 act;
      if (activation == kSilu) {
        // silu(g) = g / (1 + e^-g); e^-g for g < 0 can overflow exp512's range, so use
        // e^-|g| and g * sigmoid written for both signs.
        const __m512 e = exp512(_mm512_sub_ps(zero, _mm512_abs_ps(g)));
        const __mmask16 negative = _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ);
        const __m512 sigmoid = _mm512_mask_div_ps(_mm512_div_ps(one, _mm512_add_ps(one, e)), negative,
                                                  e, _mm512_add_ps(one, e));
        act = _mm512_mul_ps(g, sigmoid);
      } else {
        // PyTorch's own form, 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))), not the
        // equal g * sigmoid(2y): for g below about -4 both lose the value to 1 + tanh's
        // cancellation, and rounding as PyTorch does keeps bfloat16 results its bits.
        const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        const __m512 y = _mm512_mul_ps(beta, _mm512_add_ps(g, _mm512_mul_ps(kappa, g3)));
        act = _mm512_mul_ps(_mm512_mul_ps(half, g), _mm512_add_ps(one, tanh512(y)));
      }
      store16(o + i, _mm512_mul_ps(round_as<T>(act), load16(up + i, m)), m);
    }
  }
}

}  // namespace

extern "C" {

// residual (if given) += x, then out = weight * round(r * rsqrt(mean(r^2) + eps)) with r
// the sum (or x alone): LlamaRMSNorm after the residual add. x and out may alias. Without
// a weight, out = r: the residual add alone.
void llmbus_add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, float eps,
                              uint16_t* out, int64_t rows, int64_t hidden, int threads) {
  add_rms_norm(x, residual, weight, eps, out, rows, hidden, threads);
}
void llmbus_add_rms_norm_f32(const float* x, float* residual, const float* weight, float eps, float* out,
                             int64_t rows, int64_t hidden, int threads) {
  add_rms_norm(x, residual, weight, eps, out, rows, hidden, threads);
}

// In place on x [rows, heads, head_dim] (row stride x_stride): each head's leading rotary_dim
// (all of it, or a partial rotary's) becomes x * cos + swap_halves(x) * sin, cos/sin the
// float32 tables [positions, rotary_dim] at each row's position, rounded as the dtype's
// PyTorch ops do; the rest of the head is left alone.
void llmbus_rotary_bf16(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim,
                        int64_t x_stride, const int64_t* positions, const float* cos_table, const float* sin_table,
                        int threads) {
  rotary(x, rows, heads, head_dim, rotary_dim, x_stride, positions, cos_table, sin_table, threads);
}
void llmbus_rotary_f32(float* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim, int64_t x_stride,
                       const int64_t* positions, const float* cos_table, const float* sin_table, int threads) {
  rotary(x, rows, heads, head_dim, rotary_dim, x_stride, positions, cos_table, sin_table, threads);
}

// out [rows, n] = round(act(gate)) * up, from gate_up [rows, 2n] (gate first): SwiGLU
// (activation 0, SiLU) or GeGLU (1, GELU's tanh form, transformers' gelu_pytorch_tanh).
void llmbus_act_and_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n, int64_t activation,
                             int threads) {
  act_and_mul(gate_up, out, rows, n, activation, threads);
}
void llmbus_act_and_mul_f32(const float* gate_up, float* out, int64_t rows, int64_t n, int64_t activation,
                            int threads) {
  act_and_mul(gate_up, out, rows, n, activation, threads);
}

}  // extern "C"
