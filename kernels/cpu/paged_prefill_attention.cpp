// Causal attention of one request's new tokens (a prefill chunk) over its paged cache:
// flash-attention on AVX-512, bfloat16 (with BF16 dot products) or float32 in and out,
// float32 softmax and sums.
//
// PyTorch's CPU SDPA ran W1's prompts (64-512 tokens, bf16) at ~50 GFLOP/s, 8.9 s of a
// 55 s run. Here the request's keys and values are first rearranged, per KV head, into
// the pair layout vdpbf16ps multiplies (16 keys x 2 dims for scores, 16 dims x 2 keys for
// the weighted sum), then each task (a KV head and 32 query tokens with all the query
// heads that share it) walks 16-key tiles with an online softmax, four query rows at a
// time so that their dot-product chains overlap. Probabilities are rounded to bfloat16
// for the weighted sum, as flash-attention does on GPUs.
//
// float32 runs the same tiles with FMAs: keys transposed (16 keys per vector, one vector
// per dim), values as they are, probabilities kept in float32. Only the tile layouts and
// the two inner products differ by dtype (struct Tiles); the online softmax is shared.
#include <math.h>
#include <string.h>

#include <vector>

#include "fp8.h"
#include "simd.h"

namespace {

constexpr int64_t kTile = 16;      // keys per tile: one float32 vector of scores
constexpr int64_t kQueryTile = 32;  // query tokens per task

// How one dtype lays out a tile of keys and values and multiplies with it.
template <typename T, int D>
struct Tiles;

template <int D>
struct Tiles<uint16_t, D> {
  // keys -> [D/2 dim pairs][16 keys][2 dims]; values -> [8 key pairs][D/16][16 dims][2 keys]
  static void store_row(uint16_t* kdst, uint16_t* vdst, int64_t j, const uint16_t* key, const uint16_t* value) {
    for (int64_t c = 0; c < D / 2; ++c) {
      kdst[(c * kTile + j) * 2] = key ? key[2 * c] : 0;
      kdst[(c * kTile + j) * 2 + 1] = key ? key[2 * c + 1] : 0;
    }
    for (int64_t d = 0; d < D; ++d)  // key pair j/2, dim chunk d/16, dim d%16, key j%2
      vdst[(((j / 2) * (D / 16) + d / 16) * 16 + d % 16) * 2 + j % 2] = value ? value[d] : 0;
  }

  // s[r] = q[r] . each of the tile's 16 keys, two chains per row.
  template <int RB>
  static void scores(const uint16_t* const* q, const uint16_t* kt, __m512* s) {
    __m512 s2[RB];
    for (int r = 0; r < RB; ++r) s[r] = s2[r] = _mm512_setzero_ps();
    for (int c = 0; c < D / 2; c += 2) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + c * kTile * 2);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + (c + 1) * kTile * 2);
      for (int r = 0; r < RB; ++r) {
        int32_t p0, p1;
        memcpy(&p0, q[r] + 2 * c, 4);
        memcpy(&p1, q[r] + 2 * c + 2, 4);
        s[r] = _mm512_dpbf16_ps(s[r], (__m512bh)_mm512_set1_epi32(p0), k0);
        s2[r] = _mm512_dpbf16_ps(s2[r], (__m512bh)_mm512_set1_epi32(p1), k1);
      }
    }
    for (int r = 0; r < RB; ++r) s[r] = _mm512_add_ps(s[r], s2[r]);
  }

  // o[r] += p[r] @ the tile's values, probabilities rounded to bfloat16.
  template <int RB>
  static void accumulate(const __m512* p, const uint16_t* vt, __m512 (*o)[D / 16]) {
    __m256bh pb[RB];
    for (int r = 0; r < RB; ++r) pb[r] = _mm512_cvtneps_pbh(p[r]);
    for (int jp = 0; jp < kTile / 2; ++jp) {
      for (int c = 0; c < D / 16; ++c) {
        const __m512bh v = (__m512bh)_mm512_loadu_si512(vt + (jp * (D / 16) + c) * 32);
        for (int r = 0; r < RB; ++r) {
          int32_t pair;
          memcpy(&pair, (const uint16_t*)&pb[r] + 2 * jp, 4);
          o[r][c] = _mm512_dpbf16_ps(o[r][c], (__m512bh)_mm512_set1_epi32(pair), v);
        }
      }
    }
  }
};

