// A whole Llama-family decoder layer for a decode-only step, in one call from Python, in
// bfloat16 or float32 (one template): Llama's layer, with what Qwen3, Gemma 1-3 and OLMo 2
// and 3 add to it where the layer's description asks (query/key norms per head or over
// all heads, GeGLU, a norm on each branch's output and none before it, a soft cap on the
// scores, each layer's own rotary table).
//
// At one token per step the layer's ten kernels each take microseconds, and calling them
// one by one from PyTorch modules cost more than they did (ctypes, tensor allocation,
// module dispatch: about 3 ms of a 15 ms SmolLM2 step). Here Python makes one call per
// layer; the kernels are the same ones the module path calls, so both paths compute the
// same bits.
#include "kernels.h"

extern "C" {

// What one layer reads: built once per layer and KV cache (all fields 8 bytes wide, so
// the ctypes mirror in kernels/cpu/__init__.py has no padding to get wrong). Activations,
// norms, packed weights and caches are of the layer's dtype (T below).
struct LlmbusLayer {
  int64_t hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, block_size;
  double eps, scale;
  const void *input_norm, *post_norm;                        // [hidden], or null: the residual add alone (OLMo 2)
  const void *qkv, *o, *gate_up, *down;                      // packed by llmbus_pack_* (see weight_format)
  const float *qkv_bias, *o_bias;                            // float32 or null
  void *k_cache, *v_cache;                                   // one layer's cache
  int64_t block_stride, slot_stride, head_stride;            // in elements
  const float *cos_table, *sin_table;                        // [max_position, rotary_dim]
  int64_t weight_format;  // qkv, o, gate_up, down: 0 packed in T, 4 by llmbus_pack_int4, 8 by
                          // llmbus_pack_int8 (the last two in bfloat16 layers only)
  int64_t kv_format;      // the caches: 0 in T, 1 float8 e4m3, 2 float8 e5m2 (fp8.h)
  int64_t window;         // > 0: attention over the last `window` keys (a sliding window)
  const void *q_norm, *k_norm;              // [head_dim] each: RMSNorm of every query and key head before
                                            // rotary (Qwen3, Gemma 3), or null
  const void *post_attn_norm, *post_mlp_norm;  // [hidden] each: Gemma 2's and 3's norms of the attention's
                                               // and the MLP's output before the residual add, or null; with
                                               // them post_norm is the norm before the MLP
  int64_t activation;     // the MLP's gate: 0 SiLU (SwiGLU), 1 GELU's tanh form (GeGLU)
  double softcap;         // > 0: scores become softcap * tanh(score / softcap) (Gemma 2)
  int64_t rotary_dim;     // the leading dims of each head that rotate: head_dim, or fewer (a partial rotary)
  int64_t qk_norm_over_heads;  // 1: q_norm and k_norm span all of a token's heads at once (OLMo 2), [q | kv size]
};

// What one step gives every layer, and its scratch space.
struct LlmbusStep {
  int64_t rows, table_stride, threads;
  const int64_t *positions, *slots;
  const int32_t *block_table, *seq_lens;
  void *normed, *qkv, *attn, *gate_up, *act;  // [rows, hidden | q+2kv | q | 2*inter | inter]
};

}  // extern "C"

