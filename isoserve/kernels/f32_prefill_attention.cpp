// Causal attention of a step's prefill chunks over their pages, in float32 on AVX-512, in one
// call: the float32 model's prefill (AMD Zen 4, where `--dtype auto` is float32), as
// amx_attention.cpp is the bfloat16 model's on AMX.
//
// Why: torch's flash kernel, one chunk at a time, ran at about half of float32's multiply-add
// peak on a Zen 4 and took 57% of a 2,000-token prompt's prefill (docs/benchmarks.md, session
// 29); short chunks went a query row at a time through the decode kernel, which shares no key
// read between the rows of a chunk.
//
// Every 16-query block of every head of every chunk is one work item, taken by whichever thread
// frees up first. The block is computed transposed, as amx_attention.cpp does: lane i of every
// vector is query i, so the softmax's maxima, exps and sums are plain vector operations.
//   layout  each (chunk, KV head)'s keys and values widened once to float32 rows [key][dim],
//           zeros past the context, for all the query blocks of its heads;
//   scores  4 keys at a time, each query vector of Q^T (one dim of the block's 16 queries)
//           loaded once for the 4 keys' dims (broadcasts from their rows);
//   softmax exact maximum first, then exp and sum, zero for keys past a query's position;
//   values  16 dims at a time: each key's probabilities (one vector) times its value's dims
//           (broadcasts), 16 sums; transposed back to rows and divided by the sums.
//
// Exactness: each query's output has the bits the decode kernel (cpu_ops.cpp's attend) gives it
// as a single query over keys [0, its position]: the same scaled query, the same multiply-add
// chains and adding tree for a score, the same exp, the same order of the sum of the exps and
// of each dim's sum over the values. Keys past a query's position add nothing (probability 0,
// and their values are not multiplied in). So a prompt cut into chunks, a one-token chunk
// (which runs as a decode row), and a sequence recomputed after preemption (its decoded tokens'
// KV rebuilt by prefill) all give the tokens of an unsplit prefill, on any thread count
// (tests/test_prefill_attention.py, tests/test_engine_batching.py). Matching the decode
// kernel's tree costs ~20 adds per key and block beyond the 64 multiply-adds.
//
// Memory safety and isolation: every chunk's rows, context and page ids are checked against q
// and the pool before anything is read (prefill_chunks.h), and the layout reads no slot past a
// chunk's context. Which pages a chunk may read at all is the read guard's decision
// (kv/guard.py), made before the step.
#include "tensors.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "bf16x16.h"
#include "prefill_chunks.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kBuilt = true;
constexpr int64_t kBlock = 16;   // queries per block, one a lane
constexpr int kKeys = 4;         // keys scored at once (Node): each query vector loaded serves them all

inline int64_t round_up(int64_t a, int64_t b) { return (a + b - 1) / b * b; }

struct Shape {
  int64_t heads, kv_heads, dim, num_pages, page_size, row_stride;
};

struct Chunk {
  isoserve::PrefillSpan span;
  int64_t padded;  // keys laid out: the context rounded up to kKeys
  float* keys;     // [kv_heads][padded][dim], zeros past the context
  float* values;   // the same
};

inline void widen_row(const float* src, float* dst, int64_t dim) { std::memcpy(dst, src, dim * sizeof(float)); }
inline void widen_row(const c10::BFloat16* src, float* dst, int64_t dim) {
  for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(dst + d, isoserve::load_bf16x16(src + d));
}

// Keys and values [first, first + count) of chunk c's KV head g, widened to float32 rows.
template <typename KV>
void lay_out(const KV* kc, const KV* vc, const Chunk& c, const Shape& s, int64_t g, int64_t first, int64_t count) {
  for (int64_t t = first; t < first + count; ++t) {
    float* k = c.keys + (g * c.padded + t) * s.dim;
    float* v = c.values + (g * c.padded + t) * s.dim;
    if (t < c.span.context) {
      const int64_t slot = ((g * s.num_pages + c.span.pages[t / s.page_size]) * s.page_size + t % s.page_size) * s.dim;
      widen_row(kc + slot, k, s.dim);
      widen_row(vc + slot, v, s.dim);
    } else {  // a zero probability times stale memory could still be NaN
      std::memset(k, 0, s.dim * sizeof(float));
      std::memset(v, 0, s.dim * sizeof(float));
    }
  }
}

