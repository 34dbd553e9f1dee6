// y = x W^T for a GGUF's Q4_1 or Q8_0 weights on AVX2 or AVX512-VNNI with the activations
// quantized to int8: the arithmetic of llama.cpp's CPU path for these files (its Q8 activation
// blocks), written for isoserve's panel layout.
//
// Why: on a CPU without a native bfloat16 path (AVX2 only, such as AMD Zen 3) isoserve runs in
// float32, and a decode step of 32 sequences is bound by the float32 multiply-adds (two 8-lane
// FMAs a cycle). vpmaddubsw multiplies 32 byte pairs in one instruction, two a cycle: a block
// of 32 inputs costs 8 of them per row and pair of panels where float32 costs 64 FMAs. On
// AVX512-VNNI without AMX (AMD Zen 4) these tiles also beat oneDNN's bfloat16 matmuls, so there
// `--dtype auto` runs a Q4_1 GGUF in float32 too (model/quantized.py, int8_blocks_preferred).
//
// Arithmetic (model/int8_blocks.py reproduces it, and tests/test_int8_matmul.py checks it):
// each row's block of 32 inputs is quantized on its own, a = amax / 127, q = round(x * (127 /
// amax)) (round half to even; a block of zeros has a = 0 and q = 0), with its sum s = a * sum(q).
// A block's products are summed exactly in integers, then in float32, block after block:
//   Q4_1 (w = d * c + m, c in 0..15)  y += (d * a) * sum(c q);  y += m * s
//   Q8_0 (w = d * c, c in -128..127)  y += (d * a) * sum(c q)
// Every row takes the same operations in the same order whatever the step's other rows and the
// thread count, so a sequence's logits do not depend on what it was batched with.
//
// Layout (model/int8_blocks.py builds it): the outputs in panels of 8, d (and m) as float32
// [N / 8, K / 32, 8] as in vector_matmul.cpp. The codes in groups of 4 inputs: a group's 32
// bytes hold the 8 outputs' 4 codes each ([output][input]), so one vpmaddubsw against one
// row's 4 inputs broadcast gives, per output, two sums of two products. Q4_1: a block's 8
// groups in 4 chunks of 32 bytes, chunk c holding group c in its low nibbles and group c + 4
// in its high ones: [N / 8, K / 32, 4, 32] bytes. Q8_0: [N / 8, K / 32, 8, 32] int8. Panels go
// in pairs (2i, 2i + 1), interleaved chunk by chunk and their scales block by block: a pair's
// codes are [K / 32, 4 (Q8_0: 8), 2, 32] bytes and its d and m [K / 32, 2, 8], so that a pair is
// one stream in memory and its two panels' chunk one 64-byte load; an odd count's last panel
// follows the pairs as it is. H panels (1 or 2) from panel p: codes at cp + p * panel_bytes,
// block b's chunk c of panel h at + (b * H * 4 + c * H + h) * 32 (Q4_1), scales at + (b * H + h) * 8.
//
// SwiGLU (q4_1_swiglu_i8): a merged gate-up weight whose pairs of panels are a gate panel and
// the up panel of the same 8 outputs gives silu(gate) * up for them straight from its two
// accumulators (f32x8.h's silu_times8, silu_mul's arithmetic to the bit): half the outputs
// written, and no second pass over a [rows, 2 n] intermediate (39 MB a layer in a 3,200-token
// prefill step).
//
// Threads split the pairs of panels; a step's rows go in tiles of up to 4 (8 int16 sums, two
// panels' weights and an input fit the 16 registers). A step of several tiles widens a pair of
// panels once into a buffer of bytes that each tile reads; a step of one tile widens in registers.
//
// With AVX512-VNNI (AMD Zen 4, Intel Ice Lake and later) a pair of panels is one 16-lane vector,
// and vpdpbusd multiplies a group's 64 byte pairs and adds them, 4 by 4, to 16 int32 sums: one
// instruction where AVX2 takes two vpmaddubsw and two adds per pair of panels, and no widening
// of int16 sums at each block end. Its operands are unsigned x signed bytes: Q4_1's codes are
// unsigned; for Q8_0 the activations go unsigned instead, q + 128, and each block's sums get
// -128 times the sum of its codes added, so the integer sums are exactly AVX2's. The float32
// steps are AVX2's in the same order, lane for lane, so both paths give the same bits (for
// finite inputs: an infinite one quantizes to -128, which AVX2's vpsignb cannot negate). With
// 32 registers a tile holds up to 8 rows (the tile_512 section below).
#include "tensors.h"

