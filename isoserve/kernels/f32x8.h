// Eight float32 values at a time on AVX2. The first part serves every AVX2 build: lane
// reductions, e^x and SwiGLU's arithmetic, which float32 silu_mul (cpu_ops.cpp) and the int8
// gate-up kernel (int8_matmul.cpp) share so that they agree to the bit. The second part is
// for the float32 kernels of a CPU without AVX-512 (vector_attention.cpp, argmax): where
// isoserve runs in float32 by default (config.native_bfloat16), gcc's 16-wide vector code for
// the AVX-512 machines is split into pairs of 8-wide registers, and the attention kernel's
// working set then spills: 30 layers of batch-32 decode attention took 28 ms on an AMD Zen 3
// (docs/benchmarks.md).
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define ISOSERVE_AVX2_FMA 1
#include <immintrin.h>

namespace isoserve {

// For every AVX2 build (int8_matmul.cpp runs on AVX-512 machines too): lane reductions, e^x, SwiGLU.
inline float sum_lanes8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

inline float max_lanes8(__m256 v) {
  const __m128 half = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_max_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_max_ss(pair, _mm_movehdup_ps(pair)));
}

// e^x on 8 lanes, cpu_ops.cpp's fast_exp steps: n = round(x / ln 2), r = x - n ln 2 in two
// parts (Cody-Waite, so r is exact), degree-7 Taylor, times 2^n. Inputs clamped to [-87, 88],
// where 2^n stays a normal float; a NaN stays NaN. Not fast_exp to the bit: there gcc may fuse
// x / ln 2 with the rounding add into one FMA, and about one input in 16 million then rounds to
// a neighbouring n.
inline __m256 exp8(__m256 x) {
  const __m256 input = x;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 result = _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
  return _mm256_blendv_ps(result, input, _mm256_cmp_ps(input, input, _CMP_UNORD_Q));
}

// silu(g) * u on 8 lanes: SwiGLU's float32 arithmetic, g / (1 + e^-g) times u, shared by
// cpu_ops.cpp's silu_mul and int8_matmul.cpp's gate-up kernel, which must agree to the bit.
inline __m256 silu_times8(__m256 g, __m256 u) {
  const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)))));
  return _mm256_mul_ps(silu, u);
}

}  // namespace isoserve
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define ISOSERVE_F32X8 1

#include <immintrin.h>

namespace isoserve {

// Lane i of the result is the sum of the 8 lanes of v[i]: one transpose-and-add tree (6
// horizontal adds, 2 lane swaps, 1 add) where 8 separate reductions would take ~40.
inline __m256 sum_each8(const __m256* v) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // s0123's low half holds lanes 0-3 of v[0..3] summed, its high half lanes 4-7; s4567 the same.
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

}  // namespace isoserve

#endif
