// Sixteen bfloat16 values at a time on AVX-512, for the elementwise kernels (cpu_ops.cpp), and
// the exp polynomial both attention kernels' softmaxes use.
//
// Why by hand: gcc vectorizes the scalar loops too, but c10's rounding (a NaN branch) and
// fast_exp's clamps and NaN test come out as masked blends, ~6 instructions per element where
// these take ~3. The kernels gained less than that (SwiGLU 7-15%, decode attention ~5%, norms
// and RoPE within 8%): 512-bit multiply-adds, shifts and conversions share one port, which
// bounds both versions. Each step is the scalar code's own operation, in its order, with a
// multiply-add wherever gcc contracts the scalar expression into one, so the results are the
// scalar kernels' to the bit (tests/test_fused_kernels.py holds both to the torch reference),
// except denormal outputs of SwiGLU, RMSNorm and RoPE, which their rounding (bf16x16_bits_ftz
// below) flushes to zero.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace isoserve {

// The Taylor polynomial of e^r from its x^5 term down, Horner's way, on p (the higher terms'
// sum so far): the tail both exps share (exp16 below, and amx_attention.cpp's for the softmax).
// Its own target, so that amx_attention.cpp's AMX functions take it where -march has no AVX-512.
__attribute__((target("avx512f,fma"))) inline __m512 exp_taylor_tail(__m512 p, __m512 r) {
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
}

// m[i] becomes column i of the 16 x 16 matrix of 32-bit words whose rows m held. Its own target,
// as exp_taylor_tail: amx_attention.cpp's AMX functions and f32_prefill_attention.cpp take it.
__attribute__((target("avx512f"))) inline void transpose16(__m512i* m) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {  // within 128-bit lanes: pairs of rows interleaved
    t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // lane l of m[i + j]: column 4 l + j of rows i .. i + 3
    m[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    m[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    m[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    m[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // then the 128-bit lanes across rows i, i + 4, i + 8, i + 12
    t[i] = _mm512_shuffle_i32x4(m[i], m[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(m[i], m[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(m[i + 8], m[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(m[i + 8], m[i + 12], 0xdd);
  }
  for (int i = 0; i < 8; ++i) {
    m[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    m[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}

}  // namespace isoserve

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define ISOSERVE_BF16X16 1

namespace isoserve {

// bfloat16 is the top half of a float32.
inline __m512 widen_bf16x16(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

inline __m512 load_bf16x16(const void* p) {
  return widen_bf16x16(_mm256_loadu_si256(static_cast<const __m256i*>(p)));
}

// Rounds to the nearest bfloat16, ties to even, NaN to 0x7FC0: c10::BFloat16's conversion,
// denormals included (the CPU's vcvtneps2bf16 would flush those to zero).
inline __m256i bf16x16_bits(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i bias = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)),
                                        _mm512_set1_epi32(0x7FFF));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// The same rounding by the CPU's own instruction (vcvtneps2bf16, AVX512-BF16), one instruction
// where bf16x16_bits takes seven, but with denormals (below 1.2e-38) flushed to zero: for the
// outputs of SwiGLU, RMSNorm and RoPE, where a flush is far inside the kernels' tolerance. The
// residual stream keeps the exact rounding (add_rms_norm's in-place sum equals torch's).
inline __m256i bf16x16_bits_ftz(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  return bf16x16_bits(v);
#endif
}

inline void store_bf16x16(void* p, __m512 v) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), bf16x16_bits(v));
}

// The float32 value of v rounded to bfloat16 (round_to<BFloat16> in cpu_ops.cpp).
inline __m512 round_bf16x16(__m512 v) { return widen_bf16x16(bf16x16_bits(v)); }

// The same two by the CPU's instruction, denormals flushed (bf16x16_bits_ftz).
inline void store_bf16x16_ftz(void* p, __m512 v) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), bf16x16_bits_ftz(v));
}
inline __m512 round_bf16x16_ftz(__m512 v) { return widen_bf16x16(bf16x16_bits_ftz(v)); }

// cpu_ops.cpp's fast_exp, sixteen lanes at a time (its comment says why each step is there).
inline __m512 exp16(__m512 input) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(input, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), magic), magic);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  const __m512 p = exp_taylor_tail(_mm512_fmadd_ps(_mm512_set1_ps(1.0f / 5040), r, _mm512_set1_ps(1.0f / 720)), r);
  const __m512 two_n = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23));
  return _mm512_mask_mov_ps(_mm512_mul_ps(p, two_n), _mm512_cmp_ps_mask(input, input, _CMP_UNORD_Q), input);
}

}  // namespace isoserve

#endif