#include <immintrin.h>

#include "block_linear.h"
#include "f32x8.h"
#include "line_prefetch.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

// AVX512-VNNI: pairs of panels as 16-lane vectors (the tile_512 section).
#if defined(__AVX2__) && defined(__FMA__) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define ISOSERVE_INT8_ZMM 1
#endif

namespace {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kBuiltForAvx2 = true;
constexpr int kPanel = 8;   // outputs a panel holds: one vector of 8 int32 or float32 sums
constexpr int kTile = 4;    // rows of a tile

// A step's rows, quantized by blocks of 32: the tile of rows [r0, r0 + R) holds its codes
// interleaved, [K / 4][R] words of 4 codes, so each broadcast of a row's group is a constant
// offset from one register; scale and sum are [rows][K / 32].
struct QuantizedRows {
  std::unique_ptr<int32_t[]> words;
  std::unique_ptr<float[]> scale, sum;
};

inline int32_t sum_lanes(__m256i v) {
  const __m128i half = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i pair = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(pair, _mm_shuffle_epi32(pair, 0xb1)));
}

// One row's block of 32 inputs: its 8 words of codes into words[0], words[stride], ...
// flip: 0, or 0x80808080 for codes as unsigned bytes q + 128 (the AVX-512 Q8_0 tiles).
inline void quantize_block(const float* x, int32_t* words, int64_t stride, float* scale, float* sum, int32_t flip) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int i = 0; i < 4; ++i) v[i] = _mm256_loadu_ps(x + 8 * i);
  const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                                   _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  // A NaN input makes the block's scale NaN, so that its row's outputs are NaN as float32's
  // would be (vmaxps drops a NaN operand: amax alone would quantize around it).
  const float total = isoserve::sum_lanes8(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])));
  const float amax = std::isnan(total) ? total : isoserve::max_lanes8(top);
  const __m256 inverse = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
  __m256i q[4];
  for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));  // half to even
  *scale = amax / 127.0f;
  *sum = *scale * static_cast<float>(sum_lanes(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]))));
  // Packing interleaves 128-bit lanes: words come out as q0[0:4] q1[0:4] q2[0:4] q3[0:4] q0[4:8] ...
  const __m256i bytes = _mm256_permutevar8x32_epi32(
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  alignas(32) int32_t out[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(out), bytes);
  for (int w = 0; w < 8; ++w) words[w * stride] = out[w] ^ flip;
}

// Rows in tiles of equal size (10 rows: 4 + 3 + 3): tile t is rows [first_row(t), first_row(t + 1)).
struct Tiles {
  int64_t rows, count;
  int64_t first_row(int64_t t) const { return rows * t / count; }
};

QuantizedRows quantize_rows(const float* x, int64_t rows, int64_t K, const Tiles& tiles, int32_t flip) {
  QuantizedRows out{std::unique_ptr<int32_t[]>(new int32_t[rows * K / 4]),
                    std::unique_ptr<float[]>(new float[rows * K / 32]), std::unique_ptr<float[]>(new float[rows * K / 32])};
  // Threads where each gets at least kQuantizeGrain inputs: a batch-32 decode step's 4 tiles
  // of a down projection (49 K inputs, 17 us on one core of a Zen 4) split in two, where the
  // other thread would only wait for them; a step of one tile stays on the calling thread.
  constexpr int64_t kQuantizeGrain = 8192;
  const int64_t tile_inputs = std::max<int64_t>(1, rows / tiles.count * K);
  at::parallel_for(0, tiles.count, std::max<int64_t>(1, kQuantizeGrain / tile_inputs), [&](int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const int64_t r0 = tiles.first_row(t), R = tiles.first_row(t + 1) - r0;
    int32_t* tile = out.words.get() + r0 * K / 4;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t b = 0; b < K / 32; ++b)
        quantize_block(x + (r0 + r) * K + 32 * b, tile + 8 * b * R + r, R, &out.scale[(r0 + r) * K / 32 + b],
                       &out.sum[(r0 + r) * K / 32 + b], flip);
  }
  });
  return out;
}

