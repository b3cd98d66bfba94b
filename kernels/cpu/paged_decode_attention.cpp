// Decode attention (one query token per sequence) read in place from the paged KV cache,
// bfloat16 or float32 queries with a cache of their dtype or of 8-bit floats (fp8.h; one
// template), float32 scores, softmax and sums.
//
// The PyTorch backend first gathers each sequence's blocks into a contiguous copy, then
// runs two batched matmuls; at 128 decodes over ~500 tokens that copy alone moved ~0.9 GB
// per step. Here each sequence (one task; one per KV head for a single stream) walks its
// block table and, KV head by KV head, reads every key and value once, straight from the
// cache, for all the query heads that share it (GQA).
// Works on any cache layout whose head_dim is contiguous: strides are passed in elements.
//
// Measured on this machine (128 decodes over 400 tokens, blocks shuffled, 8 layers' caches
// so nothing stays in L3): one dot product reduced per key, then each head's values
// summed in turn, took 4.0 ms per layer (10 GB/s of K/V); reducing 16 keys together and
// converting each value row once for several heads: 3.0 ms (13 GB/s). Then the reads:
// prefetches into L2 rather than L1, spread one row at a time between dot products,
// 32 rows ahead for keys and values at once, running on from one KV head into the next:
// 1.95-2.2 ms (18-20 GB/s) against 2.8-3.2 ms, alternated. A bare read of the same
// blocks reaches 25-30 GB/s, the kernel on data in L3 ~32 GB/s.
#include <math.h>
#include <string.h>

#include <vector>

#include "fp8.h"
#include "simd.h"

namespace {

constexpr int kMaxQueryPerKv = 64;

// r[j] = sum of the lanes of a[j], for 16 vectors at once: three rounds of pairwise
// shuffles and adds (45 instructions) instead of 16 horizontal reductions.
inline __m512 reduce16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d lo = _mm512_castps_pd(b[2 * i]), hi = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88), _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// Blocks are scattered, so every block is a new short stream that the hardware prefetcher
// only catches after it has started: ask for rows well ahead of their use. Into L2
// (prefetcht1), not L1: on this CPU an L1 prefetch waits for one of the few L1 miss
// buffers, so T0 prefetches of shuffled 2 KB blocks kept ~13 GB/s in flight, T1 ~30.
template <int D, typename T>
inline void prefetch_row(const T* row) {
  for (int line = 0; line < D * (int)sizeof(T) / 64; ++line) _mm_prefetch((const char*)row + line * 64, _MM_HINT_T1);
}

// One query head held in registers, dotted with key rows of the same dtype.
template <typename T, int D>
struct QueryRegs;

