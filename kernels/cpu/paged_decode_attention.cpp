// Decode attention (one query token per sequence) read in place from the paged KV cache,
// bfloat16 cache and queries, float32 scores, softmax and sums.
//
// The PyTorch backend first gathers each sequence's blocks into a contiguous copy, then
// runs two batched matmuls; at 128 decodes over ~500 tokens that copy alone moved ~0.9 GB
// per step. Here each (sequence, KV head) task walks its block table and reads every key
// and value once, straight from the cache, for all the query heads that share it (GQA).
// Works on any cache layout whose head_dim is contiguous: strides are passed in elements.
#include <math.h>
#include <string.h>

#include <vector>

#include "simd.h"

namespace {

template <int D>
void attend(const uint16_t* q, int64_t q_head_stride, int qpk, const uint16_t* k_cache, const uint16_t* v_cache,
            int64_t block_stride, int64_t slot_stride, const int32_t* blocks, int64_t block_size, int64_t len,
            float scale, uint16_t* out, int64_t o_head_stride, std::vector<float>& scores) {
  constexpr int kPairs = D / 32;   // vdpbf16ps takes 32 bfloat16 per operand
  constexpr int kLanes = D / 16;   // float32 vectors per head row
  const int64_t padded = (len + 15) / 16 * 16;
  scores.resize((size_t)qpk * padded);

  // Scores: q . k for every key, all query heads of this KV head per key read.
  for (int64_t t = 0; t < len; ++t) {
    const uint16_t* key = k_cache + (int64_t)blocks[t / block_size] * block_stride + (t % block_size) * slot_stride;
    __m512bh k[kPairs];
    for (int c = 0; c < kPairs; ++c) k[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
    for (int i = 0; i < qpk; ++i) {
      __m512 acc = _mm512_setzero_ps();
      for (int c = 0; c < kPairs; ++c)
        acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(q + i * q_head_stride + 32 * c), k[c]);
      scores[i * padded + t] = _mm512_reduce_add_ps(acc) * scale;
    }
  }

  for (int i = 0; i < qpk; ++i) {
    float* s = scores.data() + i * padded;
    // Softmax over the row, in place; the tail past len is masked out of every vector op.
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = len - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + t));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = len - t >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (len - t)) - 1);
      const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), row_max)));
      _mm512_mask_storeu_ps(s + t, m, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    const float inv_sum = 1.0f / _mm512_reduce_add_ps(vsum);

    // Output: probability-weighted sum of the values, normalised once at the end.
    __m512 acc[kLanes];
    for (int c = 0; c < kLanes; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      const uint16_t* value = v_cache + (int64_t)blocks[t / block_size] * block_stride + (t % block_size) * slot_stride;
      const __m512 p = _mm512_set1_ps(s[t]);
      for (int c = 0; c < kLanes; ++c) acc[c] = _mm512_fmadd_ps(p, bf16x16_to_f32(value + 16 * c), acc[c]);
    }
    const __m512 norm = _mm512_set1_ps(inv_sum);
    for (int c = 0; c < kLanes; ++c) store_bf16x16(out + i * o_head_stride + 16 * c, _mm512_mul_ps(acc[c], norm));
  }
}

}  // namespace

extern "C" {

// Returns 0, or -1 for a head_dim without a compiled variant (the caller falls back).
int llmbus_paged_decode_attention_bf16(
    const uint16_t* q, int64_t q_token_stride, int64_t q_head_stride,  // [num_seqs, num_heads, head_dim]
    const uint16_t* k_cache, const uint16_t* v_cache,                  // element strides below
    int64_t block_stride, int64_t slot_stride, int64_t head_stride,
    const int32_t* block_table, int64_t table_stride, const int32_t* seq_lens,
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    float scale, uint16_t* out, int64_t o_token_stride, int64_t o_head_stride, int threads) {
  if (head_dim != 64 && head_dim != 128) return -1;
  const int qpk = (int)(num_heads / num_kv_heads);
  // Sequences differ in length: hand out (sequence, KV head) tasks one at a time.
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * num_kv_heads; ++task) {
      const int64_t s = task / num_kv_heads, g = task % num_kv_heads;
      const uint16_t* qs = q + s * q_token_stride + g * qpk * q_head_stride;
      uint16_t* os = out + s * o_token_stride + g * qpk * o_head_stride;
      const int32_t* blocks = block_table + s * table_stride;
      const uint16_t* kc = k_cache + g * head_stride;
      const uint16_t* vc = v_cache + g * head_stride;
      if (head_dim == 64)
        attend<64>(qs, q_head_stride, qpk, kc, vc, block_stride, slot_stride, blocks, block_size, seq_lens[s], scale,
                   os, o_head_stride, scores);
      else
        attend<128>(qs, q_head_stride, qpk, kc, vc, block_stride, slot_stride, blocks, block_size, seq_lens[s], scale,
                    os, o_head_stride, scores);
    }
  }
  return 0;
}

}  // extern "C"

extern "C" {

// Each row's key and value heads into its cache slot; a negative slot is a padded row.
void llmbus_write_kv_bf16(const uint16_t* key, const uint16_t* value, int64_t row_stride, const int64_t* slots,
                          int64_t rows, int64_t num_kv_heads, int64_t head_dim, uint16_t* k_cache, uint16_t* v_cache,
                          int64_t block_stride, int64_t slot_stride, int64_t head_stride, int64_t block_size) {
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = slots[r];
    if (slot < 0) continue;
    const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * slot_stride;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      memcpy(k_cache + base + h * head_stride, key + r * row_stride + h * head_dim, head_dim * sizeof(uint16_t));
      memcpy(v_cache + base + h * head_stride, value + r * row_stride + h * head_dim, head_dim * sizeof(uint16_t));
    }
  }
}

}  // extern "C"