// Each format widens group g (inputs 4g .. 4g + 4) of one panel's block of codes to the vectors
// vpmaddubsw takes: Q4_1 one, its codes as unsigned bytes; Q8_0 two, |c| and c (vpsignb puts
// c's sign on the input, so that the unsigned operand can be |c|).
struct Q4_1 {
  static constexpr int kVectors = 1;                // widened vectors per group and panel
  static constexpr int64_t kBlockBytes = 4 * 32;    // a panel's codes for one block
  static constexpr bool kHasMin = true;
  // block: the panel's first chunk of the block; stride: bytes from one of its chunks to the next
  static inline void widen(const uint8_t* block, int64_t stride, int g, __m256i* out) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + stride * (g % 4)));
    out[0] = _mm256_and_si256(g < 4 ? v : _mm256_srli_epi16(v, 4), _mm256_set1_epi8(15));
  }
  // The 16 int16 pair sums of a group's products with one row's word broadcast in a.
  static inline __m256i products(const __m256i* w, __m256i a) { return _mm256_maddubs_epi16(w[0], a); }
};

struct Q8_0 {
  static constexpr int kVectors = 2;
  static constexpr int64_t kBlockBytes = 8 * 32;
  static constexpr bool kHasMin = false;
  static inline void widen(const uint8_t* block, int64_t stride, int g, __m256i* out) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + stride * g));
    out[0] = _mm256_abs_epi8(v);  // -128 stays 0x80: 128 unsigned
    out[1] = v;
  }
  static inline __m256i products(const __m256i* w, __m256i a) {
    return _mm256_maddubs_epi16(w[0], _mm256_sign_epi8(a, w[1]));
  }
};

// Where a tile's weights come from. A step of one tile widens each group in registers as it
// goes (Direct); one of several tiles widens a pair of panels once into a buffer that every
// tile reads ([block][group][panel][vector]), which one tile would only write and read back
// (a 1-row decode step was 10% slower so). The sums are the same either way.
template <typename Format, int H, bool Direct>
struct Weights {
  const uint8_t* codes;      // Direct: the H panels' codes, chunks interleaved (layout above)
  const __m256i* widened;    // else
  inline void group(int64_t b, int g, __m256i (&w)[H][Format::kVectors]) const {
    for (int h = 0; h < H; ++h) {
      if (Direct) {
        Format::widen(codes + b * H * Format::kBlockBytes + h * 32, H * 32, g, w[h]);
      } else {
        for (int v = 0; v < Format::kVectors; ++v)
          w[h][v] = _mm256_load_si256(widened + ((b * 8 + g) * H + h) * Format::kVectors + v);
      }
    }
  }
};

// A value the compiler must take as it is: an empty asm that might have changed it, so that
// gcc cannot fold the adds before it into a reassociated tree (integer sums: no bit changes).
inline __m256i in_order(__m256i v) {
  __asm__("" : "+x"(v));
  return v;
}

// y[r, 8 H p .. 8 H (p + 1)) for the R rows of a tile and H panels; with Swiglu (H = 2: a
// gate panel and its up panel), y[r, 8 p .. 8 (p + 1)) = silu(gate) * up instead.
template <typename Format, int H, int R, bool Direct, bool Swiglu>
inline void tile(const int32_t* words, const float* scale, const float* sum, int64_t K,
                 const Weights<Format, H, Direct>& weights, const float* d, const float* m, float* y, int64_t N) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[H][R];
  for (int h = 0; h < H; ++h)
    for (int r = 0; r < R; ++r) acc[h][r] = _mm256_setzero_ps();
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i block[H][R];
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) block[h][r] = _mm256_setzero_si256();
    // The 8 groups unrolled, each sum kept in order (in_order): unrolled alone, gcc reassociates
    // each sum into a tree of 8 products and spills them; rolled, it copies every sum to another
    // register each group. So a group is its weights' loads, R broadcasts, and H x R vpmaddubsw
    // with their adds, nothing more: a batch-32 step's Q4_1 tiles 1.22x as fast on a Zen 3
    // (docs/benchmarks.md, session 40).
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g, words += R) {
      __m256i w[H][Format::kVectors];
      weights.group(b, g, w);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256i a = _mm256_set1_epi32(words[r]);
#pragma GCC unroll 2
        for (int h = 0; h < H; ++h) {
          const __m256i p = Format::products(w[h], a);
          if (Format::kHasMin)  // 8 groups of pair sums of at most 2 * 15 * 127 fit int16
            block[h][r] = in_order(_mm256_add_epi16(block[h][r], p));
          else  // 2 * 128 * 127 each: to int32 at once
            block[h][r] = in_order(_mm256_add_epi32(block[h][r], _mm256_madd_epi16(p, ones)));
        }
      }
    }