namespace {

// One of the layer's products, on its weights' format.
template <typename T>
void product(const LlmbusLayer* L, const T* x, int64_t rows, int64_t k, const void* w, int64_t n, const float* bias,
             T* y, int threads) {
  if constexpr (sizeof(T) == 2) {
    if (L->weight_format == 4) return llmbus_linear_int4_bf16(x, rows, k, k, (const uint8_t*)w, n, bias, y, n, threads);
    if (L->weight_format == 8) return llmbus_linear_int8_bf16(x, rows, k, k, (const int8_t*)w, n, bias, y, n, threads);
  }
  Kernels<T>::linear(x, rows, k, k, (const T*)w, n, bias, y, n, threads);
}

// hidden [rows, hidden_size]: the previous layer's output in, this layer's out (in place).
// residual: the stream before adding `hidden`; with first_layer it is set to hidden.
// Returns 0, or the attention kernel's refusal (then hidden holds nothing useful), or -10
// for int4 or int8 weights in a float32 layer.
template <typename T>
int decoder_layer(const LlmbusLayer* L, const LlmbusStep* S, T* hidden, T* residual, int64_t first_layer) {
  using K = Kernels<T>;
  const int64_t rows = S->rows, h = L->hidden_size, d = L->head_dim;
  const int64_t q_size = L->num_heads * d, kv_size = L->num_kv_heads * d, qkv_size = q_size + 2 * kv_size;
  const int threads = (int)S->threads;
  const T *input_norm = (const T*)L->input_norm, *post_norm = (const T*)L->post_norm;
  T *normed = (T*)S->normed, *qkv = (T*)S->qkv, *attn = (T*)S->attn, *gate_up = (T*)S->gate_up, *act = (T*)S->act;
  if (L->weight_format != 0 && sizeof(T) != 2) return -10;
  if (first_layer) {
    for (int64_t i = 0; i < rows * h; ++i) residual[i] = hidden[i];
    K::add_rms_norm(hidden, nullptr, input_norm, (float)L->eps, normed, rows, h, threads);
  } else {
    K::add_rms_norm(hidden, residual, input_norm, (float)L->eps, normed, rows, h, threads);
  }
  product(L, normed, rows, h, L->qkv, qkv_size, L->qkv_bias, qkv, threads);
  if (L->q_norm) {  // each head a row of head_dim (or all heads one row), normed in place: the module path's rows
    const bool over = L->qk_norm_over_heads != 0;
#pragma omp parallel for num_threads(rows >= 16 ? threads : 1)
    for (int64_t r = 0; r < rows; ++r) {
      T* q = qkv + r * qkv_size;
      K::add_rms_norm(q, nullptr, (const T*)L->q_norm, (float)L->eps, q, over ? 1 : L->num_heads,
                      over ? q_size : d, 1);
      K::add_rms_norm(q + q_size, nullptr, (const T*)L->k_norm, (float)L->eps, q + q_size,
                      over ? 1 : L->num_kv_heads, over ? kv_size : d, 1);
    }
  }
  K::rotary(qkv, rows, L->num_heads + L->num_kv_heads, d, L->rotary_dim, qkv_size, S->positions, L->cos_table,
            L->sin_table, threads);
  int status = K::write_kv(qkv + q_size, qkv + q_size + kv_size, qkv_size, S->slots, rows, L->num_kv_heads, d,
                           L->k_cache, L->v_cache, L->block_stride, L->slot_stride, L->head_stride, L->block_size,
                           L->kv_format);
  if (status != 0) return status;
  status = K::decode_attention(qkv, qkv_size, d, L->k_cache, L->v_cache, L->block_stride, L->slot_stride,
                               L->head_stride, S->block_table, S->table_stride, S->seq_lens, rows, L->num_heads,
                               L->num_kv_heads, d, L->block_size, (float)L->scale, attn, q_size, d, threads,
                               L->kv_format, L->window, (float)L->softcap);
  if (status != 0) return status;
  product(L, attn, rows, q_size, L->o, h, L->o_bias, hidden, threads);
  if (L->post_attn_norm)  // the attention's output normed alone, then added to the stream
    K::add_rms_norm(hidden, nullptr, (const T*)L->post_attn_norm, (float)L->eps, hidden, rows, h, threads);
  K::add_rms_norm(hidden, residual, post_norm, (float)L->eps, normed, rows, h, threads);
  const int64_t inter = L->intermediate_size;
  product(L, normed, rows, h, L->gate_up, 2 * inter, nullptr, gate_up, threads);
  K::act_and_mul(gate_up, act, rows, inter, L->activation, threads);
  product(L, act, rows, inter, L->down, h, nullptr, hidden, threads);
  if (L->post_mlp_norm)  // the next layer's input norm adds it to the stream
    K::add_rms_norm(hidden, nullptr, (const T*)L->post_mlp_norm, (float)L->eps, hidden, rows, h, threads);
  return 0;
}

}  // namespace

extern "C" {

int llmbus_decoder_layer_bf16(const LlmbusLayer* L, const LlmbusStep* S, uint16_t* hidden, uint16_t* residual,
                              int64_t first_layer) {
  return decoder_layer(L, S, hidden, residual, first_layer);
}

int llmbus_decoder_layer_f32(const LlmbusLayer* L, const LlmbusStep* S, float* hidden, float* residual,
                             int64_t first_layer) {
  return decoder_layer(L, S, hidden, residual, first_layer);
}

}  // extern "C"
