// A whole Llama decoder layer for a decode-only step, in one call from Python.
//
// At one token per step the layer's ten kernels each take microseconds, and calling them
// one by one from PyTorch modules cost more than they did (ctypes, tensor allocation,
// module dispatch: about 3 ms of a 15 ms step for SmolLM2). Here Python makes one call per
// layer; the kernels are the same ones the module path calls, so both paths compute the
// same bits.
#include "kernels.h"

extern "C" {

// What one layer reads: built once per layer and KV cache (all fields 8 bytes wide, so
// the ctypes mirror in kernels/cpu/__init__.py has no padding to get wrong).
struct LlmbusLayer {
  int64_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size;
  double eps, scale;
  const uint16_t *input_norm, *post_norm;                    // [hidden] bfloat16
  const uint16_t *qkv, *o, *gate_up, *down;                  // packed by llmbus_pack_bf16
  const float *qkv_bias, *o_bias;                            // float32 or null
  uint16_t *k_cache, *v_cache;                               // one layer's cache
  int64_t block_stride, slot_stride, head_stride;            // in elements
  const float *cos_table, *sin_table;                        // [max_position, head_dim]
};

// What one step gives every layer, and its scratch space.
struct LlmbusStep {
  int64_t rows, table_stride, threads;
  const int64_t *positions, *slots;
  const int32_t *block_table, *seq_lens;
  uint16_t *normed, *qkv, *attn, *gate_up, *act;  // [rows, hidden | q+2kv | q | 2*inter | inter]
};

// hidden [rows, hidden_size]: the previous layer's output in, this layer's out (in place).
// residual: the stream before adding `hidden`; with first_layer it is set to hidden.
// Returns 0, or the attention kernel's refusal (then hidden holds nothing useful).
int llmbus_decoder_layer_bf16(const LlmbusLayer* L, const LlmbusStep* S, uint16_t* hidden, uint16_t* residual,
                               int64_t first_layer) {
  const int64_t rows = S->rows, h = L->hidden_size, d = L->head_dim;
  const int64_t q_size = L->num_heads * d, kv_size = L->num_kv_heads * d, qkv_size = q_size + 2 * kv_size;
  const int threads = (int)S->threads;
  if (first_layer) {
    for (int64_t i = 0; i < rows * h; ++i) residual[i] = hidden[i];
    llmbus_add_rms_norm_bf16(hidden, nullptr, L->input_norm, (float)L->eps, S->normed, rows, h, threads);
  } else {
    llmbus_add_rms_norm_bf16(hidden, residual, L->input_norm, (float)L->eps, S->normed, rows, h, threads);
  }
  llmbus_linear_bf16(S->normed, rows, h, h, L->qkv, qkv_size, L->qkv_bias, S->qkv, qkv_size, threads);
  llmbus_rotary_bf16(S->qkv, rows, L->num_heads + L->num_kv_heads, d, qkv_size, S->positions, L->cos_table,
                     L->sin_table, threads);
  llmbus_write_kv_bf16(S->qkv + q_size, S->qkv + q_size + kv_size, qkv_size, S->slots, rows, L->num_kv_heads, d,
                       L->k_cache, L->v_cache, L->block_stride, L->slot_stride, L->head_stride, L->block_size);
  const int status = llmbus_paged_decode_attention_bf16(
      S->qkv, qkv_size, d, L->k_cache, L->v_cache, L->block_stride, L->slot_stride, L->head_stride, S->block_table,
      S->table_stride, S->seq_lens, rows, L->num_heads, L->num_kv_heads, d, L->block_size, (float)L->scale, S->attn,
      q_size, d, threads);
  if (status != 0) return status;
  llmbus_linear_bf16(S->attn, rows, q_size, q_size, L->o, h, L->o_bias, hidden, h, threads);
  llmbus_add_rms_norm_bf16(hidden, residual, L->post_norm, (float)L->eps, S->normed, rows, h, threads);
  const int64_t inter = L->intermediate_size;
  llmbus_linear_bf16(S->normed, rows, h, h, L->gate_up, 2 * inter, nullptr, S->gate_up, 2 * inter, threads);
  llmbus_silu_mul_bf16(S->gate_up, S->act, rows, inter, threads);
  llmbus_linear_bf16(S->act, rows, inter, inter, L->down, h, nullptr, hidden, h, threads);
  return 0;
}

}  // extern "C"