#pragma GCC unroll 2
    for (int h = 0; h < H; ++h) {
      const __m256 vd = _mm256_loadu_ps(d + (b * H + h) * kPanel);
#pragma GCC unroll 6
      for (int r = 0; r < R; ++r) {
        const __m256i total = Format::kHasMin ? _mm256_madd_epi16(block[h][r], ones) : block[h][r];
        const __m256 da = _mm256_mul_ps(vd, _mm256_set1_ps(scale[r * blocks + b]));
        acc[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total), da, acc[h][r]);
        if (Format::kHasMin)
          acc[h][r] = _mm256_fmadd_ps(_mm256_loadu_ps(m + (b * H + h) * kPanel),
                                      _mm256_set1_ps(sum[r * blocks + b]), acc[h][r]);
      }
    }
  }
  if constexpr (Swiglu) {
    static_assert(H == 2, "a gate panel and its up panel");
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N, isoserve::silu_times8(acc[0][r], acc[1][r]));
  } else {
    for (int h = 0; h < H; ++h)
      for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * N + h * kPanel, acc[h][r]);
  }
}

template <typename Format, int H, bool Direct, bool Swiglu>
inline void tile_of(int rows, const int32_t* words, const float* scale, const float* sum, int64_t K,
                    const Weights<Format, H, Direct>& w, const float* d, const float* m, float* y, int64_t N) {
  switch (rows) {
    case 1: return tile<Format, H, 1, Direct, Swiglu>(words, scale, sum, K, w, d, m, y, N);
    case 2: return tile<Format, H, 2, Direct, Swiglu>(words, scale, sum, K, w, d, m, y, N);
    case 3: return tile<Format, H, 3, Direct, Swiglu>(words, scale, sum, K, w, d, m, y, N);
    case 4: return tile<Format, H, 4, Direct, Swiglu>(words, scale, sum, K, w, d, m, y, N);
  }
}

// The H (1 or 2) panels from p for every tile of the step; y's rows are N floats apart.
template <typename Format, int H, bool Swiglu>
inline void panels_for_all_tiles(int64_t p, const QuantizedRows& q, const Tiles& tiles, int64_t K, const uint8_t* cp,
                                 const float* dp, const float* mp, float* yp, int64_t N, __m256i* buffer) {
  const int64_t blocks = K / 32, panel_stride = blocks * kPanel, panel_bytes = blocks * Format::kBlockBytes;
  const uint8_t* codes = cp + p * panel_bytes;
  const bool direct = tiles.count == 1;
  if (!direct) {
    const Weights<Format, H, true> source{codes, nullptr};
    __m256i w[H][Format::kVectors];
    for (int64_t b = 0; b < blocks; ++b)
      for (int g = 0; g < 8; ++g) {
        source.group(b, g, w);
        for (int h = 0; h < H; ++h)
          for (int v = 0; v < Format::kVectors; ++v)
            _mm256_store_si256(buffer + ((b * 8 + g) * H + h) * Format::kVectors + v, w[h][v]);
      }
  }
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int64_t r0 = tiles.first_row(t);
    const int rows = static_cast<int>(tiles.first_row(t + 1) - r0);
    const int32_t* words = q.words.get() + r0 * K / 4;
    const float* scale = q.scale.get() + r0 * blocks;
    const float* sum = q.sum.get() + r0 * blocks;
    const float* pd = dp + p * panel_stride;
    const float* pm = mp ? mp + p * panel_stride : nullptr;
    float* py = yp + r0 * N + (Swiglu ? p / 2 : p) * kPanel;  // Swiglu: 8 outputs for 2 panels
    if (direct)
      tile_of<Format, H, true, Swiglu>(rows, words, scale, sum, K, Weights<Format, H, true>{codes, nullptr},
                                       pd, pm, py, N);
    else
      tile_of<Format, H, false, Swiglu>(rows, words, scale, sum, K, Weights<Format, H, false>{nullptr, buffer},
                                        pd, pm, py, N);
  }
}

#ifdef ISOSERVE_INT8_ZMM
// ---- AVX512-VNNI: a pair of panels in one vector --------------------------------------------
constexpr int kZmmTile = 8;  // rows: 8 int32 and 8 float32 sums, the weights and an input in 32 registers

// Panel 0's 32 bytes in the low half, panel 1's in the high half.
inline __m256 high_half(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }  // AVX512F, not DQ