template <int D>
struct QueryRegs<uint16_t, D> {  // bfloat16: vdpbf16ps multiplies 32 elements per operand
  __m512bh v[D / 32];
  explicit QueryRegs(const uint16_t* q) {
    for (int c = 0; c < D / 32; ++c) v[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  }
  __m512 dot(const uint16_t* key) const {
    __m512 acc = _mm512_setzero_ps();
    for (int c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, v[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
    return acc;
  }
};

template <int D>
struct QueryRegs<float, D> {
  __m512 v[D / 16];
  explicit QueryRegs(const float* q) {
    for (int c = 0; c < D / 16; ++c) v[c] = _mm512_loadu_ps(q + 16 * c);
  }
  __m512 dot(const float* key) const {
    __m512 acc = _mm512_mul_ps(v[0], _mm512_loadu_ps(key));
    for (int c = 1; c < D / 16; ++c) acc = _mm512_fmadd_ps(v[c], _mm512_loadu_ps(key + 16 * c), acc);
    return acc;
  }
};

// One KV head of one sequence: its qpk query heads against len keys and values whose
// offsets in the cache are given. next_k/next_v (or null) are the next head of the same
// sequence, whose first rows are prefetched while this head's last keys are scored.
// An 8-bit cache's keys are widened to T, 16 rows at a time, once for all the query heads.
template <int D, typename T, int F, typename E = typename CacheOf<T, F>::E>
void attend(const T* q, int64_t q_head_stride, int qpk, const E* k_cache, const E* v_cache, const E* next_k,
            const E* next_v, const int64_t* offsets, int64_t len, bool warm, float scale, float softcap, T* out,
            int64_t o_head_stride, std::vector<float>& scores) {
  constexpr int kLanes = D / 16;                // float32 vectors per head row
  constexpr int kHeadsPerPass = D <= 64 ? 4 : D <= 128 ? 2 : 1;  // value accumulators: at most 16 registers
  const int64_t padded = (len + 15) / 16 * 16;
  scores.resize((size_t)qpk * padded);
  auto row = [&](const E* cache, int64_t t) { return cache + offsets[t]; };

  // Scores, 16 keys at a time: each query head's 16 dot products reduced together. Keys
  // and values kAhead rows on are prefetched meanwhile, so the value pass reads from L2,
  // one row between two dot products rather than all in a burst: a burst overfills the
  // queue of misses and the rest of it is dropped (measured on a bare read with this much
  // arithmetic per row: 18 GB/s spread out against 15 in bursts).
  constexpr int64_t kAhead = 32;
  if (!warm)  // the first head of a sequence: nothing asked for these rows yet
    for (int64_t t = 0; t < len && t < kAhead; ++t) {
      prefetch_row<D>(row(k_cache, t));
      prefetch_row<D>(row(v_cache, t));
    }
  const int value_head = qpk > 1 ? 1 : 0;  // the head whose pass prefetches values
  const E* keys[16];
  const E* ahead_k[16];
  const E* ahead_v[16];
  const T* key_rows[16];
  alignas(64) T widened[F == fp8::kSame ? 1 : 16 * D];
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = len - t0 < 16 ? (int)(len - t0) : 16;
    for (int j = 0; j < n; ++j) keys[j] = row(k_cache, t0 + j);
    int n_ahead = 0;
    for (int64_t t = t0 + kAhead; t < t0 + kAhead + 16; ++t, ++n_ahead) {
      if (t < len) {
        ahead_k[n_ahead] = row(k_cache, t);
        ahead_v[n_ahead] = row(v_cache, t);
      } else if (next_k && t - len < len) {  // past this head's keys: the next head's first
        ahead_k[n_ahead] = row(next_k, t - len);
        ahead_v[n_ahead] = row(next_v, t - len);
      } else {
        break;
      }
    }
    for (int j = 0; j < n; ++j) {
      if constexpr (F == fp8::kSame) {
        key_rows[j] = keys[j];
      } else {
        CacheOf<T, F>::template widen<D>(keys[j], widened + j * D);
        key_rows[j] = widened + j * D;
      }
    }
    for (int i = 0; i < qpk; ++i) {
      const QueryRegs<T, D> qv(q + i * q_head_stride);
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        if (j < n_ahead) {
          if (i == 0) prefetch_row<D>(ahead_k[j]);
          if (i == value_head) prefetch_row<D>(ahead_v[j]);
        }
        acc[j] = j < n ? qv.dot(key_rows[j]) : _mm512_setzero_ps();
      }
      __m512 s = _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(scale));
      if (softcap > 0.0f) s = softcap512(s, softcap);  // Gemma 2's, after the scale
      _mm512_mask_storeu_ps(scores.data() + i * padded + t0, tail_mask(n), s);
    }
  }

  // Softmax of each head's row, in place; the tail past len is masked out of every op.
  float inv_sum[kMaxQueryPerKv];
  for (int i = 0; i < qpk; ++i) {
    float* s = scores.data() + i * padded;
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = tail_mask(len - t);
      vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_maskz_loadu_ps(m, s + t));
    }
    const __m512 row_max = _mm512_set1_ps(_mm512_reduce_max_ps(vmax));
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = tail_mask(len - t);
      const __m512 e = _mm512_maskz_mov_ps(m, exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), row_max)));
      _mm512_mask_storeu_ps(s + t, m, e);
      vsum = _mm512_add_ps(vsum, e);
    }
    inv_sum[i] = 1.0f / _mm512_reduce_add_ps(vsum);
  }

  // Output: each value row is converted once and added into every head of a pass.
  for (int h0 = 0; h0 < qpk; h0 += kHeadsPerPass) {
    const int nh = qpk - h0 < kHeadsPerPass ? qpk - h0 : kHeadsPerPass;
    __m512 acc[kHeadsPerPass][kLanes];
    for (int j = 0; j < kHeadsPerPass; ++j)
      for (int c = 0; c < kLanes; ++c) acc[j][c] = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; ++t) {
      const E* value = row(v_cache, t);
      __m512 v[kLanes];
      for (int c = 0; c < kLanes; ++c) v[c] = CacheOf<T, F>::load(value + 16 * c);
      for (int j = 0; j < kHeadsPerPass; ++j) {
        if (j >= nh) break;
        const __m512 p = _mm512_set1_ps(scores[(h0 + j) * padded + t]);
        for (int c = 0; c < kLanes; ++c) acc[j][c] = _mm512_fmadd_ps(p, v[c], acc[j][c]);
      }
    }
    for (int j = 0; j < nh; ++j) {
      const __m512 norm = _mm512_set1_ps(inv_sum[h0 + j]);
      for (int c = 0; c < kLanes; ++c)
        store16(out + (h0 + j) * o_head_stride + 16 * c, _mm512_mul_ps(acc[j][c], norm));
    }
  }
}

