// float8 e4m3fn (torch.float8_e4m3fn) to and from float32, for a KV pool kept in 8 bits
// (config.parse_kv_dtype): 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits, no
// infinities, 0x7F / 0xFF NaN, largest finite 448, subnormals down to 2^-9.
//
// Why by hand: torch has no vectorized CPU conversion a kernel can call, and c10's scalar one
// costs a branchy function call per element; a decode step writes ~370 K of them and its
// attention reads ~60 M. The conversions here are the same bits as torch's `.to()` both ways
// (tests/test_fused_kernels.py walks every code and a sweep of floats): round to nearest
// even, saturating at +-448 (infinity included, as torch does), NaN to NaN.
//
// AVX-512 intrinsics where the CPU has them; else the same arithmetic on 16-lane GCC vectors.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

namespace isoserve {

typedef float fp8_floats __attribute__((vector_size(64)));
typedef uint32_t fp8_words __attribute__((vector_size(64)));
typedef int32_t fp8_ints __attribute__((vector_size(64)));
typedef uint8_t fp8_bytes __attribute__((vector_size(16)));

constexpr uint32_t kE4m3Nan = 0x7F;
// e4m3's exponent bias is 7, float32's 127: a normal code's float has its exponent 120 higher.
constexpr uint32_t kE4m3ToFloatBias = 120u << 23;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define ISOSERVE_FP8_AVX512 1
#else
#define ISOSERVE_FP8_AVX512 0
#endif

// 16 codes to floats. A normal code (magnitude >= 8) is its exponent and mantissa moved into a
// float's fields and rebiased; a subnormal one is its 3-bit mantissa times 2^-9.
inline fp8_floats e4m3_to_floats(const uint8_t* codes) {
#if ISOSERVE_FP8_AVX512 || (defined(__AVX2__) && defined(__F16C__))
  // Through float16, whose conversion instruction does the rebiasing and the subnormals: a
  // code's magnitude bits moved up 7 are a float16 of the value / 2^8 (float16's exponent bias
  // is 15, e4m3's 7), its sign bit moved up 8 the float16's sign. GCC's code for the generic
  // version below moved bytes one by one (on AVX2 it took a float8 pool's decode attention to
  // 61 ms for 30 layers at batch 32, this 21.6; a bfloat16 pool's, 8.8).
  const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i magnitude = _mm256_and_si256(w, _mm256_set1_epi16(0x7F));
  const __m256i half = _mm256_or_si256(_mm256_slli_epi16(magnitude, 7),
                                       _mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16(-0x8000)));
#if ISOSERVE_FP8_AVX512
  const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(half), _mm512_set1_ps(256.0f));
  const __mmask16 nan = _mm256_cmpeq_epi16_mask(magnitude, _mm256_set1_epi16(0x7F));
  return reinterpret_cast<fp8_floats>(_mm512_mask_mov_ps(v, nan, _mm512_set1_ps(__builtin_nanf(""))));
#else  // AVX2: 8 lanes at a time
  const __m256i nan = _mm256_cmpeq_epi16(magnitude, _mm256_set1_epi16(0x7F));
  const __m256 scale = _mm256_set1_ps(256.0f), quiet = _mm256_set1_ps(__builtin_nanf(""));
  __m256 lanes[2];
  for (int i = 0; i < 2; ++i) {
    const __m128i part = i ? _mm256_extracti128_si256(half, 1) : _mm256_castsi256_si128(half);
    const __m128i part_nan = i ? _mm256_extracti128_si256(nan, 1) : _mm256_castsi256_si128(nan);
    lanes[i] = _mm256_blendv_ps(_mm256_mul_ps(_mm256_cvtph_ps(part), scale), quiet,
                                _mm256_castsi256_ps(_mm256_cvtepi16_epi32(part_nan)));
  }
  fp8_floats v;
  std::memcpy(&v, lanes, sizeof v);
  return v;
#endif
#else
  fp8_bytes bytes;
  std::memcpy(&bytes, codes, sizeof bytes);
  const fp8_words w = __builtin_convertvector(bytes, fp8_words);
  const fp8_words magnitude = w & 0x7Fu, sign = (w & 0x80u) << 24;
  const fp8_floats sub = __builtin_convertvector(magnitude, fp8_floats) * 0x1p-9f;
  fp8_words bits = (magnitude >= 8u) ? ((magnitude << 20) + kE4m3ToFloatBias)
                                     : reinterpret_cast<fp8_words>(sub);
  bits = (magnitude == kE4m3Nan) ? fp8_words{} + 0x7FC00000u : bits;
  return reinterpret_cast<fp8_floats>(bits | sign);
