// y = x W^T in float32 for a GGUF's Q4_1 or Q8_0 weights on AVX2: each weight is widened to
// float32 on the fly, so a step reads 5 (Q4_1) or 8.5 (Q8_0) bits per weight instead of
// float32's 32.
//
// Why: on a CPU without a native bfloat16 path (AVX2 only, such as AMD Zen 3) isoserve runs in
// float32 (config.native_bfloat16). A decode step of a few sequences is bound by reading the
// weights (540 MB in float32, ~20 ms at this class of machine's memory bandwidth, for every
// token of a lone stream); one of 32 is bound by arithmetic, where the widening must cost little
// next to the multiply-adds. torch's int4 CPU kernel takes float32 activations but runs them
// unvectorized (2.3 ms against 0.2 for float32's matmul, one [3072, 576] weight, one row).
//
// Exactness: a weight is fma(q, d, m) (Q4_1) or q * d (Q8_0) in float32, d and m widened from
// float16: d * q is exact in float32 (11 + 8 bits), so the one rounding is the same as the
// loader's float32 dequantization (d * q + m): these are the float32 path's very weights, and
// only the order of the sums differs from its matmul.
//
// Layout (model/vector_blocks.py builds it; both sides must agree): the outputs in panels of 8.
// A panel holds, for each input k, its 8 outputs' codes side by side, so one load widens to a
// vector of 8 outputs' weights for one input, and a row's sums for the panel are one vector: no
// horizontal sums. Q4_1: one byte per output per pair of inputs (k even in the low nibble, k + 1
// in the high one): [N / 8, K / 2, 8] bytes. Q8_0: [N / 8, K, 8] int8 codes. d (and m) as
// float32 [N / 8, K / 32, 8].
//
// Two ways, by the step's rows (threads split the panels in both; a tile's rows are interleaved
// once per call, [K][R], so each broadcast of an input is a constant offset from one register):
//   up to 8 rows   a panel at a time, each input's weight vector widened in registers and
//                  multiplied by every row of the tile (panel_tile). No buffer: at one row the
//                  step is bound by reading the codes.
//   from 9 rows    a pair of panels widened once into a float32 buffer [K][16], then every tile
//                  of up to 6 rows runs over it: per input two loads, a broadcast and two
//                  multiply-adds per row (packed_tile), the shape of float32 GEMM's own kernels.
//                  One broadcast per multiply-add (the first way) bounds the loop by the
//                  broadcasts at about half the multiply-add rate.
// 30 layers' projections and the LM head on a Zen 3, 2 threads, weights from memory: 1 row
// 7.0-10.7 ms (10.9-13.9 for a kernel that kept each output's blocks together and summed each
// output across lanes); 32 rows 67-82 ms against float32's prepacked matmul's 82-111; 64 rows
// 105-132 against 141-148; 512 rows 1.01-1.09 s against 1.04-1.16; 3,200 rows 7.30 s against
// 7.22. Register tiles of 5-6 rows x 16 outputs without the buffer (19 live registers) spilled
// and ran slower.
#include "tensors.h"

#include <immintrin.h>

#include "block_linear.h"

#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kBuiltForAvx2 = true;
constexpr int kPanel = 8;        // outputs a panel holds: one float32 vector
constexpr int kMaxTile = 8;      // rows of a register tile: 8 sums, d, m, a weight, an input, codes, mask
constexpr int kPackedTile = 6;   // rows of a buffered tile: 12 sums, 2 weights, an input
constexpr int kPackedFrom = 9;   // steps of this many rows and more take the buffered way

// Each format widens the weights of input j of a block for one panel's 8 outputs.
struct Q4_1 {
  static constexpr int64_t code_bytes(int64_t K) { return K / 2 * kPanel; }  // per panel
  static constexpr int64_t kBlockBytes = 16 * kPanel;
  static inline __m256 widen(const uint8_t* block, int j, __m256 d, __m256 m) {
    // Inputs j and j + 1 (j even) share a byte: the load is the same for both, and the
    // compiler keeps it for the second.
    const __m256i both = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + j / 2 * kPanel)));
    const __m256i q = j % 2 ? _mm256_srli_epi32(both, 4) : _mm256_and_si256(both, _mm256_set1_epi32(15));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m);
  }
};