// Returns 0, or -1 for a head_dim without a compiled variant (the caller falls back).
template <typename T, int F, typename E = typename CacheOf<T, F>::E>
int decode_attention(const T* q, int64_t q_token_stride, int64_t q_head_stride, const E* k_cache, const E* v_cache,
                     int64_t block_stride, int64_t slot_stride, int64_t head_stride, const int32_t* block_table,
                     int64_t table_stride, const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale, T* out,
                     int64_t o_token_stride, int64_t o_head_stride, int threads, int64_t window, float softcap) {
  if (head_dim != 64 && head_dim != 128 && head_dim != 256) return -1;
  const int qpk = (int)(num_heads / num_kv_heads);
  if (qpk > kMaxQueryPerKv || qpk * num_kv_heads != num_heads) return -2;
  // Sequences differ in length: hand them out one at a time. A sequence's KV heads are
  // taken in turn by one thread, so the prefetches run on from one head into the next;
  // with fewer sequences than twice the threads (a single stream), each KV head is a task
  // of its own, so that every thread has work.
  const int64_t heads_per_task = num_seqs >= 2 * threads ? num_kv_heads : 1;
  const int64_t tasks_per_seq = num_kv_heads / heads_per_task;
#pragma omp parallel num_threads(threads)
  {
    std::vector<float> scores;
    std::vector<int64_t> offsets;
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < num_seqs * tasks_per_seq; ++task) {
      const int64_t s = task / tasks_per_seq, g0 = task % tasks_per_seq * heads_per_task;
      // A sliding window (> 0) sees the last `window` keys, the new one's included.
      const int64_t first = window > 0 && seq_lens[s] > window ? seq_lens[s] - window : 0;
      const int64_t len = seq_lens[s] - first;
      // Each key's offset in the cache, once for the task's heads: a division per lookup
      // (four lookups a key, with the prefetches) cost more than the arithmetic on the key.
      offsets.resize((size_t)len);
      const int32_t* blocks = block_table + s * table_stride;
      for (int64_t t = 0, b = first / block_size, j = first % block_size; t < len; ++t) {
        offsets[t] = (int64_t)blocks[b] * block_stride + j * slot_stride;
        if (++j == block_size) j = 0, ++b;
      }
      for (int64_t g = g0; g < g0 + heads_per_task; ++g) {
        const T* qs = q + s * q_token_stride + g * qpk * q_head_stride;
        T* os = out + s * o_token_stride + g * qpk * o_head_stride;
        const E* kc = k_cache + g * head_stride;
        const E* vc = v_cache + g * head_stride;
        const bool last = g + 1 == g0 + heads_per_task;
        const E* next_k = last ? nullptr : kc + head_stride;
        const E* next_v = last ? nullptr : vc + head_stride;
        if (head_dim == 64)
          attend<64, T, F>(qs, q_head_stride, qpk, kc, vc, next_k, next_v, offsets.data(), len, g > g0, scale, softcap,
                     os, o_head_stride, scores);
        else if (head_dim == 128)
          attend<128, T, F>(qs, q_head_stride, qpk, kc, vc, next_k, next_v, offsets.data(), len, g > g0, scale,
                      softcap, os, o_head_stride, scores);
        else  // Gemma's 256
          attend<256, T, F>(qs, q_head_stride, qpk, kc, vc, next_k, next_v, offsets.data(), len, g > g0, scale,
                      softcap, os, o_head_stride, scores);
      }
    }
  }
  return 0;
}

}  // namespace