struct Scratch {
  float* scores;                              // [keys][16 queries]: scores, then probabilities
  alignas(64) float queries[128 * kBlock];    // Q^T, scaled: [dim][16 queries]
};

// The scores of keys k0 .. k0 + kKeys - 1 against the block's queries, in the decode kernel's
// arithmetic: lane j of a 16-dim slice gathers dims j, 16 + j, ... in one multiply-add chain
// (a product first), then a tree adds lane j + 8 to j, j + 4, j + 2, j + 1 (cpu_ops.cpp's
// sum_each). Node<L>(j) is that tree's node at level L over lane j; Node<4>(0) the score.
template <int DC, int L>
struct Node {
  static inline void sum(const float* qt, const float* kr, int j, __m512* out) {
    __m512 a[kKeys], b[kKeys];
    Node<DC, L - 1>::sum(qt, kr, j, a);
    Node<DC, L - 1>::sum(qt, kr, j + (16 >> L), b);
    for (int k = 0; k < kKeys; ++k) out[k] = _mm512_add_ps(a[k], b[k]);
  }
};

template <int DC>
struct Node<DC, 0> {
  static inline void sum(const float* qt, const float* kr, int j, __m512* out) {
    constexpr int64_t D = DC * 16;
    const __m512 q0 = _mm512_load_ps(qt + j * kBlock);
    for (int k = 0; k < kKeys; ++k) out[k] = _mm512_mul_ps(q0, _mm512_set1_ps(kr[k * D + j]));
#pragma GCC unroll 8
    for (int c = 1; c < DC; ++c) {
      const __m512 qc = _mm512_load_ps(qt + (16 * c + j) * kBlock);
      for (int k = 0; k < kKeys; ++k) out[k] = _mm512_fmadd_ps(qc, _mm512_set1_ps(kr[k * D + 16 * c + j]), out[k]);
    }
  }
};

