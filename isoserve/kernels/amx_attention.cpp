// Causal attention of a step's prefill chunks over their pages, on AMX, in one call.
//
// Why: torch's scaled_dot_product_attention, one chunk at a time, took ~240 us per 100-token
// chunk and layer (its flash kernel ~130 us, the rest gathering pages and copying rows): 23% of
// a 32-prompt wave's prefill. Here every 16-query block of every head of every chunk is one
// work item, taken by whichever thread frees up first. Engine A/B, the same engine alternating
// the two: a wave of 32 x 100-token prompts 971 -> 752 ms, one 2,000-token prompt 1,023 ->
// 882 ms (docs/benchmarks.md).
//
// The block is computed transposed, keys x queries, so nothing on the hot path is reshuffled:
//   scores^T = K Q^T: K is the A tile (16 keys x 32 dims) as it lies in its page; Q^T, the B
//     tile (pairs of dims x 16 queries), is laid out once per block.
//   softmax: lane i of every vector is query i, so the maxima, the exps and the sums are plain
//     vector operations, with no reduction across lanes.
//   out^T = V^T P^T: P^T (pairs of keys x 16 queries) is the B tile the softmax writes; V^T
//     (16 dims x 32 keys) is laid out once per chunk and KV head, for all its query blocks.
//
// Exactness: scores are exact bfloat16 products summed in float32 (the tile unit); the softmax
// is float32 with the maximum subtracted; the probabilities are rounded to bfloat16 for the
// value product, as flash attention does on GPUs, and the output is divided by the sum of the
// rounded probabilities, so the weights still sum to one. tests/test_prefill_attention.py holds
// it to a float64 definition, within twice the error torch's own bfloat16 path makes (in
// practice about the same), and to the same bits for any split of a prompt into chunks.
//
// Memory safety and isolation: every chunk's rows, context and page ids are checked against q
// and the pool before anything is read, and no load reaches past a chunk's context: the
// 16-key block holding its last key is copied with zeros after it, and its values are laid out
// with zeros past the context (a zero probability times stale memory could still be NaN). Which
// pages a chunk may read at all is the read guard's decision (kv/guard.py), made before the step.
#include "tensors.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "amx.h"
#include "bf16x16.h"
#include "prefill_chunks.h"

