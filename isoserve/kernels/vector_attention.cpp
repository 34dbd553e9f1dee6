// Decode attention in float32 on AVX2: one query token per sequence over its pages in place,
// for a CPU without AVX-512 (cpu_ops.cpp's decode_attention calls it there, for float32 with a
// head of a multiple of 8 dims; its own kernel takes every other case). The pool is float32 or
// bfloat16 (--kv-dtype): a bfloat16 key or value is widened exactly as it is loaded (load8), so
// the arithmetic is the same; at batch 32 over a worker's pool that halves what the kernel waits
// for (docs/benchmarks.md).
//
// Why its own kernel: cpu_ops.cpp's is written on 16-float vectors for AVX-512's 32 registers.
// On AVX2 each of those is two of sixteen 8-float registers, and the query heads, their partial
// scores and their value sums no longer fit: 30 layers at batch 32 (SmolLM2, ~130 keys) took
// 28 ms a step, a fifth of it, reading 195 MB of KV that the machine streams in ~7 ms.
//
// Here every loop works on a tile sized to the 16 registers:
//   scores  two keys x up to three query heads (6 sums), the query's 8 dims at a time loaded
//           once for both keys; every 8 keys, one tree folds each head's 8 partial sums into
//           8 scores (f32x8.h's sum_each8), not 8 horizontal reductions;
//   softmax in float32 over the scores, exact maximum first (as cpu_ops.cpp's kernel);
//   values  up to three heads x 32 dims (12 sums) over every key; a 64-dim head reads its
//           values twice, the second time from L2.
// The query heads of a KV head share each key and value read (grouped-query attention).
// Memory: a sequence's pages lie anywhere in the pool, so the hardware prefetcher cannot
// follow them; in the first head tile's pass each key prefetches the key 16 ahead (into L1)
// and its own value (into L2, for the values pass). Issued all at once at a task's start, the
// prefetches would hold up the loads they are meant to help (cpu_ops.cpp's kernel measured it).
//
// Memory safety: the caller (cpu_ops.cpp's decode_attention) has bounds-checked every page id
// and length against the pool before this runs. Ownership is the read guard's (kv/guard.py).
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "f32x8.h"