#endif
}

// 16 floats to codes. Normal results (|x| >= 2^-6) round the float's bits to 3 mantissa bits,
// to nearest even, and rebias; smaller ones are |x| / 2^-9 rounded to an integer, to nearest
// even by the 1.5 * 2^23 trick (the sum's low bits are the rounded value). 7.5 * 2^-9 rounds
// up to 8, the smallest normal code, so the two ranges meet.
inline void floats_to_e4m3(fp8_floats x, uint8_t* codes) {
#if ISOSERVE_FP8_AVX512
  const __m512i bits = reinterpret_cast<__m512i>(x);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(bits, 24), _mm512_set1_epi32(0x80));
  const __m512i abs_bits = _mm512_and_si512(bits, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(abs_bits, _mm512_set1_epi32(0x7F800000));
  const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(abs_bits), _mm512_set1_ps(448.0f));
  const __m512i a_bits = _mm512_castps_si512(a);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(a_bits, 20), _mm512_set1_epi32(1));
  const __m512i normal = _mm512_sub_epi32(
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(a_bits, _mm512_set1_epi32(0x7FFFF)), odd), 20),
      _mm512_set1_epi32(kE4m3ToFloatBias >> 20));
  const __m512 magic = _mm512_set1_ps(12582912.0f);  // 1.5 * 2^23
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_fmadd_ps(a, _mm512_set1_ps(512.0f), magic)),
                                       _mm512_castps_si512(magic));
  __m512i code = _mm512_mask_mov_epi32(normal, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0x1p-6f), _CMP_LT_OQ), sub);
  code = _mm512_mask_mov_epi32(code, nan, _mm512_set1_epi32(kE4m3Nan));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(codes), _mm512_cvtepi32_epi8(_mm512_or_si512(code, sign)));
#else
  const fp8_words bits = reinterpret_cast<fp8_words>(x);
  const fp8_words sign = (bits >> 24) & 0x80u, abs_bits = bits & 0x7FFFFFFFu;
  const fp8_ints nan = reinterpret_cast<fp8_ints>(abs_bits > 0x7F800000u);
  fp8_floats a = reinterpret_cast<fp8_floats>(abs_bits);
  a = (a > 448.0f) ? fp8_floats{} + 448.0f : a;  // saturate, infinity included
  const fp8_words a_bits = reinterpret_cast<fp8_words>(a);
  const fp8_words normal = ((a_bits + 0x7FFFFu + ((a_bits >> 20) & 1u)) >> 20) - (kE4m3ToFloatBias >> 20);
  const fp8_floats magic = fp8_floats{} + 12582912.0f;  // 1.5 * 2^23
  const fp8_words sub = reinterpret_cast<fp8_words>(a * 512.0f + magic) - reinterpret_cast<fp8_words>(magic);
  fp8_words code = (a >= 0x1p-6f) ? normal : sub;
  code = nan ? fp8_words{} + kE4m3Nan : code;
  const fp8_bytes out = __builtin_convertvector(code | sign, fp8_bytes);
  std::memcpy(codes, &out, sizeof out);
#endif
}

// 32 codes as 32 bfloat16 words, in order: the form the bfloat16 decode attention reads (its
// dot-product instruction and its paired values). Every e4m3 value is a bfloat16 exactly. A
// normal code is its fields moved up 4 and rebiased; the 7 subnormal ones are looked up (as
// normal bfloat16s, which the dot product does not flush as it flushes subnormal ones).
#if ISOSERVE_FP8_AVX512
inline __m512i e4m3_to_bf16x32(const uint8_t* codes) {
  const __m512i subnormals = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                              0, 0, 0, 0, 0, 0, 0, 0, 0x3C60, 0x3C40, 0x3C20, 0x3C00,
                                              0x3BC0, 0x3B80, 0x3B00, 0);  // m * 2^-9, m = 0..7
  // Sign-extended, so a word's bit 15 is its code's sign.
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes)));
  const __m512i magnitude = _mm512_and_si512(w, _mm512_set1_epi16(0x7F));
  __m512i bits = _mm512_add_epi16(_mm512_slli_epi16(magnitude, 4), _mm512_set1_epi16(static_cast<int16_t>(kE4m3ToFloatBias >> 16)));
  bits = _mm512_mask_permutexvar_epi16(bits, _mm512_cmplt_epu16_mask(magnitude, _mm512_set1_epi16(8)), magnitude, subnormals);
  // The sign: bit 15 from w, the rest from bits (0xCA is A ? B : C, A = 0x8000).
  bits = _mm512_ternarylogic_epi32(_mm512_set1_epi16(-0x8000), w, bits, 0xCA);
  return _mm512_mask_mov_epi16(bits, _mm512_cmpeq_epi16_mask(magnitude, _mm512_set1_epi16(0x7F)),
                               _mm512_set1_epi16(0x7FC0));
}
#endif