template <int D>
struct Tiles<float, D> {
  // keys -> [D dims][16 keys]; values -> [16 keys][D], as in the cache
  static void store_row(float* kdst, float* vdst, int64_t j, const float* key, const float* value) {
    for (int64_t d = 0; d < D; ++d) kdst[d * kTile + j] = key ? key[d] : 0.0f;
    for (int64_t d = 0; d < D; ++d) vdst[j * D + d] = value ? value[d] : 0.0f;
  }

  template <int RB>
  static void scores(const float* const* q, const float* kt, __m512* s) {
    __m512 s2[RB];
    for (int r = 0; r < RB; ++r) s[r] = s2[r] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 2) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * kTile), k1 = _mm512_loadu_ps(kt + (d + 1) * kTile);
      for (int r = 0; r < RB; ++r) {
        s[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d]), k0, s[r]);
        s2[r] = _mm512_fmadd_ps(_mm512_set1_ps(q[r][d + 1]), k1, s2[r]);
      }
    }
    for (int r = 0; r < RB; ++r) s[r] = _mm512_add_ps(s[r], s2[r]);
  }

  template <int RB>
  static void accumulate(const __m512* p, const float* vt, __m512 (*o)[D / 16]) {
    alignas(64) float pr[RB][kTile];
    for (int r = 0; r < RB; ++r) _mm512_store_ps(pr[r], p[r]);
    for (int j = 0; j < kTile; ++j) {
      for (int c = 0; c < D / 16; ++c) {
        const __m512 v = _mm512_loadu_ps(vt + j * D + 16 * c);
        for (int r = 0; r < RB; ++r) o[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(pr[r][j]), v, o[r][c]);
      }
    }
  }
};

// The tile holding the first key a query at `pos` sees: 0, or its sliding window's first.
inline int64_t first_tile_seen(int64_t pos, int64_t window) {
  return window > 0 && pos - window + 1 > 0 ? (pos - window + 1) / kTile : 0;
}

// The request's keys and values from tile `first_tile` on, paged, into tiles of kTile keys
// (zeros past len); rows of an 8-bit cache are widened to T on the way (exactly).
template <int D, typename T, int F, typename E = typename CacheOf<T, F>::E>
void rearrange(const E* k_cache, const E* v_cache, int64_t block_stride, int64_t slot_stride, const int32_t* blocks,
               int64_t block_size, int64_t len, int64_t first_tile, T* kt, T* vt) {
  const int64_t tiles = (len + kTile - 1) / kTile - first_tile;
  alignas(64) T key_row[D], value_row[D];
  for (int64_t t = 0; t < tiles; ++t) {
    for (int64_t j = 0; j < kTile; ++j) {
      const int64_t pos = (first_tile + t) * kTile + j;
      const T* key = nullptr;
      const T* value = nullptr;
      if (pos < len) {
        const int64_t off = (int64_t)blocks[pos / block_size] * block_stride + (pos % block_size) * slot_stride;
        if constexpr (F == fp8::kSame) {
          key = k_cache + off;
          value = v_cache + off;
        } else {
          CacheOf<T, F>::template widen<D>(k_cache + off, key_row);
          CacheOf<T, F>::template widen<D>(v_cache + off, value_row);
          key = key_row;
          value = value_row;
        }
      }
      Tiles<T, D>::store_row(kt + t * kTile * D, vt + t * kTile * D, j, key, value);
    }
  }
}