struct Q8_0 {
  static constexpr int64_t code_bytes(int64_t K) { return K * kPanel; }
  static constexpr int64_t kBlockBytes = 32 * kPanel;
  static inline __m256 widen(const uint8_t* block, int j, __m256 d, __m256) {
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + j * kPanel)))), d);
  }
};

// y[r, 8p .. 8p + 8) for the R rows of a tile and panel p. xt is the tile's rows interleaved
// ([K][R]: input k of every row together), so that every load of an input in the unrolled
// block below is one base register and a constant offset. Below 5 rows each row keeps 2 or 4
// sums (inputs taking turns), so that more multiply-adds are in flight (two ports, four cycles
// each) than one sum per row allows; at most 8 sums, which with d, m, the weight, the input and
// (Q4_1) the loaded codes and their mask fit the 16 registers (12 or 14 sums spilled).
template <typename Format, int R>
inline void panel_tile(const float* xt, int64_t K, const uint8_t* codes, const float* d, const float* m,
                       float* y, int64_t N) {
  constexpr int A = R >= 5 ? 1 : R >= 3 ? 2 : 4;  // sums per row
  __m256 acc[A][R];
#pragma GCC unroll 32
  for (int i = 0; i < A * R; ++i) acc[i / R][i % R] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 32; ++b, xt += 32 * R, codes += Format::kBlockBytes) {
    const __m256 vd = _mm256_loadu_ps(d + b * kPanel);
    const __m256 vm = m ? _mm256_loadu_ps(m + b * kPanel) : _mm256_setzero_ps();
#pragma GCC unroll 32
    for (int j = 0; j < 32; ++j) {
      const __m256 w = Format::widen(codes, j, vd, vm);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        acc[j % A][r] = _mm256_fmadd_ps(_mm256_broadcast_ss(xt + j * R + r), w, acc[j % A][r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    __m256 total = acc[0][r];
#pragma GCC unroll 4
    for (int a = 1; a < A; ++a) total = _mm256_add_ps(total, acc[a][r]);
    _mm256_storeu_ps(y + r * N, total);
  }
}

// A panel's weights widened into out[k * stride + i], i < 8.
template <typename Format>
inline void widen_panel(const uint8_t* codes, const float* d, const float* m, int64_t K, float* out, int64_t stride) {
  for (int64_t b = 0; b < K / 32; ++b, codes += Format::kBlockBytes) {
    const __m256 vd = _mm256_loadu_ps(d + b * kPanel);
    const __m256 vm = m ? _mm256_loadu_ps(m + b * kPanel) : _mm256_setzero_ps();
#pragma GCC unroll 32
    for (int j = 0; j < 32; ++j) _mm256_storeu_ps(out + (32 * b + j) * stride, Format::widen(codes, j, vd, vm));
  }
}

// y[r, 16 q .. 16 q + 16) for the R rows of a tile, from the pair of panels widened into w [K][16].
template <int R>
inline void packed_tile(const float* xt, int64_t K, const float* w, float* y, int64_t N) {
  __m256 acc[2][R];
#pragma GCC unroll 16
  for (int i = 0; i < 2 * R; ++i) acc[i / R][i % R] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; ++k, xt += R, w += 2 * kPanel) {
    const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + kPanel);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 x = _mm256_broadcast_ss(xt + r);
      acc[0][r] = _mm256_fmadd_ps(x, w0, acc[0][r]);
      acc[1][r] = _mm256_fmadd_ps(x, w1, acc[1][r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * N, acc[0][r]);
    _mm256_storeu_ps(y + r * N + kPanel, acc[1][r]);
  }
}

template <int... R>
inline void packed_tile_of(int rows, std::integer_sequence<int, R...>, const float* xt, int64_t K, const float* w,
                           float* y, int64_t N) {
  ((rows == R + 1 ? packed_tile<R + 1>(xt, K, w, y, N) : void()), ...);
}

// The tile of `rows` (1 .. kMaxTile) rows, by its unrolled kernel.
template <typename Format, int... R>
inline void tile_of(int rows, std::integer_sequence<int, R...>, const float* xt, int64_t K, const uint8_t* codes,
                    const float* d, const float* m, float* y, int64_t N) {
  ((rows == R + 1 ? panel_tile<Format, R + 1>(xt, K, codes, d, m, y, N) : void()), ...);
}

template <typename Format>
at::Tensor vector_linear(const char* name, const at::Tensor& x, const at::Tensor& codes,
                         const at::Tensor& d, const at::Tensor* m) {
  isoserve::check_block_linear(name, x, codes, d, m, [](int64_t K) { return Format::code_bytes(K); });
  const int64_t rows = x.size(0), K = x.size(1), panels = d.size(0), N = panels * kPanel;
  auto y = at::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m ? m->data_ptr<float>() : nullptr;
  const bool packed = rows >= kPackedFrom && panels % 2 == 0;  // an odd count: the first way
  const int64_t tile_rows = packed ? kPackedTile : kMaxTile;
  // Rows in tiles of equal size (20 rows: 7 + 7 + 6, not 8 + 8 + 4): tile t is rows [r0, r1).
  const int64_t tiles = (rows + tile_rows - 1) / tile_rows;
  const auto first_row = [&](int64_t t) { return rows * t / tiles; };
  std::unique_ptr<float[]> interleaved(new float[rows * K]);  // every element written below
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t r0 = first_row(t), R = first_row(t + 1) - r0;
    float* xt = interleaved.get() + r0 * K;
    for (int64_t r = 0; r < R; ++r)
      for (int64_t k = 0; k < K; ++k) xt[k * R + r] = xp[(r0 + r) * K + k];
  }
  if (packed) {
    at::parallel_for(0, panels / 2, 2, [&](int64_t begin, int64_t end) {
      std::vector<float> w(K * 2 * kPanel);  // 36 KB for K = 576: in L2, read by every tile
      for (int64_t pair = begin; pair < end; ++pair) {
        for (int64_t h = 0; h < 2; ++h) {
          const int64_t p = 2 * pair + h;
          widen_panel<Format>(cp + p * Format::code_bytes(K), dp + p * (K / 32) * kPanel,
                              mp ? mp + p * (K / 32) * kPanel : nullptr, K, w.data() + h * kPanel, 2 * kPanel);
        }
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t r0 = first_row(t);
          packed_tile_of(static_cast<int>(first_row(t + 1) - r0), std::make_integer_sequence<int, kPackedTile>{},
                         interleaved.get() + r0 * K, K, w.data(), yp + r0 * N + 2 * pair * kPanel, N);
        }
      }
    });
    return y;
  }
  at::parallel_for(0, panels, 4, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint8_t* panel_codes = cp + p * Format::code_bytes(K);
      const float* panel_d = dp + p * (K / 32) * kPanel;
      const float* panel_m = mp ? mp + p * (K / 32) * kPanel : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t r0 = first_row(t);
        tile_of<Format>(static_cast<int>(first_row(t + 1) - r0), std::make_integer_sequence<int, kMaxTile>{},
                        interleaved.get() + r0 * K, K, panel_codes, panel_d, panel_m, yp + r0 * N + p * kPanel, N);
      }
    }
  });
  return y;
}
#else
constexpr bool kBuiltForAvx2 = false;
#endif

}  // namespace

// "" when the float32 block matmuls can run here (built with AVX2 and FMA), else why not.
std::string vector_status() {
  return kBuiltForAvx2 ? "" : "the kernels were built for a CPU without AVX2 and FMA";
}

#if defined(__AVX2__) && defined(__FMA__)
at::Tensor q4_1_linear_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                           const at::Tensor& m) {
  return vector_linear<Q4_1>("q4_1_linear_f32", x, codes, d, &m);
}

at::Tensor q8_0_linear_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d) {
  return vector_linear<Q8_0>("q8_0_linear_f32", x, codes, d, nullptr);
}
#else
at::Tensor q4_1_linear_f32(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "q4_1_linear_f32 needs a build for a CPU with AVX2 and FMA");
}

at::Tensor q8_0_linear_f32(const at::Tensor&, const at::Tensor&, const at::Tensor&) {
  TORCH_CHECK(false, "q8_0_linear_f32 needs a build for a CPU with AVX2 and FMA");
}
#endif