// Query block qb of head h of chunk c into its rows of out. DC: the head's 16-dim slices.
// Each query's output has the bits the decode kernel (cpu_ops.cpp's attend, float32) gives it
// as a single query over its first position + 1 keys: its scaled query, scores, maximum, exps,
// the sum of the exps (by key mod 16 over whole blocks of 16, the rest in turn, then a tree),
// and its values' sums in key order.
template <int DC>
void attend_block(const float* q, float* out, const Chunk& c, const Shape& s, int64_t h, int64_t qb, float scale,
                  Scratch& w) {
  constexpr int64_t D = DC * 16;
  const int64_t g = h / (s.heads / s.kv_heads);
  const int64_t row0 = qb * kBlock, valid = std::min(kBlock, c.span.rows - row0);
  const int64_t first = c.span.context - c.span.rows + row0;  // the block's first query's position
  const int64_t keys = round_up(first + valid, kKeys);     // what its last query sees, and padding
  // Query i (lanes past the chunk repeat its last query) sees keys [0, position_i].
  const __m512i position = _mm512_add_epi32(
      _mm512_set1_epi32(static_cast<int>(first)),
      _mm512_min_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                       _mm512_set1_epi32(static_cast<int>(valid - 1))));
  const __m512 factor = _mm512_set1_ps(scale);
  const float* block_q = q + (c.span.first_row + row0) * s.row_stride + h * D;
  for (int64_t slice = 0; slice < DC; ++slice) {
    __m512i m[16];
    for (int64_t i = 0; i < kBlock; ++i)
      m[i] = _mm512_loadu_si512(block_q + std::min(i, valid - 1) * s.row_stride + slice * 16);
    isoserve::transpose16(m);
    for (int d = 0; d < 16; ++d)
      _mm512_store_ps(w.queries + (slice * 16 + d) * kBlock, _mm512_mul_ps(_mm512_castsi512_ps(m[d]), factor));
  }

  float* scores = w.scores;
  const float* k_rows = c.keys + g * c.padded * D;
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 top = minus_inf;
  for (int64_t k0 = 0; k0 < keys; k0 += kKeys) {
    __m512 score[kKeys];
    Node<DC, 4>::sum(w.queries, k_rows + k0 * D, 0, score);
    for (int j = 0; j < kKeys; ++j) {
      const int64_t key = k0 + j;
      if (key > first)  // past some query's position: -inf there, so its maximum ignores the key
        score[j] = _mm512_mask_mov_ps(score[j], _mm512_cmplt_epi32_mask(position, _mm512_set1_epi32(static_cast<int>(key))),
                                      minus_inf);
      top = _mm512_max_ps(top, score[j]);
      _mm512_storeu_ps(scores + key * kBlock, score[j]);
    }
  }

  // The exps, and their sums as the decode kernel adds them for a query that sees len keys:
  // key k into lane k % 16 while k < len rounded down to 16, the rest into a running sum.
  const __m512i whole = _mm512_andnot_si512(_mm512_set1_epi32(15), _mm512_add_epi32(position, _mm512_set1_epi32(1)));
  __m512 lanes[16], rest = _mm512_setzero_ps();
  for (int j = 0; j < 16; ++j) lanes[j] = _mm512_setzero_ps();
  for (int64_t key = 0; key < keys; ++key) {
    __m512 p = isoserve::exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + key * kBlock), top));
    if (key > first)  // exactly 0 past a query's position (exp16 clamps -inf to exp(-87))
      p = _mm512_maskz_mov_ps(_mm512_cmpge_epi32_mask(position, _mm512_set1_epi32(static_cast<int>(key))), p);
    const __mmask16 in_lanes = _mm512_cmpgt_epi32_mask(whole, _mm512_set1_epi32(static_cast<int>(key)));
    lanes[key % 16] = _mm512_mask_add_ps(lanes[key % 16], in_lanes, lanes[key % 16], p);
    rest = _mm512_mask_add_ps(rest, static_cast<__mmask16>(~in_lanes), rest, p);
    _mm512_storeu_ps(scores + key * kBlock, p);
  }
  for (int width = 8; width >= 1; width /= 2)
    for (int j = 0; j < width; ++j) lanes[j] = _mm512_add_ps(lanes[j], lanes[j + width]);
  const __m512 sums = _mm512_add_ps(rest, lanes[0]);

  const float* v_rows = c.values + g * c.padded * D;
  float* rows = out + (c.span.first_row + row0) * s.row_stride + h * D;
  for (int64_t slice = 0; slice < DC; ++slice) {
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
    const float* vr = v_rows + slice * 16;
    int64_t key = 0;
    for (; key <= first; ++key, vr += D) {  // keys every query sees
      const __m512 p = _mm512_loadu_ps(scores + key * kBlock);
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(vr[j]), p, acc[j]);
    }
    for (; key < keys; ++key, vr += D) {  // the rest only where seen: a later value is not even multiplied by 0
      const __m512 p = _mm512_loadu_ps(scores + key * kBlock);
      const __mmask16 sees = _mm512_cmpge_epi32_mask(position, _mm512_set1_epi32(static_cast<int>(key)));
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) acc[j] = _mm512_mask3_fmadd_ps(_mm512_set1_ps(vr[j]), p, acc[j], sees);
    }
    // acc[j] holds dim 16 slice + j of the 16 queries: divided by each query's sum, then one
    // row per query.
    __m512i m[16];
    for (int j = 0; j < 16; ++j) m[j] = _mm512_castps_si512(_mm512_div_ps(acc[j], sums));
    isoserve::transpose16(m);
    for (int64_t i = 0; i < valid; ++i) _mm512_storeu_si512(rows + i * s.row_stride + slice * 16, m[i]);
  }
}

template <int DC, typename KV>
void attend_all(const float* q, const KV* kc, const KV* vc, float* out, const std::vector<Chunk>& chunks,
                const std::vector<isoserve::QueryBlock>& work, const Shape& s, float scale) {
  constexpr int64_t kLayoutKeys = 64;  // keys per layout job
  struct Layout { int64_t chunk, kv_head, first; };
  std::vector<Layout> layouts;
  int64_t widest = 0;
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci) {
    const Chunk& c = chunks[ci];
    for (int64_t g = 0; g < s.kv_heads; ++g)
      for (int64_t t = 0; t < c.padded; t += kLayoutKeys) layouts.push_back({ci, g, t});
    widest = std::max(widest, c.padded);
  }
  const int threads = std::max(1, at::get_num_threads());
  // Each thread's scores, allocated here: a failed allocation inside the parallel region would
  // end the process instead of raising.
  std::unique_ptr<float[]> scores(new float[threads * widest * kBlock]);
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(layouts.size()); ++i) {
      const Layout& l = layouts[i];
      const Chunk& c = chunks[l.chunk];
      lay_out(kc, vc, c, s, l.kv_head, l.first, std::min(kLayoutKeys, c.padded - l.first));
    }
    Scratch w{scores.get() + omp_get_thread_num() * widest * kBlock, {}};
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(work.size()); ++i)
      attend_block<DC>(q, out, chunks[work[i].chunk], s, work[i].head, work[i].block, scale, w);
  }
}