#if ISOSERVE_FP8_AVX512 && defined(__AVX512VBMI__)
#define ISOSERVE_FP8_VBMI 1
// The bfloat16 of each e4m3 magnitude (0..127), as two planes of bytes for vpermi2b: a
// 128-byte table lookup per instruction, 64 codes at a time.
struct Bf16Planes {
  alignas(64) uint8_t high[128];
  alignas(64) uint8_t low[128];
};
constexpr uint16_t e4m3_magnitude_as_bf16(int m) {
  if (m == 0x7F) return 0x7FC0;                                         // NaN
  if (m >= 8) return static_cast<uint16_t>((m << 4) + (kE4m3ToFloatBias >> 16));  // normal
  if (m == 0) return 0;
  const int e = m >= 4 ? 2 : m >= 2 ? 1 : 0;                            // m * 2^-9 = 2^(e-9) * 1.f
  return static_cast<uint16_t>(((e + 118) << 7) | ((m << (7 - e)) & 0x7F));
}
constexpr Bf16Planes make_bf16_planes() {
  Bf16Planes planes{};
  for (int m = 0; m < 128; ++m) {
    planes.high[m] = static_cast<uint8_t>(e4m3_magnitude_as_bf16(m) >> 8);
    planes.low[m] = static_cast<uint8_t>(e4m3_magnitude_as_bf16(m) & 0xFF);
  }
  return planes;
}
inline constexpr Bf16Planes kBf16Planes = make_bf16_planes();

// 64 codes as two vectors of 32 bfloat16 words (codes 0-31, then 32-63), the same words as
// e4m3_to_bf16x32 gives: each byte of the word looked up by the code's magnitude (vpermi2b
// ignores the index's top bit, the sign, which goes back in after), the bytes paired into words
// within 128-bit lanes, and the lanes put in order. Eight instructions for 64 codes where
// e4m3_to_bf16x32 takes twenty: a float8 pool's batch-32 decode attention, converting every key
// and value it reads, was bound by them.
inline void e4m3_to_bf16x64(const uint8_t* codes, __m512i& first, __m512i& second) {
  const __m512i c = _mm512_loadu_si512(codes);
  __m512i high = _mm512_permutex2var_epi8(_mm512_load_si512(kBf16Planes.high), c,
                                          _mm512_load_si512(kBf16Planes.high + 64));
  const __m512i low = _mm512_permutex2var_epi8(_mm512_load_si512(kBf16Planes.low), c,
                                               _mm512_load_si512(kBf16Planes.low + 64));
  high = _mm512_ternarylogic_epi32(_mm512_set1_epi8(static_cast<char>(0x80)), c, high, 0xCA);  // A ? B : C
  const __m512i a = _mm512_unpacklo_epi8(low, high);  // codes 0-7, 16-23, 32-39, 48-55
  const __m512i b = _mm512_unpackhi_epi8(low, high);  // codes 8-15, 24-31, 40-47, 56-63
  first = _mm512_permutex2var_epi64(a, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), b);
  second = _mm512_permutex2var_epi64(a, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), b);
}
#else
#define ISOSERVE_FP8_VBMI 0
#endif

// One value each way, the same arithmetic (for head sizes that are no multiple of 16).
inline float e4m3_to_float(uint8_t code) {
  uint8_t lanes[16] = {code};
  const fp8_floats v = e4m3_to_floats(lanes);
  return v[0];
}

inline uint8_t float_to_e4m3(float x) {
  uint8_t lanes[16];
  floats_to_e4m3(fp8_floats{} + x, lanes);
  return lanes[0];
}

}  // namespace isoserve
