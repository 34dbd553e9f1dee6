// Top-p nuclei: engine/nucleus.py's nucleus_weights, a row at a time, for the CPU sampler.
//
// The same keys (a probability's float32 bits >> 20), the same float64 sums (each key's mass,
// exact, so in any order; then the keys from the highest down, then the edge key's
// tokens by descending probability, equal ones in position order), so the same bits as the
// torch reference (tests/test_nucleus.py checks it). torch's version makes a dozen passes over
// the [rows, vocabulary] block, most of them writing a new block; this one reads each row twice
// and writes it once: [32, 49,152] took 9-15 ms in torch ops (~5 ms where fresh allocations
// do not fault their pages in), 1.8-2.1 ms here (two threads) with both passes scalar, and
// 1.0-1.1 ms with the second pass in vectors (docs/benchmarks.md, session 37).
//
// Why the first pass may add a key's masses in any order: a key is the 8 exponent bits and the
// top 3 of the mantissa (the sign is masked off), so every float32 of one key is +-m u for one
// unit u and a whole m below 2^24 (u = 2^(e - 23) for exponent e; 2^-149 for the subnormals of
// keys 0-7, as for the smallest normals). Any partial sum of n of them is a whole multiple of u
// below n 2^24 u in magnitude, which float64's 53 bits hold exactly for n up to 2^29 (longer
// rows are refused). Every partial sum is exact, so any order gives the same bits. (Keys 2040
// and up hold +-inf and NaN: a row with one has a total that is not finite in any order, and
// keeps nothing.)
#include "tensors.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

namespace {

constexpr int kKeyShift = 20;                   // nucleus.py's KEY_SHIFT
constexpr int kKeys = 1 << (31 - kKeyShift);    // its KEYS

inline int key_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return static_cast<int>((bits >> kKeyShift) & (kKeys - 1));  // -0.0 is key 0, as +0.0 is
}

// A thread's scratch, reused row after row.
struct Scratch {
  std::vector<double> mass = std::vector<double>(2 * kKeys);  // two tables of each key's mass
  std::vector<double> from_top = std::vector<double>(kKeys);
  std::vector<std::pair<float, int64_t>> edge_tokens;
};

// Each key's mass, from_top[kKeys - 1 - key]. Even and odd positions go to two tables and meet
// at the end (the order does not matter, above): a run of one key then makes two chains of
// additions through memory, not one. 25 against 33 us for a row of 49,152 on a Zen 4.
void key_masses(const float* p, int64_t n, double* from_top, Scratch& scratch) {
  double* even = scratch.mass.data();
  double* odd = even + kKeys;
  std::fill(even, even + 2 * kKeys, 0.0);
  int64_t j = 0;
  for (; j + 2 <= n; j += 2) {
    even[key_of(p[j])] += static_cast<double>(p[j]);
    odd[key_of(p[j + 1])] += static_cast<double>(p[j + 1]);
  }
  if (j < n) even[key_of(p[j])] += static_cast<double>(p[j]);
  for (int k = 0; k < kKeys; ++k) from_top[kKeys - 1 - k] = even[k] + odd[k];
}

// out[j] = p[j] where p[j]'s key is above the edge, else 0; the positions of the edge's tokens,
// in order, into edge_tokens. In vectors, 16 at a time with AVX-512 and 8 with AVX2: the edge
// holds a few dozen of a row's tokens, so a vector that holds none (nearly all) costs a compare
// and a masked move (5 against 40 us a row on a Zen 4). Keys are at most kKeys - 1, so the
// signed compares see them as they are.
void keep_above(const float* p, int64_t n, int edge, float* out, std::vector<std::pair<float, int64_t>>& edge_tokens) {
  edge_tokens.clear();
  int64_t j = 0;
#ifdef __AVX512F__
  const __m512i mask = _mm512_set1_epi32(kKeys - 1), at_edge = _mm512_set1_epi32(edge);
  for (; j + 16 <= n; j += 16) {
    const __m512 v = _mm512_loadu_ps(p + j);
    const __m512i keys = _mm512_and_si512(_mm512_srli_epi32(_mm512_castps_si512(v), kKeyShift), mask);
    _mm512_storeu_ps(out + j, _mm512_maskz_mov_ps(_mm512_cmpgt_epi32_mask(keys, at_edge), v));
    for (__mmask16 hits = _mm512_cmpeq_epi32_mask(keys, at_edge); hits; hits &= hits - 1) {
      const int64_t at = j + __builtin_ctz(hits);
      edge_tokens.emplace_back(p[at], at);
    }
  }
#elif defined(__AVX2__)
  const __m256i mask = _mm256_set1_epi32(kKeys - 1), at_edge = _mm256_set1_epi32(edge);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_loadu_ps(p + j);
    const __m256i keys = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(v), kKeyShift), mask);
    _mm256_storeu_ps(out + j, _mm256_and_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(keys, at_edge)), v));
    for (unsigned hits = static_cast<unsigned>(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(keys, at_edge))));
         hits; hits &= hits - 1) {
      const int64_t at = j + __builtin_ctz(hits);
      edge_tokens.emplace_back(p[at], at);
    }
  }