#if ISOSERVE_F32X8
namespace {

using namespace isoserve;

constexpr int64_t kKeyBlock = 8;  // keys whose scores one fold produces
constexpr int64_t kPrefetchKeys = 16;

// Eight KV elements as float32: a float32 pool's as they are; a bfloat16 pool's (its bits, as
// uint16_t) widened, since a bfloat16 is the top half of a float32.
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// Key `t + kPrefetchKeys` into L1 and value `t` into L2, a cache line at a time.
template <typename KV>
inline void prefetch_key(const KV* k_head, const KV* v_head, const int64_t* key_at, int64_t t, int64_t dim) {
  const char* ahead = reinterpret_cast<const char*>(k_head + key_at[t + kPrefetchKeys]);
  const char* value = reinterpret_cast<const char*>(v_head + key_at[t]);
  for (int64_t l = 0; l < dim * static_cast<int64_t>(sizeof(KV)); l += 64) {
    _mm_prefetch(ahead + l, _MM_HINT_T0);
    _mm_prefetch(value + l, _MM_HINT_T1);
  }
}

// Scores of keys k0 and k1 (k1 may be k0 when only one is real) against GT query heads, as
// 8-lane partial sums parts[g * 8 + slot]: each 8 dims of a head are loaded once for both keys.
template <int GT, typename KV>
inline void score_pair(const float* q, int64_t dim, const KV* k0, const KV* k1, __m256* parts, int64_t slot) {
  __m256 a0[GT], a1[GT];
  for (int g = 0; g < GT; ++g) a0[g] = a1[g] = _mm256_setzero_ps();
  for (int64_t d = 0; d < dim; d += 8) {
    const __m256 x0 = load8(k0 + d), x1 = load8(k1 + d);
    for (int g = 0; g < GT; ++g) {
      const __m256 qg = _mm256_loadu_ps(q + g * dim + d);
      a0[g] = _mm256_fmadd_ps(qg, x0, a0[g]);
      a1[g] = _mm256_fmadd_ps(qg, x1, a1[g]);
    }
  }
  for (int g = 0; g < GT; ++g) parts[g * kKeyBlock + slot] = a0[g], parts[g * kKeyBlock + slot + 1] = a1[g];
}

// Scores of keys [0, len) for the tile's GT query heads into scores[g * padded + key]; the
// first tile of a task prefetches (key_at has kPrefetchKeys entries past len, repeating the last).
template <int GT, typename KV>
void score_heads(const float* q, int64_t dim, const KV* k_head, const KV* v_head, const int64_t* key_at,
                 int64_t len, float* scores, int64_t padded, bool prefetch) {
  __m256 parts[GT * kKeyBlock];
  for (int64_t start = 0; start < len; start += kKeyBlock) {
    const int64_t n = std::min(kKeyBlock, len - start);
    for (int64_t s = 0; s < kKeyBlock; s += 2) {
      if (s >= n) {
        for (int g = 0; g < GT; ++g) parts[g * kKeyBlock + s] = parts[g * kKeyBlock + s + 1] = _mm256_setzero_ps();
        continue;
      }
      const int64_t t = start + s;
      if (prefetch) {
        prefetch_key(k_head, v_head, key_at, t, dim);
        if (s + 1 < n) prefetch_key(k_head, v_head, key_at, t + 1, dim);
      }
      const KV* k0 = k_head + key_at[t];
      const KV* k1 = s + 1 < n ? k_head + key_at[t + 1] : k0;  // a lone last key: its slot is ignored
      score_pair<GT>(q, dim, k0, k1, parts, s);
    }
    for (int g = 0; g < GT; ++g) _mm256_storeu_ps(scores + g * padded + start, sum_each8(parts + g * kKeyBlock));
  }
}

// Softmax numerators of one head's scores in place (the padding past len set to 0); returns
// their sum.
inline float exponentiate(float* sc, int64_t len, int64_t padded) {
  __m256 tops = _mm256_set1_ps(sc[0]);
  int64_t i = 0;
  for (; i + 8 <= len; i += 8) tops = _mm256_max_ps(tops, _mm256_loadu_ps(sc + i));
  float top = max_lanes8(tops);
  for (; i < len; ++i) top = std::max(top, sc[i]);
  for (int64_t t = len; t < padded; ++t) sc[t] = top;  // exp(0) below, then cleared
  const __m256 top8 = _mm256_set1_ps(top);
  __m256 sums = _mm256_setzero_ps();
  for (int64_t e = 0; e < padded; e += 8) {
    const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + e), top8));
    _mm256_storeu_ps(sc + e, p);
    if (e + 8 <= len) sums = _mm256_add_ps(sums, p);
  }
  float total = sum_lanes8(sums);
  for (int64_t t = len / 8 * 8; t < len; ++t) total += sc[t];
  for (int64_t t = len; t < padded; ++t) sc[t] = 0.0f;
  return total;
}

// out[g][d0, d0 + 8 DT) for query heads [0, GT) of the tile: the values of keys [0, len)
// weighted by the heads' numerators, over their sums.
template <int GT, int DT, typename KV>
void value_tile(const KV* v_head, const int64_t* key_at, int64_t len, const float* scores, int64_t padded,
                const float* total, int64_t d0, float* out, int64_t dim) {
  __m256 acc[GT][DT];
  for (int g = 0; g < GT; ++g)
    for (int c = 0; c < DT; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t t = 0; t < len; ++t) {
    const KV* value = v_head + key_at[t] + d0;
    __m256 w[GT];
    for (int g = 0; g < GT; ++g) w[g] = _mm256_broadcast_ss(scores + g * padded + t);
    for (int c = 0; c < DT; ++c) {
      const __m256 x = load8(value + 8 * c);
      for (int g = 0; g < GT; ++g) acc[g][c] = _mm256_fmadd_ps(w[g], x, acc[g][c]);
    }
  }
  for (int g = 0; g < GT; ++g) {
    const __m256 sum = _mm256_set1_ps(total[g]);
    for (int c = 0; c < DT; ++c) _mm256_storeu_ps(out + g * dim + d0 + 8 * c, _mm256_div_ps(acc[g][c], sum));
  }
}

template <int GT, typename KV>
void value_heads(const KV* v_head, const int64_t* key_at, int64_t len, const float* scores, int64_t padded,
                 const float* total, float* out, int64_t dim) {
  int64_t d0 = 0;
  for (; d0 + 32 <= dim; d0 += 32) value_tile<GT, 4>(v_head, key_at, len, scores, padded, total, d0, out, dim);
  switch ((dim - d0) / 8) {
    case 3: value_tile<GT, 3>(v_head, key_at, len, scores, padded, total, d0, out, dim); break;
    case 2: value_tile<GT, 2>(v_head, key_at, len, scores, padded, total, d0, out, dim); break;
    case 1: value_tile<GT, 1>(v_head, key_at, len, scores, padded, total, d0, out, dim); break;
    default: break;
  }
}