namespace {

constexpr int64_t kBlock = 16;       // queries per tile, keys per score tile
constexpr int64_t kLine = 64;        // bytes per tile line
constexpr int64_t kTileElems = 512;  // bfloat16 elements in a 16 x 64-byte tile
constexpr int64_t kMaxDim = 64;      // four 16-dim output tiles

struct Shape {
  int64_t heads, kv_heads, dim, num_pages, page_size, row_stride;
};

struct Chunk {
  int64_t first_row, rows, context;
  const int64_t* pages;
  int64_t key_blocks32;  // 32-key blocks its values are laid out in
  uint16_t* values;      // per KV head, per 32-key block, per 16-dim slice: an A tile (dims x keys)
  uint16_t* last_keys;   // per KV head: the 16-key block holding the last key, zero past it
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Where key `key` of a chunk lies in a cache, for one KV head.
inline const uint16_t* pool_row(const uint16_t* cache, const Chunk& c, const Shape& s, int64_t head, int64_t key) {
  const int64_t page = c.pages[key / s.page_size];
  return cache + ((head * s.num_pages + page) * s.page_size + key % s.page_size) * s.dim;
}

// Values of keys [32 kb, 32 kb + 32) of chunk c, KV head g, transposed to dims x keys (zeros
// past the context: a zero probability times stale memory could still be NaN).
void lay_out_values(const uint16_t* vc, const Chunk& c, const Shape& s, int64_t g, int64_t kb) {
  const int64_t D = s.dim;
  uint16_t* tiles = c.values + (g * c.key_blocks32 + kb) * 32 * D;
  for (int64_t j = 0; j < 32; ++j) {
    const int64_t key = kb * 32 + j;
    if (key < c.context) {
      const uint16_t* v = pool_row(vc, c, s, g, key);
      for (int64_t d = 0; d < D; ++d) tiles[(d / 16) * kTileElems + (d % 16) * 32 + j] = v[d];
    } else {
      for (int64_t d = 0; d < D; ++d) tiles[(d / 16) * kTileElems + (d % 16) * 32 + j] = 0;
    }
  }
}

// The 16-key block that holds a chunk's last key, copied with zeros past it, so no tile load
// reaches past the context into the page's unwritten slots.
void lay_out_last_keys(const uint16_t* kc, const Chunk& c, const Shape& s, int64_t g) {
  uint16_t* block = c.last_keys + g * kBlock * s.dim;
  const int64_t first = (c.context - 1) / kBlock * kBlock;
  for (int64_t j = 0; j < kBlock; ++j) {
    if (first + j < c.context) std::memcpy(block + j * s.dim, pool_row(kc, c, s, g, first + j), s.dim * 2);
    else std::memset(block + j * s.dim, 0, s.dim * 2);
  }
}

// Tiles, all 16 lines of 64 bytes. Scores: 6-7 the query block's two 32-dim slices (B: pairs
// of dims x 16 queries), 2-5 keys (A: 16 keys x 32 dims, straight from a page), 0-1 score
// accumulators (16 keys x 16 queries). Then the values: 0-3 output accumulators (four 16-dim
// slices x 16 queries), 4-5 probabilities (B: pairs of keys x 16 queries), 6-7 values (A: 16
// dims x 32 keys).
ISOSERVE_AMX void configure_attention_tiles() {
  isoserve::TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = kBlock;
    cfg.bytes_per_row[t] = kLine;
  }
  isoserve::load_tile_config(cfg);
}

struct Scratch {
  std::vector<float> scores;    // [keys, 16 queries]: the scores transposed, a key per line
  std::vector<uint16_t> probs;  // a B tile per 32 keys: pairs of keys x 16 queries
  alignas(64) uint32_t queries[kTileElems];  // the query block as B tiles, one per 32 dims
  alignas(64) float out[kMaxDim * kBlock];   // [dims, 16 queries]
};

// The block's queries as B tiles: word (line r, lane i) of slice t is query i's dims
// 32 t + 2 r and 32 t + 2 r + 1 (a 16 x 16 transpose of words per slice); queries past the
// chunk are zeros.
ISOSERVE_AMX void lay_out_queries(const uint16_t* q, int64_t stride, int64_t valid, int64_t D, uint32_t* tiles) {
  for (int64_t slice = 0; slice < D / 32; ++slice) {
    __m512i m[16];
    for (int64_t i = 0; i < kBlock; ++i)
      m[i] = i < valid ? _mm512_loadu_si512(q + i * stride + slice * 32) : _mm512_setzero_si512();
    isoserve::transpose16(m);
    for (int r = 0; r < 16; ++r) _mm512_store_si512(tiles + slice * 256 + r * 16, m[r]);
  }
}

// Where the 16 keys of block kb lie: in their page, or (the block holding the last key) in the
// zero-padded copy.
inline const uint16_t* key_block(const Chunk& c, const Shape& s, const uint16_t* kc, int64_t g, int64_t kb,
                                 int64_t last_block) {
  if (kb > last_block) return nullptr;
  return kb == last_block ? c.last_keys + g * kBlock * s.dim : pool_row(kc, c, s, g, kb * kBlock);
}

// Scores of key blocks k0 and (if `second`) k1 against the query tiles 6-7, stored transposed.
template <int kSlices>
ISOSERVE_AMX void score_pair(const uint16_t* k0, const uint16_t* k1, int64_t D, float* scores, bool second) {
  _tile_zero(0);
  _tile_loadd(2, k0, D * 2);
  _tile_dpbf16ps(0, 2, 6);
  if (second) {
    _tile_zero(1);
    _tile_loadd(4, k1, D * 2);
    _tile_dpbf16ps(1, 4, 6);
  }
  if constexpr (kSlices > 1) {
    _tile_loadd(3, k0 + 32, D * 2);
    _tile_dpbf16ps(0, 3, 7);
    if (second) {
      _tile_loadd(5, k1 + 32, D * 2);
      _tile_dpbf16ps(1, 5, 7);
    }
  }
  _tile_stored(0, scores, kLine);
  if (second) _tile_stored(1, scores + kBlock * kBlock, kLine);
}

// Row k of the transposed scores holds key k against the block's 16 queries; query i sees keys
// up to its position, first + i. Returns each query's maximum over the keys it sees.
template <int kSlices>
ISOSERVE_AMX __m512 score(const Chunk& c, const Shape& s, const uint16_t* kc, int64_t g, int64_t key_blocks,
                          int64_t first, float* scores) {
  const int64_t D = s.dim, last_block = (c.context - 1) / kBlock;
  __m512 top = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i position = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  // Two key blocks at a time, each into its own tiles: tile registers are not renamed, so a
  // load into a tile waits for the multiply still reading it.
  for (int64_t kb = 0; kb < key_blocks; kb += 2) {
    score_pair<kSlices>(key_block(c, s, kc, g, kb, last_block), key_block(c, s, kc, g, kb + 1, last_block), D,
                        scores + kb * kBlock * kBlock, kb + 1 < key_blocks);
  }
  // The maxima once every tile is stored: a vector load right after the tile store that wrote
  // it waits for that store to land.
  const int64_t all_see = std::min(first + 1, key_blocks * kBlock);  // keys every query sees
  __m512 tops[4] = {top, top, top, top};  // four chains: a max waits 4 cycles for the last
  int64_t k = 0;
  for (; k + 4 <= all_see; k += 4)
    for (int u = 0; u < 4; ++u) tops[u] = _mm512_max_ps(tops[u], _mm512_loadu_ps(scores + (k + u) * kBlock));
  for (; k < all_see; ++k) tops[0] = _mm512_max_ps(tops[0], _mm512_loadu_ps(scores + k * kBlock));
  top = _mm512_max_ps(_mm512_max_ps(tops[0], tops[1]), _mm512_max_ps(tops[2], tops[3]));
  for (k = all_see; k < key_blocks * kBlock; ++k) {
    const __mmask16 sees = _mm512_cmpge_epi32_mask(position, _mm512_set1_epi32(static_cast<int>(k)));
    top = _mm512_mask_max_ps(top, sees, top, _mm512_loadu_ps(scores + k * kBlock));
  }
  return top;
}

// exp(x) on 16 floats, for the softmax's x <= 0: x = n ln 2 + r with n = round(x / ln 2) and
// ln 2 in two parts, so r (|r| <= ln 2 / 2) is exact; a degree-6 Taylor polynomial for e^r
// (relative error < 2e-7, well inside the bfloat16 rounding that follows); vscalefps for 2^n,
// which also takes the far negative x to 0. Fewer instructions than cpu_ops.cpp's fast_exp, which
// guards inputs this kernel cannot produce (NaN aside, and a NaN score gives a NaN row either way).
ISOSERVE_AMX inline __m512 exp_of_nonpositive(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  return _mm512_scalef_ps(isoserve::exp_taylor_tail(_mm512_set1_ps(1.0f / 720), r), n);
}

// Probabilities of keys [32 kb, 32 kb + 32) as a B tile (pairs of keys x 16 queries), rounded
// to bfloat16; adds them to `sums`.
ISOSERVE_AMX void probabilities(const float* scores, int64_t kb, __m512 top, float scale, int64_t first,
                                uint16_t* tile, __m512& sums) {
  const float* rows = scores + kb * 32 * kBlock;
  const __m512 factor = _mm512_set1_ps(scale), shift = _mm512_mul_ps(top, factor);
  const __m512i position = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                                            _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0));
  // Lanes 2i and 2i + 1 of a line: query i's probabilities for keys 2r and 2r + 1.
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t r = 0; r < kBlock; ++r) {
    const int key = static_cast<int>(kb * 32 + 2 * r);
    // exp((score - max) * scale), zero for a key past the query's position.
    const __m512 even = _mm512_maskz_mov_ps(
        _mm512_cmpge_epi32_mask(position, _mm512_set1_epi32(key)),
        exp_of_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(rows + 2 * r * kBlock), factor, shift)));
    const __m512 odd = _mm512_maskz_mov_ps(
        _mm512_cmpge_epi32_mask(position, _mm512_set1_epi32(key + 1)),
        exp_of_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(rows + (2 * r + 1) * kBlock), factor, shift)));
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(odd, even));  // even in the low half
    sums = _mm512_add_ps(sums, _mm512_add_ps(_mm512_cvtpbh_ps(reinterpret_cast<__m256bh>(_mm512_castsi512_si256(both))),
                                             _mm512_cvtpbh_ps(reinterpret_cast<__m256bh>(_mm512_extracti64x4_epi64(both, 1)))));
    _mm512_storeu_si512(tile + r * 32, _mm512_permutexvar_epi16(pairs, both));
  }
}