template <typename KV>
void attend_all_dims(const float* q, const KV* kc, const KV* vc, float* out, const std::vector<Chunk>& chunks,
                     const std::vector<isoserve::QueryBlock>& work, const Shape& s, float scale) {
  switch (s.dim) {
    case 32: return attend_all<2>(q, kc, vc, out, chunks, work, s, scale);
    case 64: return attend_all<4>(q, kc, vc, out, chunks, work, s, scale);
    case 128: return attend_all<8>(q, kc, vc, out, chunks, work, s, scale);
  }
}
#else
constexpr bool kBuilt = false;
#endif

}  // namespace

// "" when prefill_attention_f32 can run here (built with AVX-512), else why not.
std::string f32_prefill_status() {
  return kBuilt ? "" : "the kernels were built for a CPU without AVX-512";
}

// out[rows of each chunk] = causal attention of those rows of q over the chunk's first
// `context` keys (its queries are the last `rows` of them), in float32.
//   q, out: [T, heads, head_dim] float32; caches [kv_heads, pages, page_size, head_dim] float32
//   or bfloat16; chunks [C, 3] (first row, rows, context); pages [C, width] (page tables).
void prefill_attention_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& chunks, const at::Tensor& pages, at::Tensor& out,
                           double scale) {
  TORCH_CHECK(kBuilt, "prefill_attention_f32 needs AVX-512: ", f32_prefill_status());
  for (const at::Tensor* t : {&q, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "prefill_attention_f32 takes q and out as contiguous float32 CPU tensors");
  for (const at::Tensor* t : {&k_cache, &v_cache})
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->scalar_type() == k_cache.scalar_type() &&
                (t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16),
                "prefill_attention_f32 takes contiguous float32 or bfloat16 caches of one dtype");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(!out.is_alias_of(q), "out must not share memory with q");  // blocks write rows others read
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "caches must be [kv_heads, pages, page_size, head_dim]");
#if defined(__AVX512F__) && defined(__AVX512BW__)  // (without it, kBuilt refused above)
  const int64_t T = q.size(0);
  Shape s{q.size(1), k_cache.size(0), q.size(2), k_cache.size(1), k_cache.size(2), q.size(1) * q.size(2)};
  TORCH_CHECK(k_cache.size(3) == s.dim, "q and the caches disagree on head_dim");
  TORCH_CHECK(s.dim == 32 || s.dim == 64 || s.dim == 128,
              "prefill_attention_f32 takes head_dim 32, 64 or 128, not ", s.dim);
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "query heads must be a positive multiple of KV heads");
  const std::vector<isoserve::PrefillSpan> spans =
      isoserve::checked_prefill_spans(chunks, pages, T, s.page_size, s.num_pages, "prefill_attention_f32");
  std::vector<Chunk> list;
  int64_t scratch = 0;
  for (const isoserve::PrefillSpan& span : spans) {
    // Positions go in 32-bit lanes (attend_block).
    TORCH_CHECK(span.context < (int64_t{1} << 30), "chunk context of ", span.context, " keys is too long");
    list.push_back({span, round_up(span.context, kKeys), nullptr, nullptr});
    scratch += 2 * s.kv_heads * list.back().padded * s.dim;
  }
  if (list.empty()) return;
  // Every element is written before it is read (lay_out).
  std::unique_ptr<float[]> rows(new float[scratch]);
  float* next = rows.get();
  for (Chunk& c : list) {
    c.keys = next;
    c.values = next + s.kv_heads * c.padded * s.dim;
    next += 2 * s.kv_heads * c.padded * s.dim;
  }
  const float sc = static_cast<float>(scale);
  const std::vector<isoserve::QueryBlock> work = isoserve::query_blocks(spans, s.heads, kBlock);
  if (k_cache.scalar_type() == at::kFloat)
    attend_all_dims(q.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), out.data_ptr<float>(),
                    list, work, s, sc);
  else
    attend_all_dims(q.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                    out.data_ptr<float>(), list, work, s, sc);
#endif
}
