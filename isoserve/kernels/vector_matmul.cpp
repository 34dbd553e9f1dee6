// y = x W^T in float32 for a GGUF's Q4_1 or Q8_0 weights on AVX2: each block of 32 weights is
// widened to float32 in registers and multiplied there, so a step reads 5 (Q4_1) or 8.5 (Q8_0)
// bits per weight instead of float32's 32 and never writes a dequantized copy.
//
// Why: on a CPU without a native bfloat16 path (AVX2 only, such as AMD Zen 3) isoserve runs in
// float32 (config.native_bfloat16), and a decode step of a few sequences is bound by reading
// the weights: the default model's are 540 MB in float32, ~25 ms at this class of machine's
// memory bandwidth for every token of a lone stream. torch's int4 CPU kernel takes float32
// activations but runs them unvectorized (2.3 ms against 0.2 for float32's matmul, one
// [3072, 576] weight, one row, measured here).
//
// Exactness: a weight is fma(d, q, m) (Q4_1) or d * q (Q8_0) in float32, d and m widened from
// float16: d * q is exact in float32 (11 + 8 bits), so the one rounding is the same as the
// loader's float32 dequantization (d * q + m): these are the float32 path's very weights, and
// only the order of the sums differs from its matmul.
//
// Layout (model/vector_blocks.py builds it; both sides must agree): codes row by row, one
// block of 32 inputs after another. Q4_1: 16 bytes a block, byte j holding input j in its low
// nibble and input j + 16 in its high one (ggml's own order). Q8_0: 32 int8 codes a block.
// d (and m) as float32 [N, K / 32].
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <string>

namespace {

#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kBuiltForAvx2 = true;

inline float sum_lanes(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

// Each format widens one block to its 32 float32 weights, four vectors of 8 inputs in order.
struct Q4_1 {
  static constexpr int64_t kCodeBytes = 16;
  static inline void widen(const uint8_t* codes, float d, float m, __m256 w[4]) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
    const __m128i mask = _mm_set1_epi8(15);
    const __m128i low = _mm_and_si128(bytes, mask), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low)), vd, vm);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8))), vd, vm);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high)), vd, vm);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8))), vd, vm);
  }
};

struct Q8_0 {
  static constexpr int64_t kCodeBytes = 32;
  static inline void widen(const uint8_t* codes, float d, float, __m256 w[4]) {
    const __m256 vd = _mm256_set1_ps(d);
    for (int i = 0; i < 4; ++i) {
      const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), vd);
    }
  }
};

// Outputs [n_begin, n_end) of R rows of x. Each block is widened once for all R rows. A lone
// row keeps four running sums (one per vector of the block), two rows two each, so the adds
// of one sum do not wait on each other; from four rows on, the rows themselves do that.
template <typename Format, int R>
void rows_times_blocks(const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m,
                       float* y, int64_t N, int64_t n_begin, int64_t n_end) {
  constexpr int A = R >= 4 ? 1 : 4 / R;
  const int64_t blocks = K / 32;
  for (int64_t n = n_begin; n < n_end; ++n) {
    __m256 acc[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) acc[r][a] = _mm256_setzero_ps();
    const uint8_t* row_codes = codes + n * blocks * Format::kCodeBytes;
    const float* row_d = d + n * blocks;
    const float* row_m = m ? m + n * blocks : nullptr;
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 w[4];
      Format::widen(row_codes + b * Format::kCodeBytes, row_d[b], row_m ? row_m[b] : 0.0f, w);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + 32 * b;
        for (int i = 0; i < 4; ++i) acc[r][i % A] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xr + 8 * i), acc[r][i % A]);
      }
    }
    for (int r = 0; r < R; ++r) {
      __m256 total = acc[r][0];
      for (int a = 1; a < A; ++a) total = _mm256_add_ps(total, acc[r][a]);
      y[r * N + n] = sum_lanes(total);
    }
  }
}

template <typename Format>
void rows_chunk(int rows, const float* x, int64_t K, const uint8_t* codes, const float* d, const float* m,
                float* y, int64_t N, int64_t n_begin, int64_t n_end) {
  switch (rows) {
    case 1: return rows_times_blocks<Format, 1>(x, K, codes, d, m, y, N, n_begin, n_end);
    case 2: return rows_times_blocks<Format, 2>(x, K, codes, d, m, y, N, n_begin, n_end);
    case 3: return rows_times_blocks<Format, 3>(x, K, codes, d, m, y, N, n_begin, n_end);
    case 4: return rows_times_blocks<Format, 4>(x, K, codes, d, m, y, N, n_begin, n_end);
    case 5: return rows_times_blocks<Format, 5>(x, K, codes, d, m, y, N, n_begin, n_end);
    case 6: return rows_times_blocks<Format, 6>(x, K, codes, d, m, y, N, n_begin, n_end);
    case 7: return rows_times_blocks<Format, 7>(x, K, codes, d, m, y, N, n_begin, n_end);
    default: return rows_times_blocks<Format, 8>(x, K, codes, d, m, y, N, n_begin, n_end);
  }
}
template <typename Format>
torch::Tensor vector_linear(const char* name, int64_t code_bytes, const torch::Tensor& x,
                            const torch::Tensor& codes, const torch::Tensor& d, const torch::Tensor* m) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              name, " takes x as a contiguous float32 CPU tensor [rows, in_features]");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 2, name, " takes d as contiguous float32 [N, K / 32]");
  const int64_t rows = x.size(0), K = x.size(1), N = d.size(0);
  TORCH_CHECK(K % 32 == 0 && d.size(1) == K / 32, name, ": x has ", K, " inputs, d covers ", d.size(1), " blocks of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == N * (K / 32) * code_bytes,
              name, ": ", codes.numel(), " code bytes do not make a [", N, ", ", K, "] weight");
  if (m) TORCH_CHECK(m->scalar_type() == at::kFloat && m->is_contiguous() && m->sizes() == d.sizes(), name, ": m must be shaped as d");
  auto y = torch::empty({rows, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m ? m->data_ptr<float>() : nullptr;
  // Outputs split among threads; each thread reads its outputs' blocks once per 8 rows.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      const int chunk = static_cast<int>(std::min<int64_t>(8, rows - r0));
      rows_chunk<Format>(chunk, xp + r0 * K, K, cp, dp, mp, yp + r0 * N, N, begin, end);
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
torch::Tensor q4_1_linear_f32(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                              const torch::Tensor& m) {
  return vector_linear<Q4_1>("q4_1_linear_f32", 16, x, codes, d, &m);
}

torch::Tensor q8_0_linear_f32(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d) {
  return vector_linear<Q8_0>("q8_0_linear_f32", 32, x, codes, d, nullptr);
}
#else
torch::Tensor q4_1_linear_f32(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "q4_1_linear_f32 needs a build for a CPU with AVX2 and FMA");
}

torch::Tensor q8_0_linear_f32(const torch::Tensor&, const torch::Tensor&, const torch::Tensor&) {
  TORCH_CHECK(false, "q8_0_linear_f32 needs a build for a CPU with AVX2 and FMA");
}
#endif
