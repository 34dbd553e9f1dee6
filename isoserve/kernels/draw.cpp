// Tokens drawn from softmax(logits / temperature), one per row: the sampler's draw for rows with
// neither top-k nor top-p (engine/sampler.py), which is every request that leaves them unset,
// OpenAI's default temperature 1 included.
//
// The torch ops this replaces make about six passes over the [rows, vocabulary] block: the
// division by the temperature and the softmax each write a new block, and the inverse CDF sums
// it again by blocks. After a decode step has streamed the weights and the KV through the caches,
// the 32 x 49,152 logits of a batch-32 step took them ~2.2 ms (~1.3 with the block in cache).
// Here each row is read from memory once, into the core's L2, and then again from there:
//
//   pass 1: m = max of x / T (a NaN, or a maximum of +-inf, and the row is no distribution)
//   pass 2: w = exp(x / T - m), summed by blocks of kBlock in float64
//   the block where u * total falls, then its w again, one by one in float64, to the token
//
// The same draw as the sampler's torch path (a running sum of the weights, in two levels, and
// the first position whose sum exceeds u times the total), from weights that are not the same
// bits: exp16's polynomial against torch's, and w unnormalised where the softmax divides by
// its sum; and the blocks summed in float64, where the torch ops sum them in float32 (a
// float64 sum there cost ~0.6 ms more for 32 rows). A draw whose target falls within those
// roundings (~1e-7 of the total) of a boundary between two tokens can take the other one;
// tests/test_sampler.py counts how rarely. A weight below e^-87 (a
// probability under ~1e-38 of the row's largest) is 0 here, never drawn, as a -inf logit is.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16x16.h"

#if ISOSERVE_BF16X16

namespace {

constexpr int64_t kBlock = 256;  // engine/sampler.py's BLOCK
constexpr int64_t kLanes = 16;

// 16 logits from j on (fewer where the row ends: the rest come as -inf, weight 0), over T.
inline __m512 scaled16(const float* x, int64_t j, int64_t n, __m512 temperature) {
  const int64_t left = n - j;
  const __mmask16 valid = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
  const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, x + j);
  return _mm512_div_ps(v, temperature);
}

// The weights of 16 scaled logits below the row's maximum m: exp(s - m), 0 under e^-87, where
// exp16 would clamp to e^-87 instead (a -inf logit then stays a weight of 0).
inline __m512 weights16(__m512 s, __m512 m) {
  const __m512 d = _mm512_sub_ps(s, m);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), isoserve::exp16(d));
}

// One row's token, or -1 where the row is no distribution (a NaN, a +inf, or every logit -inf
// once scaled). ends: the thread's scratch, a float64 per block.
int64_t draw_row(const float* x, int64_t n, float temperature, double u, std::vector<double>& ends) {
  const __m512 t = _mm512_set1_ps(temperature);
  __m512 top = _mm512_set1_ps(-INFINITY);
  __mmask16 nan = 0;
  for (int64_t j = 0; j < n; j += kLanes) {
    const __m512 s = scaled16(x, j, n, t);
    nan |= _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q);
    top = _mm512_max_ps(top, s);
  }
  const float m = _mm512_reduce_max_ps(top);
  if (nan || std::isinf(m)) return -1;
  const __m512 mv = _mm512_set1_ps(m);

  const int64_t blocks = (n + kBlock - 1) / kBlock;
  ends.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    // In float64: a block's sum then differs from the running sum of its tokens below (the same
    // float32 weights in another order) by ~1e-16 of the total, not by float32's ~1e-7, which
    // moved about one draw in 10^4 to a neighbouring token.
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    for (int64_t j = b * kBlock; j < std::min(n, (b + 1) * kBlock); j += kLanes) {
      const __m512 w = weights16(scaled16(x, j, n, t), mv);
      low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(w)));
      high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1))));
    }
    total += _mm512_reduce_add_pd(_mm512_add_pd(low, high));
    ends[b] = total;  // the mass up to this block's end
  }
  // total >= 1 (the maximum's own weight is exp(0)), and u < 1 keeps u * total below it in
  // float64, so some block's end is past the target: the first such block has weight.
  const double target = u * total;
  int64_t block = 0;
  while (block < blocks && !(ends[block] > target)) ++block;
  if (block == blocks) return -1;  // cannot happen (above); refused rather than guessed
  const int64_t first = block * kBlock, last = std::min(n, first + kBlock);
  alignas(64) float w[kBlock];
  for (int64_t j = first; j < last; j += kLanes) _mm512_store_ps(w + (j - first), weights16(scaled16(x, j, n, t), mv));
  double running = block > 0 ? ends[block - 1] : 0.0;
  int64_t chosen = -1;
  for (int64_t j = first; j < last; ++j) {
    if (w[j - first] > 0.0f) chosen = j;  // the last of positive weight so far
    running += static_cast<double>(w[j - first]);
    if (running > target) return j;  // a weight of 0 never gets here first
  }
  // The block's sum (8 lanes, then across them) and this running sum rounded apart, by ~1e-16:
  // the block's last token of positive weight.
  return chosen;
}

}  // namespace

torch::Tensor temperature_draw(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu() && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.dim() == 2 && logits.size(1) > 0,
              "temperature_draw takes logits as a contiguous float32 CPU tensor [rows, vocabulary > 0]");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(temperature.device().is_cpu() && temperature.scalar_type() == at::kFloat &&
                  temperature.is_contiguous() && temperature.dim() == 1 && temperature.size(0) == rows,
              "temperature_draw takes temperature as a contiguous float32 CPU tensor [rows]");
  TORCH_CHECK(u.device().is_cpu() && u.scalar_type() == at::kDouble && u.is_contiguous() && u.dim() == 1 &&
                  u.size(0) == rows,
              "temperature_draw takes u as a contiguous float64 CPU tensor [rows]");
  const float* t = temperature.data_ptr<float>();
  const double* uniform = u.data_ptr<double>();
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(t[r] > 0.0f && std::isfinite(t[r]), "temperature_draw: row ", r, "'s temperature is not positive and finite");
    TORCH_CHECK(uniform[r] >= 0.0 && uniform[r] < 1.0, "temperature_draw: row ", r, "'s u is not in [0, 1)");
  }
  auto tokens = torch::empty({rows}, torch::kLong);
  const float* x = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> ends;
    for (int64_t r = begin; r < end; ++r) out[r] = draw_row(x + r * n, n, t[r], uniform[r], ends);
  });
  return tokens;
}

#else

torch::Tensor temperature_draw(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "temperature_draw needs AVX-512 (has_temperature_draw is False here)");
  return {};
}

#endif