extern "C" {

// kv_format (fp8.h): 0 a cache of the queries' dtype, 1 float8 e4m3, 2 float8 e5m2; -3
// for another code.
#define LLMBUS_DECODE_ATTENTION(T, SUFFIX)                                                                        \
  int llmbus_paged_decode_attention_##SUFFIX(                                                                     \
      const T* q, int64_t q_token_stride, int64_t q_head_stride, /* [num_seqs, num_heads, head_dim] */             \
      const void* k_cache, const void* v_cache, /* element strides below */                                       \
      int64_t block_stride, int64_t slot_stride, int64_t head_stride, const int32_t* block_table,                  \
      int64_t table_stride, const int32_t* seq_lens, int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads,    \
      int64_t head_dim, int64_t block_size, float scale, T* out, int64_t o_token_stride, int64_t o_head_stride,    \
      int threads, int64_t kv_format, int64_t window, float softcap) {                                            \
    return with_format(kv_format, [&](auto format) {                                                              \
      using E = typename CacheOf<T, decltype(format)::value>::E;                                                  \
      return decode_attention<T, decltype(format)::value>(                                                        \
          q, q_token_stride, q_head_stride, (const E*)k_cache, (const E*)v_cache, block_stride, slot_stride,       \
          head_stride, block_table, table_stride, seq_lens, num_seqs, num_heads, num_kv_heads, head_dim,          \
          block_size, scale, out, o_token_stride, o_head_stride, threads, window, softcap);                       \
    });                                                                                                           \
  }
LLMBUS_DECODE_ATTENTION(uint16_t, bf16)
LLMBUS_DECODE_ATTENTION(float, f32)
#undef LLMBUS_DECODE_ATTENTION

}  // extern "C"

namespace {

// Each row's key and value heads into its cache slot (converted to the cache's format);
// a negative slot is a padded row.
template <typename T, int F, typename E = typename CacheOf<T, F>::E>
void write_kv(const T* key, const T* value, int64_t row_stride, const int64_t* slots, int64_t rows,
              int64_t num_kv_heads, int64_t head_dim, E* k_cache, E* v_cache, int64_t block_stride,
              int64_t slot_stride, int64_t head_stride, int64_t block_size) {
  auto put = [&](const T* src, E* dst) {
    if constexpr (F == fp8::kSame) {
      memcpy(dst, src, head_dim * sizeof(T));
    } else {
      for (int64_t i = 0; i < head_dim; i += 16) {
        const __mmask16 m = tail_mask(head_dim - i);
        fp8::store16<F>(dst + i, load16(src + i, m), m);
      }
    }
  };
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t slot = slots[r];
    if (slot < 0) continue;
    const int64_t base = (slot / block_size) * block_stride + (slot % block_size) * slot_stride;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      put(key + r * row_stride + h * head_dim, k_cache + base + h * head_stride);
      put(value + r * row_stride + h * head_dim, v_cache + base + h * head_stride);
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or -3 for an unknown kv_format.
#define LLMBUS_WRITE_KV(T, SUFFIX)                                                                                \
  int llmbus_write_kv_##SUFFIX(const T* key, const T* value, int64_t row_stride, const int64_t* slots,            \
                               int64_t rows, int64_t num_kv_heads, int64_t head_dim, void* k_cache, void* v_cache, \
                               int64_t block_stride, int64_t slot_stride, int64_t head_stride, int64_t block_size,  \
                               int64_t kv_format) {                                                               \
    return with_format(kv_format, [&](auto format) {                                                              \
      using E = typename CacheOf<T, decltype(format)::value>::E;                                                  \
      write_kv<T, decltype(format)::value>(key, value, row_stride, slots, rows, num_kv_heads, head_dim,          \
                                           (E*)k_cache, (E*)v_cache, block_stride, slot_stride, head_stride,      \
                                           block_size);                                                           \
      return 0;                                                                                                   \
    });                                                                                                           \
  }
LLMBUS_WRITE_KV(uint16_t, bf16)
LLMBUS_WRITE_KV(float, f32)
#undef LLMBUS_WRITE_KV

}  // extern "C"