// Adds one 32-key block's probabilities (into tile P) times its values to the output tiles 0-3.
// A macro, not a template: gcc's tile intrinsics paste their tile number into the assembly.
#define ISOSERVE_WEIGH(P, probs, v, slices)             \
  do {                                                  \
    _tile_loadd(P, (probs), kLine);                     \
    _tile_loadd(6, (v), kLine);                         \
    _tile_dpbf16ps(0, 6, P);                            \
    _tile_loadd(7, (v) + kTileElems, kLine);            \
    _tile_dpbf16ps(1, 7, P);                            \
    if ((slices) > 1) {                                 \
      _tile_loadd(6, (v) + 2 * kTileElems, kLine);      \
      _tile_dpbf16ps(2, 6, P);                          \
      _tile_loadd(7, (v) + 3 * kTileElems, kLine);      \
      _tile_dpbf16ps(3, 7, P);                          \
    }                                                   \
  } while (0)

// Query block qb of head h of chunk c: its rows of `out`.
template <int kSlices>
ISOSERVE_AMX void attend_block(const uint16_t* q, const uint16_t* kc, uint16_t* out, const Chunk& c,
                               const Shape& s, int64_t h, int64_t qb, float scale, Scratch& w) {
  const int64_t D = s.dim, g = h / (s.heads / s.kv_heads);
  const int64_t row0 = qb * kBlock, valid = std::min(kBlock, c.rows - row0);
  const int64_t first = c.context - c.rows + row0;  // the block's first query's position
  const int64_t keys = first + valid;                // what its last query sees
  const int64_t key_blocks32 = ceil_div(keys, 32);
  const uint16_t* block_q = q + (c.first_row + row0) * s.row_stride + h * D;
  lay_out_queries(block_q, s.row_stride, valid, D, w.queries);
  _tile_loadd(6, w.queries, kLine);
  if constexpr (kSlices > 1) _tile_loadd(7, w.queries + kTileElems / 2, kLine);
  // Scores for whole 16-key blocks up to the last one seen. The values' 32-key blocks may add
  // one more: its scores are whatever the buffer held, but every query's mask zeroes its
  // probabilities (and its values are zeros).
  const __m512 top = score<kSlices>(c, s, kc, g, ceil_div(keys, kBlock), first, w.scores.data());
  __m512 sums = _mm512_setzero_ps();
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  const uint16_t* values = c.values + g * c.key_blocks32 * 32 * D;
  // Every probability first, then the tile multiplies back to back (interleaving the two, one
  // block apart, measured no faster), probabilities into tiles 4 and 5 in turn.
  for (int64_t kb = 0; kb < key_blocks32; ++kb)
    probabilities(w.scores.data(), kb, top, scale, first, w.probs.data() + kb * kTileElems, sums);
  for (int64_t kb = 0; kb + 1 < key_blocks32; kb += 2) {
    ISOSERVE_WEIGH(4, w.probs.data() + kb * kTileElems, values + kb * 32 * D, kSlices);
    ISOSERVE_WEIGH(5, w.probs.data() + (kb + 1) * kTileElems, values + (kb + 1) * 32 * D, kSlices);
  }
  if (key_blocks32 & 1)
    ISOSERVE_WEIGH(4, w.probs.data() + (key_blocks32 - 1) * kTileElems, values + (key_blocks32 - 1) * 32 * D, kSlices);
  _tile_stored(0, w.out, kLine);
  _tile_stored(1, w.out + 16 * kBlock, kLine);
  if constexpr (kSlices > 1) {
    _tile_stored(2, w.out + 32 * kBlock, kLine);
    _tile_stored(3, w.out + 48 * kBlock, kLine);
  }
  // The output tiles hold dims x queries: transposed back 16 dims at a time, each query's row
  // divided by its sum and rounded.
  alignas(64) float inverse[kBlock];
  _mm512_store_ps(inverse, _mm512_div_ps(_mm512_set1_ps(1.0f), sums));
  uint16_t* rows = out + (c.first_row + row0) * s.row_stride + h * D;
  for (int64_t slice = 0; slice < D / 16; ++slice) {
    __m512i m[16];
    for (int i = 0; i < 16; ++i) m[i] = _mm512_load_si512(w.out + (slice * 16 + i) * kBlock);
    isoserve::transpose16(m);
    for (int64_t i = 0; i < valid; ++i) {
      const __m512 row = _mm512_mul_ps(_mm512_castsi512_ps(m[i]), _mm512_set1_ps(inverse[i]));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + i * s.row_stride + slice * 16),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(row)));
    }
  }
}

