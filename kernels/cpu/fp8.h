// The 8-bit float KV cache formats (`--kv-cache-dtype fp8_e4m3 | fp8_e5m2`): 16 values to
// float32 and back, bit for bit what PyTorch's float8_e4m3fn / float8_e5m2 conversions do
// (tests/test_fp8_kv_cache.py checks every byte and rounding ties).
//
// Decoding goes through float16, which both formats embed: e5m2 is float16's top byte;
// e4m3's seven magnitude bits, placed where float16 keeps its exponent and mantissa, read
// as the value times 2^-8 (subnormals included, as float16 has them at the same place).
// Encoding rounds to the format's grid in float32 arithmetic: adding 2^(e + 23 - M) (e the
// value's exponent, clamped to the format's smallest normal one) leaves a sum whose last
// bit is worth 2^(e - M), so the addition itself rounds to nearest even; the rounded value
// is then exact in the format and its bits are read off. Values past the largest finite
// one saturate to it (the callers clamp before PyTorch's conversion too); so does a NaN,
// where PyTorch would keep it.
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include <type_traits>

#include "simd.h"

namespace fp8 {

enum Format : int64_t { kSame = 0, kE4M3 = 1, kE5M2 = 2 };

template <int F>
struct Spec;
template <>
struct Spec<kE4M3> {
  static constexpr int M = 3, Bias = 7;
  static constexpr float kMax = 448.0f;
};
template <>
struct Spec<kE5M2> {
  static constexpr int M = 2, Bias = 15;
  static constexpr float kMax = 57344.0f;
};

template <int F>
inline __m512 decode(__m128i bytes);

template <>
inline __m512 decode<kE5M2>(__m128i bytes) {
  return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 8));
}

template <>
inline __m512 decode<kE4M3>(__m128i bytes) {
  // Shifted left by 7 the magnitude sits where float16 wants it and the sign one bit short
  // of bit 15: adding that bit to itself carries it there and clears it.
  const __m256i shifted = _mm256_slli_epi16(_mm256_cvtepu8_epi16(bytes), 7);
  const __m256i half = _mm256_add_epi16(shifted, _mm256_and_si256(shifted, _mm256_set1_epi16(0x4000)));
  return _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
}

template <int F>
inline __m128i encode(__m512 v) {
  constexpr int M = Spec<F>::M, Bias = Spec<F>::Bias;
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512 a = _mm512_min_ps(_mm512_abs_ps(v), _mm512_set1_ps(Spec<F>::kMax));
  // The exponent that sets the grid: the value's own, at least the smallest normal one.
  const __m512i exponent = _mm512_max_epi32(
      _mm512_sub_epi32(_mm512_srli_epi32(_mm512_castps_si512(a), 23), _mm512_set1_epi32(127)),
      _mm512_set1_epi32(1 - Bias));
  const __m512 magic = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_add_epi32(exponent, _mm512_set1_epi32(127 + 23 - M)), 23));
  const __m512 r = _mm512_sub_ps(_mm512_add_ps(a, magic), magic);  // a on the format's grid
  const __m512i rbits = _mm512_castps_si512(r);
  // Normal: rebias the exponent, keep M mantissa bits. Subnormal (below 2^(1 - Bias)): the
  // value counted in steps of 2^(1 - Bias - M), which also gives 0 for 0.
  const __m512i normal = _mm512_or_si512(
      _mm512_slli_epi32(_mm512_sub_epi32(_mm512_srli_epi32(rbits, 23), _mm512_set1_epi32(127 - Bias)), M),
      _mm512_and_si512(_mm512_srli_epi32(rbits, 23 - M), _mm512_set1_epi32((1 << M) - 1)));
  const __m512i steps = _mm512_cvtps_epi32(_mm512_mul_ps(r, _mm512_set1_ps((float)(1 << (Bias - 1 + M)))));
  const __mmask16 is_normal = _mm512_cmp_ps_mask(r, _mm512_set1_ps(1.0f / (1 << (Bias - 1))), _CMP_GE_OQ);
  const __m512i magnitude = _mm512_mask_blend_epi32(is_normal, steps, normal);
  return _mm512_cvtepi32_epi8(_mm512_or_si512(sign, magnitude));
}

// 16 cache values at p as float32 (mask: which of them exist).
template <int F>
inline __m512 load16(const uint8_t* p, __mmask16 mask = 0xFFFF) {
  return decode<F>(_mm_maskz_loadu_epi8(mask, p));
}

template <int F>
inline void store16(uint8_t* p, __m512 v, __mmask16 mask = 0xFFFF) {
  _mm_mask_storeu_epi8(p, mask, encode<F>(v));
}

}  // namespace fp8

// How the attention kernels read a cache of format F beside queries of type T: E is its
// element type, load() gives 16 elements as float32, and widen() copies a row of D
// elements to T (exact: every fp8 value is a bfloat16 one), for the products that take T.
template <typename T, int F>
struct CacheOf {
  using E = uint8_t;
  static __m512 load(const E* p) { return fp8::load16<F>(p); }
  template <int D>
  static void widen(const E* row, T* out) {
    if constexpr (sizeof(T) == 2) {  // bfloat16: two vectors rounded in one instruction
      for (int c = 0; c < D / 32; ++c)
        _mm512_storeu_si512(out + 32 * c, (__m512i)_mm512_cvtne2ps_pbh(load(row + 32 * c + 16), load(row + 32 * c)));
    } else {
      for (int c = 0; c < D / 16; ++c) store16(out + 16 * c, load(row + 16 * c));
    }
  }
};

template <typename T>
struct CacheOf<T, fp8::kSame> {
  using E = T;
  static __m512 load(const E* p) { return load16(p); }
};

// fn(integral_constant<int, F>) for the runtime format code: the one switch every entry
// point needs; -3 for a code no format has.
template <typename Fn>
int with_format(int64_t kv_format, Fn fn) {
  switch (kv_format) {
    case fp8::kSame: return fn(std::integral_constant<int, fp8::kSame>{});
    case fp8::kE4M3: return fn(std::integral_constant<int, fp8::kE4M3>{});
    case fp8::kE5M2: return fn(std::integral_constant<int, fp8::kE5M2>{});
    default: return -3;
  }
}