// Group g of a block of two interleaved panels (`block`: its first byte), as vpdpbusd's weight
// operand: one load, panel 0's 32 bytes then panel 1's; and a group's products added to s.
struct Q4_1x16 {
  using Format = Q4_1;
  static constexpr int32_t kFlip = 0;
  static inline __m512i group(const uint8_t* block, int g) {
    const __m512i v = _mm512_loadu_si512(block + 64 * (g % 4));
    return _mm512_and_si512(g < 4 ? v : _mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
  }
  static inline __m512i dot(__m512i s, __m512i w, __m512i a) { return _mm512_dpbusd_epi32(s, w, a); }  // codes unsigned
};

struct Q8_0x16 {
  using Format = Q8_0;
  static constexpr int32_t kFlip = static_cast<int32_t>(0x80808080u);  // activations as q + 128
  static inline __m512i group(const uint8_t* block, int g) { return _mm512_loadu_si512(block + 64 * g); }
  static inline __m512i dot(__m512i s, __m512i w, __m512i a) { return _mm512_dpbusd_epi32(s, a, w); }  // codes signed
};

// Q8_0's activations go in as q + 128: a block's sums then need -128 times each output's sum
// of the block's codes added back. `codes` collects those sums, a group at a time.
inline __m512i count_codes(__m512i codes, __m512i w) { return _mm512_dpbusd_epi32(codes, _mm512_set1_epi8(1), w); }
inline __m512i take_back_offset(__m512i codes) { return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(codes, 7)); }

// Where a tile's pairs of panels come from: a step of one tile reads each group where it lies
// (InPlace), and counts a Q8_0 block's codes as they go by; one of several tiles gathers the
// pair once into a buffer that every tile reads (Gathered: 8 vectors a block, then each Q8_0
// block's offset; 27 KB for K = 1,536, in L1 and L2), which one tile would only write and read
// back. The sums are the same either way.
template <typename F>
struct InPlace {
  static constexpr bool kKeepsOffsets = false;
  const uint8_t* codes;  // the pair's, interleaved
  inline __m512i group(int64_t b, int g) const { return F::group(codes + b * 2 * F::Format::kBlockBytes, g); }
  inline void advance() const {}
};

// Each block of each tile of a gathered pair advances the thread's two streams of requested
// lines (line_prefetch.h): the next pair of panels' (a plan of its codes, d and m), and the
// caller's side lines.
using PairLines = isoserve::BasicLinePlan<3>;

template <typename F>
struct Gathered {
  static constexpr bool kKeepsOffsets = true;
  const __m512i* buffer;
  int64_t blocks;
  isoserve::LineStream<PairLines>* next_pair;
  isoserve::LineStream<>* side;  // another kernel's next input
  inline void advance() const { next_pair->advance(); side->advance(); }
  inline __m512i group(int64_t b, int g) const { return buffer[b * 8 + g]; }
  inline __m512i offset(int64_t b) const { return buffer[blocks * 8 + b]; }
  static void gather(__m512i* buffer, const InPlace<F>& source, int64_t blocks) {
    for (int64_t b = 0; b < blocks; ++b) {
      __m512i codes = _mm512_setzero_si512();
      for (int g = 0; g < 8; ++g) codes = count_codes(codes, buffer[b * 8 + g] = source.group(b, g));
      buffer[blocks * 8 + b] = take_back_offset(codes);
    }
  }
};

// y[r, 16 p' .. 16 p' + 16) for the R rows of a tile and a pair of panels; with Swiglu (a gate
// panel and its up panel), y[r, 8 p' .. 8 p' + 8) = silu(gate) * up. AVX2's tile() lane for lane.
template <typename F, int R, bool Swiglu, typename Source>
inline void tile_512(const int32_t* words, const float* scale, const float* sum, int64_t K, const Source& source,
                     const float* d, const float* m, float* y, int64_t N) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int64_t blocks = K / 32;
  for (int64_t b = 0; b < blocks; ++b) {
    source.advance();
    __m512i block[R], codes = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) block[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int g = 0; g < 8; ++g, words += R) {
      const __m512i w = source.group(b, g);
      if constexpr (F::kFlip != 0 && !Source::kKeepsOffsets) codes = count_codes(codes, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) block[r] = F::dot(block[r], w, _mm512_set1_epi32(words[r]));
    }
    if constexpr (F::kFlip != 0) {  // integer sums: the order of the additions changes no bit
      __m512i offset;
      if constexpr (Source::kKeepsOffsets) offset = source.offset(b);
      else offset = take_back_offset(codes);
      for (int r = 0; r < R; ++r) block[r] = _mm512_add_epi32(block[r], offset);
    }
    const __m512 vd = _mm512_loadu_ps(d + b * 2 * kPanel);  // the pair's 16 scales of block b
    __m512 vm = _mm512_setzero_ps();
    if constexpr (F::Format::kHasMin) vm = _mm512_loadu_ps(m + b * 2 * kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 da = _mm512_mul_ps(vd, _mm512_set1_ps(scale[r * blocks + b]));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(block[r]), da, acc[r]);
      if constexpr (F::Format::kHasMin) acc[r] = _mm512_fmadd_ps(vm, _mm512_set1_ps(sum[r * blocks + b]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    if constexpr (Swiglu)
      _mm256_storeu_ps(y + r * N, isoserve::silu_times8(_mm512_castps512_ps256(acc[r]), high_half(acc[r])));
    else
      _mm512_storeu_ps(y + r * N, acc[r]);
  }
}