// One thread's share of the query blocks, taken as it frees up (the caller's parallel region).
template <int kSlices>
ISOSERVE_AMX void attend_share(const uint16_t* q, const uint16_t* kc, uint16_t* out, const std::vector<Chunk>& chunks,
                               const std::vector<isoserve::QueryBlock>& work, const Shape& s, float scale,
                               int64_t widest) {
  Scratch w;
  w.scores.resize(widest * kBlock);
  w.probs.resize(widest * kBlock);
  configure_attention_tiles();
#pragma omp for schedule(dynamic, 1)
  for (int64_t i = 0; i < static_cast<int64_t>(work.size()); ++i)
    attend_block<kSlices>(q, kc, out, chunks[work[i].chunk], s, work[i].head, work[i].block, scale, w);
  _tile_release();  // a thread holding tile state costs every context switch
}

template <int kSlices>
void attend_all(const uint16_t* kc, const uint16_t* vc, const uint16_t* q, uint16_t* out,
                const std::vector<Chunk>& chunks, const std::vector<isoserve::QueryBlock>& work, const Shape& s,
                float scale) {
  struct Layout { int64_t chunk, kv_head, block; };
  std::vector<Layout> layouts;
  int64_t widest = 32;
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci) {
    const Chunk& c = chunks[ci];
    for (int64_t g = 0; g < s.kv_heads; ++g)
      for (int64_t kb = 0; kb <= c.key_blocks32; ++kb) layouts.push_back({ci, g, kb});  // kb == blocks: last keys
    widest = std::max(widest, c.key_blocks32 * 32);
  }
  const int threads = std::max(1, at::get_num_threads());