template <typename Fn>
inline void by_head_tiles(int64_t group, Fn&& fn) {
  // Query heads in tiles of up to three: the register budget of score_pair and value_tile.
  int64_t g0 = 0;
  for (; g0 + 3 <= group; g0 += 3) fn(g0, std::integral_constant<int, 3>{});
  if (group - g0 == 2) fn(g0, std::integral_constant<int, 2>{});
  if (group - g0 == 1) fn(g0, std::integral_constant<int, 1>{});
}

// Every task of the step: (sequence, KV head) pairs over the threads.
template <typename KV>
bool attend_all(const float* q, const KV* kc, const KV* vc, const int64_t* pages, const int64_t* lens, float* out,
                int64_t batch, int64_t heads, int64_t kv_heads, int64_t num_pages, int64_t page_size, int64_t dim,
                int64_t width, float scale) {
  if (dim % 8 != 0) return false;
  const int64_t group = heads / kv_heads, page_stride = page_size * dim, head_stride = num_pages * page_stride;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qs(group * dim), scores, total(group);
    std::vector<int64_t> key_at;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, h = task % kv_heads, len = lens[b];
      const int64_t* table = pages + b * width;
      const float* q_head = q + (b * heads + h * group) * dim;
      for (int64_t i = 0; i < group * dim; ++i) qs[i] = q_head[i] * scale;
      // Each key's offset in its head's cache, page by page: no division per key later.
      key_at.resize(len + kPrefetchKeys);
      for (int64_t t = 0, p = 0; t < len; ++p)
        for (int64_t s = 0; s < page_size && t < len; ++s, ++t) key_at[t] = table[p] * page_stride + s * dim;
      std::fill(key_at.begin() + len, key_at.end(), key_at[len - 1]);
      const KV* k_head = kc + h * head_stride;
      const KV* v_head = vc + h * head_stride;
      for (int64_t t = 0; t < std::min(len, kPrefetchKeys); ++t)
        for (int64_t l = 0; l < dim * static_cast<int64_t>(sizeof(KV)); l += 64) _mm_prefetch(reinterpret_cast<const char*>(k_head + key_at[t]) + l, _MM_HINT_T0);
      const int64_t padded = (len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
      scores.resize(group * padded);
      by_head_tiles(group, [&](int64_t g0, auto tile) {
        constexpr int GT = decltype(tile)::value;
        score_heads<GT>(qs.data() + g0 * dim, dim, k_head, v_head, key_at.data(), len, scores.data() + g0 * padded,
                        padded, g0 == 0);
      });
      for (int64_t g = 0; g < group; ++g) total[g] = exponentiate(scores.data() + g * padded, len, padded);
      float* o = out + (b * heads + h * group) * dim;
      by_head_tiles(group, [&](int64_t g0, auto tile) {
        constexpr int GT = decltype(tile)::value;
        value_heads<GT>(v_head, key_at.data(), len, scores.data() + g0 * padded, padded, total.data() + g0,
                        o + g0 * dim, dim);
      });
    }
  });
  return true;
}

}  // namespace

// True when it took the call: heads of a multiple of 8 dims, float32 queries and output, the
// pool in float32 or bfloat16 (its bits as uint16_t). Inputs as cpu_ops.cpp's decode_attention
// has checked them.
bool vector_decode_attention(const float* q, const float* kc, const float* vc, const int64_t* pages,
                             const int64_t* lens, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                             int64_t num_pages, int64_t page_size, int64_t dim, int64_t width, float scale) {
  return attend_all(q, kc, vc, pages, lens, out, batch, heads, kv_heads, num_pages, page_size, dim, width, scale);
}

bool vector_decode_attention(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* pages,
                             const int64_t* lens, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                             int64_t num_pages, int64_t page_size, int64_t dim, int64_t width, float scale) {
  return attend_all(q, kc, vc, pages, lens, out, batch, heads, kv_heads, num_pages, page_size, dim, width, scale);
}

#else

bool vector_decode_attention(const float*, const float*, const float*, const int64_t*, const int64_t*, float*,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float) {
  return false;
}

bool vector_decode_attention(const float*, const uint16_t*, const uint16_t*, const int64_t*, const int64_t*, float*,
                             int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float) {
  return false;
}

#endif