template <typename F, bool Swiglu, typename Source>
inline void tile_512_of(int rows, const int32_t* words, const float* scale, const float* sum, int64_t K,
                        const Source& source, const float* d, const float* m, float* y, int64_t N) {
  switch (rows) {
    case 1: return tile_512<F, 1, Swiglu>(words, scale, sum, K, source, d, m, y, N);
    case 2: return tile_512<F, 2, Swiglu>(words, scale, sum, K, source, d, m, y, N);
    case 3: return tile_512<F, 3, Swiglu>(words, scale, sum, K, source, d, m, y, N);
    case 4: return tile_512<F, 4, Swiglu>(words, scale, sum, K, source, d, m, y, N);
    case 5: return tile_512<F, 5, Swiglu>(words, scale, sum, K, source, d, m, y, N);
    case 6: return tile_512<F, 6, Swiglu>(words, scale, sum, K, source, d, m, y, N);
    case 7: return tile_512<F, 7, Swiglu>(words, scale, sum, K, source, d, m, y, N);
    case 8: return tile_512<F, 8, Swiglu>(words, scale, sum, K, source, d, m, y, N);
  }
}

// Panels p and p + 1 for every tile of the step; with several tiles, the `next` panels from
// p + 2 (0 to 2 of them: those this thread takes next) requested meanwhile, their codes, d and
// m spread over the pair's blocks of tiles.
//
// Why: a step of several tiles reads a pair's weights in one short burst (Gathered::gather)
// and then only computes. The hardware prefetchers then stop at the burst's end, and the next
// pair's burst waits on memory: the gate-up's 1.4 MB took its whole transfer time on top of
// the tiles' arithmetic (docs/benchmarks.md, session 32). Issued all at once as a pair
// starts, software prefetches did not help; spread this way a batch-32 decode step of the
// default model took 26.3 ms against 28.5 on a 2-core Zen 4 (docs/benchmarks.md, session
// 33). A step of one tile (up to 8 rows) reads its weights as it goes, and was slower with
// them (batch 1: 4.5 ms against 4.3), so it does not prefetch.
template <typename F, bool Swiglu>
inline void panel_pair_512(int64_t p, const QuantizedRows& q, const Tiles& tiles, int64_t K, const uint8_t* cp,
                           const float* dp, const float* mp, float* yp, int64_t N, __m512i* buffer, int64_t next,
                           PairLines* next_lines, isoserve::LineStream<PairLines>* next_pair,
                           isoserve::LineStream<>* side) {
  const int64_t blocks = K / 32, panel_stride = blocks * kPanel, panel_bytes = blocks * F::Format::kBlockBytes;
  const InPlace<F> in_place{cp + p * panel_bytes};
  if (tiles.count > 1) {
    Gathered<F>::gather(buffer, in_place, blocks);
    const int64_t scale_bytes = next * panel_stride * static_cast<int64_t>(sizeof(float));
    next_lines->clear();
    next_lines->add(cp + (p + 2) * panel_bytes, next * panel_bytes);
    next_lines->add(dp + (p + 2) * panel_stride, scale_bytes);
    if (mp) next_lines->add(mp + (p + 2) * panel_stride, scale_bytes);
    next_pair->start(isoserve::LineSlice<PairLines>::all(*next_lines), tiles.count * blocks);
  }
  const Gathered<F> gathered{buffer, blocks, next_pair, side};
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int64_t r0 = tiles.first_row(t);
    const int rows = static_cast<int>(tiles.first_row(t + 1) - r0);
    const int32_t* words = q.words.get() + r0 * K / 4;
    const float *scale = q.scale.get() + r0 * blocks, *sum = q.sum.get() + r0 * blocks;
    const float *d = dp + p * panel_stride, *m = mp ? mp + p * panel_stride : nullptr;
    float* y = yp + r0 * N + (Swiglu ? p / 2 : p) * kPanel;
    if (tiles.count > 1)
      tile_512_of<F, Swiglu>(rows, words, scale, sum, K, gathered, d, m, y, N);
    else
      tile_512_of<F, Swiglu>(rows, words, scale, sum, K, in_place, d, m, y, N);
  }
}