// RB query rows (any tokens and heads of one KV head) over keys [0, last_pos of each row],
// or with a sliding window (> 0) its last `window` of them; scores soft-capped where
// softcap > 0 (Gemma 2's). kt and vt hold the tiles from `base_tile` on.
template <int D, int RB, typename T>
void rows_block(const T* const* q, const int64_t* last, T* const* out, const T* kt, const T* vt, int64_t base_tile,
                float scale, int64_t window, float softcap) {
  constexpr int kChunks = D / 16;
  __m512 o[RB][kChunks], m[RB], l[RB];
  for (int r = 0; r < RB; ++r) {
    for (int c = 0; c < kChunks; ++c) o[r][c] = _mm512_setzero_ps();
    m[r] = _mm512_set1_ps(-INFINITY);
    l[r] = _mm512_setzero_ps();
  }
  int64_t max_last = 0, min_last = last[0];
  for (int r = 0; r < RB; ++r) {
    max_last = last[r] > max_last ? last[r] : max_last;
    min_last = last[r] < min_last ? last[r] : min_last;
  }
  const __m512 lane = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  // With a window, from the tile of the first key any row sees.
  for (int64_t t = first_tile_seen(min_last, window); t * kTile <= max_last; ++t) {
    __m512 s[RB], p[RB];
    const int64_t at = (t - base_tile) * kTile * D;
    Tiles<T, D>::template scores<RB>(q, kt + at, s);
    const __m512 key_pos = _mm512_add_ps(lane, _mm512_set1_ps((float)(t * kTile)));
    for (int r = 0; r < RB; ++r) {
      __m512 sc = _mm512_mul_ps(s[r], _mm512_set1_ps(scale));
      if (softcap > 0.0f) sc = softcap512(sc, softcap);
      // Keys after this row's token (and past the sequence), or before its window, do not count.
      __mmask16 visible = _mm512_cmp_ps_mask(key_pos, _mm512_set1_ps((float)last[r]), _CMP_LE_OQ);
      if (window > 0)
        visible &= _mm512_cmp_ps_mask(key_pos, _mm512_set1_ps((float)(last[r] - window)), _CMP_GT_OQ);
      sc = _mm512_mask_blend_ps(visible, _mm512_set1_ps(-INFINITY), sc);
      const __m512 m_new = _mm512_max_ps(m[r], _mm512_set1_ps(_mm512_reduce_max_ps(sc)));
      // A row that has seen no key yet (a window starting past this tile) keeps nothing:
      // subtract 0 rather than -inf, so no inf - inf.
      const __m512 m_safe = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(m_new, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                                                 m_new, _mm512_setzero_ps());
      const __m512 correction = exp512(_mm512_sub_ps(m[r], m_safe));
      p[r] = _mm512_maskz_mov_ps(visible, exp512(_mm512_sub_ps(sc, m_safe)));
      m[r] = m_new;
      l[r] = _mm512_fmadd_ps(l[r], correction, _mm512_set1_ps(_mm512_reduce_add_ps(p[r])));
      for (int c = 0; c < kChunks; ++c) o[r][c] = _mm512_mul_ps(o[r][c], correction);
    }
    Tiles<T, D>::template accumulate<RB>(p, vt + at, o);
  }
  for (int r = 0; r < RB; ++r) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), l[r]);
    for (int c = 0; c < kChunks; ++c) store16(out[r] + 16 * c, _mm512_mul_ps(o[r][c], inv));
  }
}

template <int D, typename T, int F, typename E = typename CacheOf<T, F>::E>
void prefill(const T* q, int64_t q_token_stride, int64_t q_head_stride, const E* k_cache,
             const E* v_cache, int64_t block_stride, int64_t slot_stride, int64_t head_stride,
             const int32_t* blocks, int64_t query_len, int64_t seq_len, int64_t num_heads, int64_t num_kv_heads,
             int64_t block_size, float scale, T* out, int64_t o_token_stride, int64_t o_head_stride,
             int threads, int64_t window, float softcap) {
  constexpr int RB = D <= 64 ? 4 : D <= 128 ? 2 : 1;  // accumulators: RB x D/16 vectors (at most 16)
  const int64_t qpk = num_heads / num_kv_heads;
  const int64_t first_pos = seq_len - query_len;  // the new tokens are the last query_len
  // Only the keys some new token sees are laid out: with a sliding window, from the first
  // token's window on, not the whole context.
  const int64_t first_tile = first_tile_seen(first_pos, window);
  const int64_t tiles = (seq_len + kTile - 1) / kTile - first_tile;
  const int64_t per_head = tiles * kTile * D;
  std::vector<T> kt((size_t)(num_kv_heads * per_head)), vt((size_t)(num_kv_heads * per_head));
#pragma omp parallel for num_threads(threads)
  for (int64_t g = 0; g < num_kv_heads; ++g)
    rearrange<D, T, F>(k_cache + g * head_stride, v_cache + g * head_stride, block_stride, slot_stride, blocks, block_size,
                 seq_len, first_tile, kt.data() + g * per_head, vt.data() + g * per_head);
  const int64_t query_tiles = (query_len + kQueryTile - 1) / kQueryTile;
  // Later query tiles see more keys: hand them out first.
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < num_kv_heads * query_tiles; ++task) {
    const int64_t g = task % num_kv_heads, qt = query_tiles - 1 - task / num_kv_heads;
    const int64_t i0 = qt * kQueryTile, i1 = i0 + kQueryTile < query_len ? i0 + kQueryTile : query_len;
    const int64_t rows = (i1 - i0) * qpk;
    const T* qr[RB];
    T* orow[RB];
    int64_t last[RB];
    for (int64_t r0 = 0; r0 < rows; r0 += RB) {
      for (int r = 0; r < RB; ++r) {
        const int64_t row = r0 + r < rows ? r0 + r : rows - 1;  // a short last block repeats a row
        const int64_t i = i0 + row / qpk, h = g * qpk + row % qpk;
        qr[r] = q + i * q_token_stride + h * q_head_stride;
        orow[r] = out + i * o_token_stride + h * o_head_stride;
        last[r] = first_pos + i;
      }
      rows_block<D, RB, T>(qr, last, orow, kt.data() + g * per_head, vt.data() + g * per_head, first_tile, scale,
                           window, softcap);
    }
  }
}

