// The C entry points of the CPU kernels, for the ones that compose others (decoder_layer.cpp),
// and Kernels<T>, which picks the bfloat16 (uint16_t) or float32 entry point by dtype.
#pragma once
#include <stdint.h>

extern "C" {
#define LLMBUS_DECLARE(T, SUFFIX)                                                                                   \
  void llmbus_linear_##SUFFIX(const T* x, int64_t m, int64_t k, int64_t x_stride, const T* packed, int64_t n,     \
                              const float* bias, T* y, int64_t y_stride, int threads);                              \
  int llmbus_paged_decode_attention_##SUFFIX(                                                                       \
      const T* q, int64_t q_token_stride, int64_t q_head_stride, const void* k_cache, const void* v_cache,          \
      int64_t block_stride, int64_t slot_stride, int64_t head_stride, const int32_t* block_table,                  \
      int64_t table_stride, const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,    \
      int64_t head_dim, int64_t block_size, float scale, T* out, int64_t o_token_stride, int64_t o_head_stride,    \
      int threads, int64_t kv_format, int64_t window, float softcap);                                               \
  int llmbus_write_kv_##SUFFIX(const T* key, const T* value, int64_t row_stride, const int64_t* slots,            \
                               int64_t rows, int64_t num_kv_heads, int64_t head_dim, void* k_cache, void* v_cache,  \
                               int64_t block_stride, int64_t slot_stride, int64_t head_stride, int64_t block_size,   \
                               int64_t kv_format);                                                                \
  void llmbus_add_rms_norm_##SUFFIX(const T* x, T* residual, const T* weight, float eps, T* out, int64_t rows,    \
                                    int64_t hidden, int threads);                                                 \
  void llmbus_rotary_##SUFFIX(T* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t rotary_dim,          \
                              int64_t x_stride, const int64_t* positions, const float* cos_table,                \
                              const float* sin_table, int threads);                                               \
  void llmbus_act_and_mul_##SUFFIX(const T* gate_up, T* out, int64_t rows, int64_t n, int64_t activation,       \
                                   int threads);
LLMBUS_DECLARE(uint16_t, bf16)
void llmbus_linear_int4_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint8_t* packed,
                             int64_t n, const float* bias, uint16_t* y, int64_t y_stride, int threads);
void llmbus_linear_int8_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const int8_t* packed,
                             int64_t n, const float* bias, uint16_t* y, int64_t y_stride, int threads);
LLMBUS_DECLARE(float, f32)
#undef LLMBUS_DECLARE
}

template <typename T>
struct Kernels;

#define LLMBUS_KERNELS(T, SUFFIX)                                        \
  template <>                                                            \
  struct Kernels<T> {                                                    \
    static constexpr auto linear = llmbus_linear_##SUFFIX;               \
    static constexpr auto decode_attention = llmbus_paged_decode_attention_##SUFFIX; \
    static constexpr auto write_kv = llmbus_write_kv_##SUFFIX;           \
    static constexpr auto add_rms_norm = llmbus_add_rms_norm_##SUFFIX;   \
    static constexpr auto rotary = llmbus_rotary_##SUFFIX;               \
    static constexpr auto act_and_mul = llmbus_act_and_mul_##SUFFIX;     \
  };
LLMBUS_KERNELS(uint16_t, bf16)
LLMBUS_KERNELS(float, f32)
#undef LLMBUS_KERNELS