template <typename Format> struct Zmm;
template <> struct Zmm<Q4_1> { using type = Q4_1x16; };
template <> struct Zmm<Q8_0> { using type = Q8_0x16; };

// Every pair of panels by the tiles above; an odd panel count's last panel by AVX2's, over the
// rows quantized again for those (unflipped, in tiles of 4).
template <typename Format, bool Swiglu>
void all_panels(const at::Tensor& x, int64_t K, const uint8_t* cp, const float* dp, const float* mp, float* yp,
                int64_t panels, int64_t N, const isoserve::LineSlice<>* side) {
  using F = typename Zmm<Format>::type;
  const int64_t rows = x.size(0), blocks = K / 32;
  const Tiles tiles{rows, (rows + kZmmTile - 1) / kZmmTile};
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), rows, K, tiles, F::kFlip);
  const Tiles narrow{rows, (rows + kTile - 1) / kTile};
  const QuantizedRows last = panels % 2 ? quantize_rows(x.data_ptr<float>(), rows, K, narrow, 0) : QuantizedRows{};
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    std::unique_ptr<__m512i[]> buffer(tiles.count > 1 ? new __m512i[blocks * 9] : nullptr);
    // Used only where the step has several tiles (a step of one tile reads its weights as it
    // goes, and requests nothing); `side`: this thread's share, as its share of the pairs,
    // spread over its tiles' blocks.
    PairLines next_lines;
    isoserve::LineStream<PairLines> next_pair;
    isoserve::LineStream<> side_lines;
    if (side && tiles.count > 1)
      side_lines.start(side->share(begin, end, (panels + 1) / 2), (end - begin) * tiles.count * blocks);
    for (int64_t pair = begin; pair < end; ++pair) {
      if (2 * pair + 1 < panels) {
        const int64_t next = pair + 1 < end ? std::min<int64_t>(2, panels - 2 * pair - 2) : 0;
        panel_pair_512<F, Swiglu>(2 * pair, q, tiles, K, cp, dp, mp, yp, N, buffer.get(), next, &next_lines,
                                  &next_pair, &side_lines);
      } else if constexpr (!Swiglu) {
        std::unique_ptr<__m256i[]> wide(new __m256i[blocks * 8 * Format::kVectors]);
        panels_for_all_tiles<Format, 1, false>(2 * pair, last, narrow, K, cp, dp, mp, yp, N, wide.get());
      }
    }
  });
}
#else
// Every pair of panels (and an odd panel count's last one) by the tiles above. No side lines:
// prefetching slowed these tiles (session 33), and requesting KV from them is unmeasured.
template <typename Format, bool Swiglu>
void all_panels(const at::Tensor& x, int64_t K, const uint8_t* cp, const float* dp, const float* mp, float* yp,
                int64_t panels, int64_t N, const isoserve::LineSlice<>*) {
  const int64_t rows = x.size(0), blocks = K / 32;
  const Tiles tiles{rows, (rows + kTile - 1) / kTile};
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), rows, K, tiles, 0);
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    // Q4_1, K = 576: 9 KB, in L1; allocated only where the step has several tiles
    std::unique_ptr<__m256i[]> buffer(tiles.count > 1 ? new __m256i[blocks * 8 * 2 * Format::kVectors] : nullptr);
    for (int64_t pair = begin; pair < end; ++pair) {
      if (2 * pair + 1 < panels)
        panels_for_all_tiles<Format, 2, Swiglu>(2 * pair, q, tiles, K, cp, dp, mp, yp, N, buffer.get());
      else if constexpr (!Swiglu)  // an odd panel count's last panel
        panels_for_all_tiles<Format, 1, false>(2 * pair, q, tiles, K, cp, dp, mp, yp, N, buffer.get());
    }
  });
}
#endif

template <typename Format, bool Swiglu = false>
at::Tensor int8_linear(const char* name, const at::Tensor& x, const at::Tensor& codes,
                       const at::Tensor& d, const at::Tensor* m, const isoserve::LineSlice<>* side = nullptr) {
  isoserve::check_block_linear(name, x, codes, d, m, [](int64_t K) { return K / 32 * Format::kBlockBytes; });
  const int64_t rows = x.size(0), K = x.size(1), panels = d.size(0);
  TORCH_CHECK(!Swiglu || panels % 2 == 0, name, " takes pairs of gate and up panels, not ", panels, " panels");
  const int64_t N = (Swiglu ? panels / 2 : panels) * kPanel;  // outputs
  auto y = at::empty({rows, N}, x.options());
  if (rows == 0) return y;
  all_panels<Format, Swiglu>(x, K, codes.data_ptr<uint8_t>(), d.data_ptr<float>(), m ? m->data_ptr<float>() : nullptr,
                             y.data_ptr<float>(), panels, N, side);
  return y;
}
#else
constexpr bool kBuiltForAvx2 = false;
#endif

}  // namespace