#pragma omp parallel num_threads(threads)
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(layouts.size()); ++i) {
      const Layout& l = layouts[i];
      const Chunk& c = chunks[l.chunk];
      if (l.block < c.key_blocks32) lay_out_values(vc, c, s, l.kv_head, l.block);
      else lay_out_last_keys(kc, c, s, l.kv_head);
    }
    attend_share<kSlices>(q, kc, out, chunks, work, s, scale, widest);
  }
}

}  // namespace

// out[rows of each chunk] = causal attention of those rows of q over the chunk's first
// `context` keys (its queries are the last `rows` of them).
//   q, out: [T, heads, head_dim] bfloat16; caches [kv_heads, pages, page_size, head_dim];
//   chunks [C, 3] (first row, rows, context); pages [C, width] (each chunk's page table).
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& chunks, const at::Tensor& pages, at::Tensor& out,
                       double scale) {
  TORCH_CHECK(amx_status().empty(), "prefill_attention needs AMX: ", amx_status());
  for (const at::Tensor* t : {&q, &k_cache, &v_cache, static_cast<const at::Tensor*>(&out)})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kBFloat16 && t->is_contiguous(),
                "prefill_attention takes contiguous bfloat16 CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [tokens, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "caches must be [kv_heads, pages, page_size, head_dim]");
  const int64_t T = q.size(0);
  Shape s{q.size(1), k_cache.size(0), q.size(2), k_cache.size(1), k_cache.size(2), q.size(1) * q.size(2)};
  TORCH_CHECK(k_cache.size(3) == s.dim, "q and the caches disagree on head_dim");
  TORCH_CHECK(s.dim == 32 || s.dim == 64, "prefill_attention takes head_dim 32 or 64, not ", s.dim);
  TORCH_CHECK(s.page_size % kBlock == 0, "prefill_attention takes pages of a multiple of 16 keys, not ", s.page_size);
  TORCH_CHECK(s.kv_heads > 0 && s.heads % s.kv_heads == 0, "query heads must be a positive multiple of KV heads");
  const std::vector<isoserve::PrefillSpan> spans =
      isoserve::checked_prefill_spans(chunks, pages, T, s.page_size, s.num_pages, "prefill_attention");
  std::vector<Chunk> list;
  int64_t scratch = 0;
  for (const isoserve::PrefillSpan& span : spans) {
    const int64_t blocks = ceil_div(span.context, 32);
    list.push_back({span.first_row, span.rows, span.context, span.pages, blocks, nullptr, nullptr});
    scratch += s.kv_heads * (blocks * 32 + kBlock) * s.dim;
  }
  if (list.empty()) return;
  // Every element is written before it is read (lay_out_values, lay_out_last_keys).
  std::unique_ptr<uint16_t[]> tiles(new uint16_t[scratch]);
  uint16_t* next = tiles.get();
  for (Chunk& c : list) {
    c.values = next;
    c.last_keys = next + s.kv_heads * c.key_blocks32 * 32 * s.dim;
    next += s.kv_heads * (c.key_blocks32 * 32 + kBlock) * s.dim;
  }
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<at::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<at::BFloat16>());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float sc = static_cast<float>(scale);
  const std::vector<isoserve::QueryBlock> work = isoserve::query_blocks(spans, s.heads, kBlock);
  if (s.dim == 32) attend_all<1>(kc, vc, qp, op, list, work, s, sc);
  else attend_all<2>(kc, vc, qp, op, list, work, s, sc);
}
