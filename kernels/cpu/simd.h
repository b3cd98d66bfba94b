// Small AVX-512 helpers shared by the CPU kernels.
#pragma once
#include <immintrin.h>
#include <stdint.h>

// bfloat16 -> float32 is a 16-bit shift: exact.
static inline __m512 bf16x16_to_f32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// float32 -> bfloat16, rounding to nearest even (what PyTorch's .to(torch.bfloat16) does).
static inline void store_bf16x16(uint16_t* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm256_mask_storeu_epi16(p, mask, (__m256i)_mm512_cvtneps_pbh(v));
}

// e^x for softmax inputs (x <= 0): 2^(x log2 e) split into 2^n * 2^f, f in [-0.5, 0.5],
// with a degree-6 polynomial for 2^f (relative error ~2e-7, below float32's own rounding
// in the sums that follow); scalef does the 2^n and flushes very negative x to 0.
static inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-150.0f)), log2e);
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// tanh(y) for |y| as 1 - 2e / (1 + e), e = exp512(-2|y|) (within exp512's domain), the sign
// put back: near +-1 the small 2e / (1 + e) is exact to a few of its own roundings, so the
// one rounding of 1 - it gives tanh's nearest float32 nearly always; from |y| > 8.664 (25 ln 2 / 2)
// exactly +-1, as PyTorch's (Sleef's) tanh. Written as (1 - e) / (1 + e) it was a float32
// rounding off there, and GELU's 1 + tanh(y) in its left tail (below -4) showed it.
static inline __m512 tanh512(__m512 y) {
  const __m512 e = exp512(_mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(-2.0f)));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 t = _mm512_sub_ps(one, _mm512_div_ps(_mm512_add_ps(e, e), _mm512_add_ps(one, e)));
  t = _mm512_mask_mov_ps(t, _mm512_cmp_ps_mask(_mm512_abs_ps(y), _mm512_set1_ps(8.664339742f), _CMP_GT_OQ), one);
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(y), _mm512_set1_epi32((int)0x80000000u));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), sign));
}

// cap * tanh(x / cap), Gemma 2's soft cap on attention scores.
static inline __m512 softcap512(__m512 x, float cap) {
  return _mm512_mul_ps(tanh512(_mm512_div_ps(x, _mm512_set1_ps(cap))), _mm512_set1_ps(cap));
}

// What a bfloat16 PyTorch op does to a float32 intermediate: round it to bfloat16.
static inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

static inline __m512 bf16x16_to_f32_masked(const uint16_t* p, __mmask16 mask) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
}

static inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
}

// 16 elements of a cache or activation row as float32, and back, for kernels that take
// either dtype: overloads pick the conversion (bfloat16 rounds to nearest even on store).
static inline __m512 load16(const uint16_t* p) { return bf16x16_to_f32(p); }
static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p, __mmask16 mask) { return bf16x16_to_f32_masked(p, mask); }
static inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
static inline void store16(uint16_t* p, __m512 v, __mmask16 mask = 0xFFFF) { store_bf16x16(p, v, mask); }
static inline void store16(float* p, __m512 v, __mmask16 mask = 0xFFFF) { _mm512_mask_storeu_ps(p, mask, v); }

// What a PyTorch op of dtype T does to a float32 intermediate it stores: bfloat16 rounds,
// float32 keeps it.
template <typename T>
inline __m512 round_as(__m512 v);
template <>
inline __m512 round_as<uint16_t>(__m512 v) { return round_bf16(v); }
template <>
inline __m512 round_as<float>(__m512 v) { return v; }