// "" when the int8 block matmuls can run here (built with AVX2 and FMA), else why not.
std::string int8_status() {
  return kBuiltForAvx2 ? "" : "the kernels were built for a CPU without AVX2 and FMA";
}

// Which tiles the int8 block matmuls run: "avx512-vnni", "avx2", or "" where they cannot run.
std::string int8_isa() {
#ifdef ISOSERVE_INT8_ZMM
  return "avx512-vnni";
#else
  return kBuiltForAvx2 ? "avx2" : "";
#endif
}

#if defined(__AVX2__) && defined(__FMA__)
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_i8(const at::Tensor& x, int64_t tile_rows,
                                                                bool flipped) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 &&
                  x.size(1) % 32 == 0,
              "quantize_rows_i8 takes x as a contiguous float32 CPU tensor [rows, K], K a multiple of 32");
#ifdef ISOSERVE_INT8_ZMM
  constexpr int64_t kMostTileRows = kZmmTile;
#else
  constexpr int64_t kMostTileRows = kTile;
#endif
  TORCH_CHECK(tile_rows >= 1 && tile_rows <= kMostTileRows, "quantize_rows_i8: tiles of 1 to ", kMostTileRows,
              " rows here, not ", tile_rows);
  const int64_t rows = x.size(0), K = x.size(1), blocks = K / 32;
  auto codes = at::empty({rows, K}, at::kChar);
  auto scale = at::empty({rows, blocks}, at::kFloat), sum = at::empty({rows, blocks}, at::kFloat);
  if (rows == 0) return {codes, scale, sum};
  const Tiles tiles{rows, (rows + tile_rows - 1) / tile_rows};
  const int32_t flip = flipped ? static_cast<int32_t>(0x80808080u) : 0;
  const QuantizedRows q = quantize_rows(x.data_ptr<float>(), rows, K, tiles, flip);
  // Back from the tiles' layout: word (8 b + k) * R + r of a tile holds row r's codes 32 b + 4 k .. + 3.
  int8_t* out = codes.data_ptr<int8_t>();
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int64_t r0 = tiles.first_row(t), R = tiles.first_row(t + 1) - r0;
    const int32_t* tile = q.words.get() + r0 * K / 4;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t w = 0; w < K / 4; ++w) {
        const uint32_t word = static_cast<uint32_t>(tile[w * R + r] ^ flip);
        for (int j = 0; j < 4; ++j) out[(r0 + r) * K + 4 * w + j] = static_cast<int8_t>(word >> (8 * j) & 0xff);
      }
  }
  std::copy(q.scale.get(), q.scale.get() + rows * blocks, scale.data_ptr<float>());
  std::copy(q.sum.get(), q.sum.get() + rows * blocks, sum.data_ptr<float>());
  return {codes, scale, sum};
}

at::Tensor q4_1_linear_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                          const at::Tensor& m, const isoserve::LineSlice<>* side) {
  return int8_linear<Q4_1>("q4_1_linear_i8", x, codes, d, &m, side);
}

at::Tensor q4_1_swiglu_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                          const at::Tensor& m) {
  return int8_linear<Q4_1, true>("q4_1_swiglu_i8", x, codes, d, &m);
}

at::Tensor q8_0_linear_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  return int8_linear<Q8_0>("q8_0_linear_i8", x, codes, d, nullptr);
}
#else
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_i8(const at::Tensor&, int64_t, bool) {
  TORCH_CHECK(false, "quantize_rows_i8 needs a build for a CPU with AVX2 and FMA");
}

at::Tensor q4_1_linear_i8(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                          const isoserve::LineSlice<>*) {
  TORCH_CHECK(false, "q4_1_linear_i8 needs a build for a CPU with AVX2 and FMA");
}

at::Tensor q4_1_swiglu_i8(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "q4_1_swiglu_i8 needs a build for a CPU with AVX2 and FMA");
}

at::Tensor q8_0_linear_i8(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "q8_0_linear_i8 needs a build for a CPU with AVX2 and FMA");
}
#endif