// Returns 0, -1 for a head_dim without a compiled variant, -2 for a head count it cannot split.
template <typename T, int F, typename E = typename CacheOf<T, F>::E>
int prefill_attention(const T* q, int64_t q_token_stride, int64_t q_head_stride, const E* k_cache, const E* v_cache,
                      int64_t block_stride, int64_t slot_stride, int64_t head_stride, const int32_t* blocks,
                      int64_t query_len, int64_t seq_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t block_size, float scale, T* out, int64_t o_token_stride, int64_t o_head_stride,
                      int threads, int64_t window, float softcap) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads || query_len > seq_len || query_len <= 0) return -2;
  if (head_dim == 64)
    prefill<64, T, F>(q, q_token_stride, q_head_stride, k_cache, v_cache, block_stride, slot_stride, head_stride, blocks,
                query_len, seq_len, num_heads, num_kv_heads, block_size, scale, out, o_token_stride, o_head_stride,
                threads, window, softcap);
  else if (head_dim == 128)
    prefill<128, T, F>(q, q_token_stride, q_head_stride, k_cache, v_cache, block_stride, slot_stride, head_stride, blocks,
                 query_len, seq_len, num_heads, num_kv_heads, block_size, scale, out, o_token_stride, o_head_stride,
                 threads, window, softcap);
  else if (head_dim == 256)  // Gemma's
    prefill<256, T, F>(q, q_token_stride, q_head_stride, k_cache, v_cache, block_stride, slot_stride, head_stride, blocks,
                 query_len, seq_len, num_heads, num_kv_heads, block_size, scale, out, o_token_stride, o_head_stride,
                 threads, window, softcap);
  else
    return -1;
  return 0;
}

}  // namespace

extern "C" {

// kv_format as for llmbus_paged_decode_attention_* (fp8.h); -3 for an unknown one.
#define LLMBUS_PREFILL_ATTENTION(T, SUFFIX)                                                                       \
  int llmbus_paged_prefill_attention_##SUFFIX(                                                                    \
      const T* q, int64_t q_token_stride, int64_t q_head_stride, /* [query_len, num_heads, head_dim] */            \
      const void* k_cache, const void* v_cache, int64_t block_stride, int64_t slot_stride, int64_t head_stride,    \
      const int32_t* blocks, /* this request's block table row */                                                 \
      int64_t query_len, int64_t seq_len, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,               \
      int64_t block_size, float scale, T* out, int64_t o_token_stride, int64_t o_head_stride, int threads,         \
      int64_t kv_format, int64_t window, float softcap) {                                                         \
    return with_format(kv_format, [&](auto format) {                                                              \
      using E = typename CacheOf<T, decltype(format)::value>::E;                                                  \
      return prefill_attention<T, decltype(format)::value>(                                                       \
          q, q_token_stride, q_head_stride, (const E*)k_cache, (const E*)v_cache, block_stride, slot_stride,       \
          head_stride, blocks, query_len, seq_len, num_heads, num_kv_heads, head_dim, block_size, scale, out,     \
          o_token_stride, o_head_stride, threads, window, softcap);                                               \
    });                                                                                                           \
  }
LLMBUS_PREFILL_ATTENTION(uint16_t, bf16)
LLMBUS_PREFILL_ATTENTION(float, f32)
#undef LLMBUS_PREFILL_ATTENTION

}  // extern "C"
