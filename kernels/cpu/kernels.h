// The C entry points of the CPU kernels, for the ones that compose others (decoder_layer.cpp).
#pragma once
#include <stdint.h>

extern "C" {
void llmbus_linear_bf16(const uint16_t* x, int64_t m, int64_t k, int64_t x_stride, const uint16_t* packed,
                        int64_t n, const float* bias, uint16_t* y, int64_t y_stride, int threads);
int llmbus_paged_decode_attention_bf16(const uint16_t* q, int64_t q_token_stride, int64_t q_head_stride,
                                       const uint16_t* k_cache, const uint16_t* v_cache, int64_t block_stride,
                                       int64_t slot_stride, int64_t head_stride, const int32_t* block_table,
                                       int64_t table_stride, const int32_t* seq_lens, int64_t num_seqs,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                       float scale, uint16_t* out, int64_t o_token_stride, int64_t o_head_stride,
                                       int threads);
void llmbus_write_kv_bf16(const uint16_t* key, const uint16_t* value, int64_t row_stride, const int64_t* slots,
                          int64_t rows, int64_t num_kv_heads, int64_t head_dim, uint16_t* k_cache, uint16_t* v_cache,
                          int64_t block_stride, int64_t slot_stride, int64_t head_stride, int64_t block_size);
void llmbus_add_rms_norm_bf16(const uint16_t* x, uint16_t* residual, const uint16_t* weight, float eps,
                              uint16_t* out, int64_t rows, int64_t hidden, int threads);
void llmbus_rotary_bf16(uint16_t* x, int64_t rows, int64_t heads, int64_t head_dim, int64_t x_stride,
                        const int64_t* positions, const float* cos_table, const float* sin_table, int threads);
void llmbus_silu_mul_bf16(const uint16_t* gate_up, uint16_t* out, int64_t rows, int64_t n, int threads);
}
