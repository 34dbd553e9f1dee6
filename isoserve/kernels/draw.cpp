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
// bits: exp16's (exp8's) polynomial against torch's, and w unnormalised where the softmax divides by
// its sum; and the blocks summed in float64, where the torch ops sum them in float32 (a
// float64 sum there cost ~0.6 ms more for 32 rows). A draw whose target falls within those
// roundings (~1e-7 of the total) of a boundary between two tokens can take the other one;
// tests/test_sampler.py counts how rarely. A weight below e^-87 (a
// probability under ~1e-38 of the row's largest) is 0 here, never drawn, as a -inf logit is.
//
// Written once over a vector's lanes (the Lanes structs below): 16 with AVX-512, 8 with AVX2
// and FMA (an AMD Zen 3, where isoserve runs float32 and the torch ops took ~2.2 ms of a
// ~45 ms batch-32 step). Only the widths differ: the same passes, the same float64 blocks, so
// the same draw up to the roundings above.
#include "tensors.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16x16.h"
#include "f32x8.h"

#if ISOSERVE_BF16X16 || ISOSERVE_AVX2_FMA

namespace {

constexpr int64_t kBlock = 256;  // engine/sampler.py's BLOCK

#if ISOSERVE_BF16X16
// 16 lanes: masked loads, compares into mask registers.
struct Lanes16 {
  using F = __m512;
  using D = __m512d;
  static constexpr int64_t kLanes = 16;
  // kLanes logits from j on (fewer where the row ends: the rest come as -inf, weight 0), over T.
  static F scaled(const float* x, int64_t j, int64_t n, F temperature) {
    const int64_t left = n - j;
    const __mmask16 valid = left >= kLanes ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    return _mm512_div_ps(_mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), valid, x + j), temperature);
  }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static bool any_nan(F s) { return _mm512_cmp_ps_mask(s, s, _CMP_UNORD_Q) != 0; }
  static float reduce_max(F v) { return _mm512_reduce_max_ps(v); }
  // exp(s - m), 0 under e^-87, where exp16 would clamp to e^-87 instead (a -inf logit then
  // stays a weight of 0).
  static F weights(F s, F m) {
    const F d = _mm512_sub_ps(s, m);
    return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_GE_OQ), isoserve::exp16(d));
  }
  static D zero() { return _mm512_setzero_pd(); }
  // The low and the high half of w, widened to float64, added to low and high.
  static void add(D& low, D& high, F w) {
    low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(w)));
    high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(w), 1))));
  }
  static double reduce_add(D low, D high) { return _mm512_reduce_add_pd(_mm512_add_pd(low, high)); }
  static void store(float* p, F v) { _mm512_store_ps(p, v); }
};
#endif

#if ISOSERVE_AVX2_FMA
// 8 lanes: a row's last partial vector goes through a small -inf-filled buffer (AVX2 has no
// masked load that fills with anything but 0).
struct Lanes8 {
  using F = __m256;
  using D = __m256d;
  static constexpr int64_t kLanes = 8;
  static F scaled(const float* x, int64_t j, int64_t n, F temperature) {
    const int64_t left = n - j;
    if (left >= kLanes) return _mm256_div_ps(_mm256_loadu_ps(x + j), temperature);
    alignas(32) float tail[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) tail[i] = i < left ? x[j + i] : -INFINITY;
    return _mm256_div_ps(_mm256_load_ps(tail), temperature);
  }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static bool any_nan(F s) { return _mm256_movemask_ps(_mm256_cmp_ps(s, s, _CMP_UNORD_Q)) != 0; }
  static float reduce_max(F v) { return isoserve::max_lanes8(v); }
  static F weights(F s, F m) {
    const F d = _mm256_sub_ps(s, m);
    return _mm256_and_ps(_mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_GE_OQ), isoserve::exp8(d));
  }
  static D zero() { return _mm256_setzero_pd(); }
  static void add(D& low, D& high, F w) {
    low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(w)));
    high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1)));
  }
  static double reduce_add(D low, D high) {
    const __m256d both = _mm256_add_pd(low, high);
    const __m128d half = _mm_add_pd(_mm256_castpd256_pd128(both), _mm256_extractf128_pd(both, 1));
    return _mm_cvtsd_f64(_mm_add_sd(half, _mm_unpackhi_pd(half, half)));
  }
  static void store(float* p, F v) { _mm256_store_ps(p, v); }
};
#endif

// The widest this CPU has (the library is built for the CPU it runs on).
#if ISOSERVE_BF16X16
using RowLanes = Lanes16;
#else
using RowLanes = Lanes8;
#endif

// One row's token, or -1 where the row is no distribution (a NaN, a +inf, or every logit -inf
// once scaled). ends: the thread's scratch, a float64 per block.
template <typename L>
int64_t draw_row(const float* x, int64_t n, float temperature, double u, std::vector<double>& ends) {
  using F = typename L::F;
  const F t = L::set1(temperature);
  F top = L::set1(-INFINITY);
  bool nan = false;
  for (int64_t j = 0; j < n; j += L::kLanes) {
    const F s = L::scaled(x, j, n, t);
    nan |= L::any_nan(s);
    top = L::max(top, s);
  }
  const float m = L::reduce_max(top);
  if (nan || std::isinf(m)) return -1;
  const F mv = L::set1(m);

  const int64_t blocks = (n + kBlock - 1) / kBlock;
  ends.resize(blocks);
  double total = 0.0;
  for (int64_t b = 0; b < blocks; ++b) {
    // In float64: a block's sum then differs from the running sum of its tokens below (the same
    // float32 weights in another order) by ~1e-16 of the total, not by float32's ~1e-7, which
    // moved about one draw in 10^4 to a neighbouring token.
    typename L::D low = L::zero(), high = L::zero();
    for (int64_t j = b * kBlock; j < std::min(n, (b + 1) * kBlock); j += L::kLanes)
      L::add(low, high, L::weights(L::scaled(x, j, n, t), mv));
    total += L::reduce_add(low, high);
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
  for (int64_t j = first; j < last; j += L::kLanes) L::store(w + (j - first), L::weights(L::scaled(x, j, n, t), mv));
  double running = block > 0 ? ends[block - 1] : 0.0;
  int64_t chosen = -1;
  for (int64_t j = first; j < last; ++j) {
    if (w[j - first] > 0.0f) chosen = j;  // the last of positive weight so far
    running += static_cast<double>(w[j - first]);
    if (running > target) return j;  // a weight of 0 never gets here first
  }
  // The block's sum (by lanes, then across them) and this running sum rounded apart, by ~1e-16:
  // the block's last token of positive weight.
  return chosen;
}

}  // namespace

at::Tensor temperature_draw(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u) {
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
  auto tokens = at::empty({rows}, at::kLong);
  const float* x = logits.data_ptr<float>();
  int64_t* out = tokens.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> ends;
    for (int64_t r = begin; r < end; ++r) out[r] = draw_row<RowLanes>(x + r * n, n, t[r], uniform[r], ends);
  });
  return tokens;
}

#else

at::Tensor temperature_draw(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "temperature_draw needs AVX2 and FMA or AVX-512 (has_temperature_draw is False here)");
  return {};
}

#endif

bool has_temperature_draw() {
#if ISOSERVE_BF16X16 || ISOSERVE_AVX2_FMA
  return true;
#else
  return false;
#endif
}