#endif
  for (; j < n; ++j) {
    const int k = key_of(p[j]);
    out[j] = k > edge ? p[j] : 0.0f;
    if (k == edge) edge_tokens.emplace_back(p[j], j);
  }
}

// One row: out[j] = p[j] inside the nucleus, 0 outside.
void nucleus_row(const float* p, int64_t n, double top_p, float* out, Scratch& scratch) {
  std::vector<double>& from_top = scratch.from_top;
  std::vector<std::pair<float, int64_t>>& edge_tokens = scratch.edge_tokens;
  key_masses(p, n, from_top.data(), scratch);
  for (int k = 1; k < kKeys; ++k) from_top[k] += from_top[k - 1];  // the highest keys down to k
  const double total = from_top[kKeys - 1];
  if (!(std::isfinite(total) && total > 0)) {  // no distribution: nothing kept
    std::fill(out, out + n, 0.0f);
    return;
  }
  // The first key from the top where the mass reaches top_p; kKeys where it never does, which
  // puts the edge below every key (nucleus.py says why).
  const int reach = static_cast<int>(std::lower_bound(from_top.begin(), from_top.end(), top_p) - from_top.begin());
  const double above = reach > 0 ? from_top[reach - 1] : 0.0;
  const int edge = kKeys - 1 - reach;
  keep_above(p, n, edge, out, edge_tokens);
  std::stable_sort(edge_tokens.begin(), edge_tokens.end(),
                   [](const auto& a, const auto& b) { return a.first > b.first; });
  double before = 0.0;  // the edge's tokens ahead of this one
  for (const auto& [v, j] : edge_tokens) {
    if (!(above + before < top_p)) break;  // the mass before a token only grows from here
    out[j] = v;
    before += static_cast<double>(v);
  }
}

}  // namespace

at::Tensor nucleus_rows(const at::Tensor& probs, const at::Tensor& top_p) {
  TORCH_CHECK(probs.device().is_cpu() && probs.scalar_type() == at::kFloat && probs.is_contiguous() && probs.dim() == 2,
              "nucleus_rows takes probs as a contiguous float32 CPU tensor [rows, vocabulary]");
  TORCH_CHECK(top_p.device().is_cpu() && top_p.scalar_type() == at::kFloat && top_p.is_contiguous() &&
                  top_p.dim() == 1 && top_p.size(0) == probs.size(0),
              "nucleus_rows takes top_p as a contiguous float32 CPU tensor [rows]");
  const int64_t rows = probs.size(0), n = probs.size(1);
  TORCH_CHECK(n <= (int64_t{1} << 29), "nucleus_rows: rows of at most 2^29 probabilities (their key masses are "
              "then exact), not ", n);
  const float* tp = top_p.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r) TORCH_CHECK(!std::isnan(tp[r]), "nucleus_rows: top_p of row ", r, " is NaN");
  auto out = at::empty_like(probs);  // every element written
  const float* p = probs.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Scratch scratch;
    for (int64_t r = begin; r < end; ++r) {
      // nucleus.py's floor: a top_p rounded to 0 keeps the most likely token.
      const double at_least = std::max(static_cast<double>(tp[r]), std::numeric_limits<double>::min());
      nucleus_row(p + r * n, n, at_least, o + r * n, scratch);
    }
  });
  return out;
}
