// Fused CPU kernels for the work between a decoder layer's matmuls.
//
// Each kernel replaces a chain of small torch ops whose dispatch cost, not arithmetic, bounds
// a small decode step (~330 us of the 20 ms batch-1 step per layer went to ~50 op calls).
// The elementwise kernels round where the torch reference in model/layer_ops.py rounds, so the
// two paths agree to the last bit or within one rounding of a float32 reduction order. Decode
// attention keeps scores, probabilities and sums in float32 where the reference rounds them to
// the model dtype in between: in bfloat16 it is closer to exact than the reference is
// (tests/test_fused_kernels.py checks both against a float64 definition).
//
// Memory safety is checked here, not assumed: every page id, slot and length a kernel uses to
// address the KV pool is bounds-checked against the pool before any read or write. Ownership
// of those pages is the read guard's job (kv/guard.py), done before the step starts.
#include "tensors.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16x16.h"
#include "f32x8.h"
#include "fp8.h"
#include "entry_points.h"
#include "page_reads.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

// vector_attention.cpp: a float32 pool, and a bfloat16 one (its bits as uint16_t)
bool vector_decode_attention(const float* q, const float* kc, const float* vc, const int64_t* pages,
                             const int64_t* lens, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                             int64_t num_pages, int64_t page_size, int64_t dim, int64_t width, float scale);
bool vector_decode_attention(const float* q, const uint16_t* kc, const uint16_t* vc, const int64_t* pages,
                             const int64_t* lens, float* out, int64_t batch, int64_t heads, int64_t kv_heads,
                             int64_t num_pages, int64_t page_size, int64_t dim, int64_t width, float scale);

namespace {

// Independent accumulators: gcc vectorizes these loops without reassociating float sums.
constexpr int64_t kLanes = 16;

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }
inline float f32(c10::Float8_e4m3fn v) { return isoserve::e4m3_to_float(v.x); }

// The 8-bit KV pool's dtype (config.parse_kv_dtype).
using fp8_t = c10::Float8_e4m3fn;
template <typename KV>
constexpr bool kIsFp8 = std::is_same_v<KV, fp8_t>;

template <typename T>
inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// Sums the lanes pairwise (8 + 8, 4 + 4, ...): a few vector adds, where summing them in turn
// is 16 dependent scalar adds, the bulk of a 64-element dot product.
inline float sum_lanes(float* lanes) {
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t j = 0; j < width; ++j) lanes[j] += lanes[j + width];
  return lanes[0];
}

// exp(x) for float32 in a form gcc vectorizes (std::exp is one libm call per element, and was
// most of the attention kernel's time): exp(x) = 2^n exp(r), n = round(x / ln 2), |r| <= ln2/2,
// ln 2 split in two (Cody-Waite) so r is exact; degree-7 Taylor, relative error < 1e-8 before
// float rounding. Inputs are clamped to [-87, 88], where 2^n stays a normal float. n is rounded
// by adding and subtracting 1.5 * 2^23 (float addition rounds to nearest): std::floor kept gcc
// from vectorizing the loop. Never build this file with -ffast-math, which would fold that away.
inline float fast_exp(float x) {
  const float input = x;
  x = std::min(std::max(x, -87.0f), 88.0f);
  float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  n = n == n ? n : 0.0f;  // NaN in: keep the integer conversion below defined
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.0f / 5040;
  p = p * r + 1.0f / 720;
  p = p * r + 1.0f / 120;
  p = p * r + 1.0f / 24;
  p = p * r + 1.0f / 6;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return input == input ? p * two_n : input;
}

template <typename T>
inline float sum_of_squares(const T* x, int64_t n) {
  float lanes[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t j = 0; j < kLanes; ++j) lanes[j] += f32(x[i + j]) * f32(x[i + j]);
  float sum = 0;
  for (; i < n; ++i) sum += f32(x[i]) * f32(x[i]);
  return sum + sum_lanes(lanes);
}

void check_float_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16,
              name, " must be float32 or bfloat16, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// A KV cache: the model's dtype, or a narrower one (check_kv_dtype says which pairs).
void check_kv_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kFloat8_e4m3fn,
              name, " must be float32, bfloat16 or float8_e4m3fn, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_index(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kLong && t.is_contiguous(),
              name, " must be a contiguous int64 CPU tensor");
}

#define ISOSERVE_DISPATCH(dtype, ...)                                   \
  if ((dtype) == at::kBFloat16) {                                       \
    using scalar_t = c10::BFloat16;                                     \
    __VA_ARGS__();                                                      \
  } else {                                                              \
    using scalar_t = float;                                             \
    __VA_ARGS__();                                                      \
  }

// ---- RMSNorm ----------------------------------------------------------------------------------
// Reference: w * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(dtype), rounded after the
// normalization and again after the weight, as Llama's reference implementation does.

#if ISOSERVE_BF16X16
// One row of rms_norm_rows in bfloat16, n a multiple of 16: the residual add, the sum of squares
// in the same 16 lanes summed by the same tree, and the output, as the scalar loops compute them.
inline void rms_norm_row_bf16(c10::BFloat16* x, const c10::BFloat16* y, const c10::BFloat16* w,
                              c10::BFloat16* out, int64_t n, float eps) {
  using namespace isoserve;
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kLanes) {
    __m512 v = load_bf16x16(x + i);
    if (y != nullptr) {  // the residual sum, rounded once: stored, and squared as stored
      const __m256i sum = bf16x16_bits(_mm512_add_ps(v, load_bf16x16(y + i)));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(x + i), sum);
      v = widen_bf16x16(sum);
    }
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  float lanes[kLanes];
  _mm512_storeu_ps(lanes, squares);
  const __m512 inv = _mm512_set1_ps(1.0f / std::sqrt(sum_lanes(lanes) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += kLanes)
    store_bf16x16_ftz(out + i, _mm512_mul_ps(load_bf16x16(w + i), round_bf16x16_ftz(_mm512_mul_ps(load_bf16x16(x + i), inv))));
}
#endif

template <typename T>
void rms_norm_rows(T* x, const T* residual_in, const T* w, T* out, int64_t rows, int64_t n,
                   float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* xr = x + r * n;
      T* o = out + r * n;
      const T* yr = residual_in != nullptr ? residual_in + r * n : nullptr;
#if ISOSERVE_BF16X16
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (n % kLanes == 0) {
          rms_norm_row_bf16(xr, yr, w, o, n, eps);
          continue;
        }
      }
#endif
      if (yr != nullptr)  // x += y, rounded as torch's add rounds
        for (int64_t i = 0; i < n; ++i) xr[i] = static_cast<T>(f32(xr[i]) + f32(yr[i]));
      const float inv = 1.0f / std::sqrt(sum_of_squares(xr, n) / static_cast<float>(n) + eps);
      for (int64_t i = 0; i < n; ++i) o[i] = static_cast<T>(f32(w[i]) * round_to<T>(f32(xr[i]) * inv));
    }
  });
}

void check_norm(const at::Tensor& x, const at::Tensor& w) {
  check_float_cpu(x, "x");
  check_float_cpu(w, "weight");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && w.size(0) == x.size(1),
              "rms_norm takes x [rows, n] and weight [n]");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "x and weight must share a dtype");
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_norm(x, w);
  auto out = at::empty_like(x);
  ISOSERVE_DISPATCH(x.scalar_type(), [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

// Declared in entry_points.h: decoder_stack.cpp calls it too.
// x += y in place (the residual stream), then returns rms_norm(x).
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& y, const at::Tensor& w, double eps) {
  check_norm(x, w);
  check_float_cpu(y, "y");
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == x.scalar_type(),
              "add_rms_norm: y must match x in shape and dtype");
  auto out = at::empty_like(x);
  ISOSERVE_DISPATCH(x.scalar_type(), [&] {
    rms_norm_rows<scalar_t>(x.data_ptr<scalar_t>(), y.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1), static_cast<float>(eps));
  });
  return out;
}

namespace {

// ---- SwiGLU -----------------------------------------------------------------------------------
// Reference: silu(gate) * up over the halves of the merged gate-up projection, each rounded.

template <typename T>
void silu_mul_rows(const T* in, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = in + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
      int64_t i = 0;
#if ISOSERVE_BF16X16
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        using namespace isoserve;
        const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
        for (; i + kLanes <= n; i += kLanes) {
          const __m512 x = load_bf16x16(g + i);
          const __m512 silu = round_bf16x16_ftz(_mm512_div_ps(x, _mm512_add_ps(one, exp16(_mm512_xor_ps(x, sign)))));
          store_bf16x16_ftz(o + i, _mm512_mul_ps(silu, load_bf16x16(u + i)));
        }
      }
#endif
#if ISOSERVE_AVX2_FMA
      // float32 on AVX2 (measured on a Zen 3; AVX-512 builds take it too, unmeasured there):
      // gcc's vectorization of the scalar loop below took ~3.8 ns an element. The int8 gate-up
      // kernel computes the same lanes in its epilogue (silu_times8); a row's last n % 8 take
      // the scalar loop's fast_exp, which can differ from exp8 by an ulp.
      if constexpr (std::is_same_v<T, float>) {
        for (; i + 8 <= n; i += 8)
          _mm256_storeu_ps(o + i, isoserve::silu_times8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < n; ++i) {
        const float x = f32(g[i]);
        o[i] = static_cast<T>(round_to<T>(x / (1.0f + fast_exp(-x))) * f32(u[i]));
      }
    }
  });
}

}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_float_cpu(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "silu_mul takes [rows, 2 * n]");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = at::empty({rows, n}, gate_up.options());
  ISOSERVE_DISPATCH(gate_up.scalar_type(), [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, n);
  });
  return out;
}

namespace {

// ---- The pool's dtype -------------------------------------------------------------------------
// The pool dtypes a model dtype reads and writes: its own, and bfloat16 under float32 (half the
// bytes a decode step reads, twice the tokens a pool holds; config.parse_kv_dtype).
void check_kv_dtype(at::ScalarType model, at::ScalarType kv) {
  const bool fp8 = kv == at::kFloat8_e4m3fn && (model == at::kFloat || model == at::kBFloat16);
  TORCH_CHECK(kv == model || (model == at::kFloat && kv == at::kBFloat16) || fp8,
              "a ", c10::toString(model), " model cannot use a ", c10::toString(kv), " KV pool");
}

// Runs fn with scalar_t (the model's dtype) and kv_t (the pool's), for the pairs check_kv_dtype allows.
#define ISOSERVE_DISPATCH_KV(model, kv, ...)                            \
  check_kv_dtype(model, kv);                                            \
  if ((model) == at::kFloat && (kv) == at::kBFloat16) {                 \
    using scalar_t = float;                                             \
    using kv_t = c10::BFloat16;                                         \
    __VA_ARGS__();                                                      \
  } else if ((kv) == at::kFloat8_e4m3fn) {                              \
    ISOSERVE_DISPATCH(model, [&] {                                      \
      using kv_t = fp8_t;                                               \
      __VA_ARGS__();                                                    \
    });                                                                 \
  } else {                                                              \
    ISOSERVE_DISPATCH(model, [&] {                                      \
      using kv_t = scalar_t;                                            \
      __VA_ARGS__();                                                    \
    });                                                                 \
  }

// ---- RoPE + KV write --------------------------------------------------------------------------
// qkv [T, (H + 2 Hkv) D] from the merged projection. Rotates Q and K (x * cos + rotate_half(x)
// * sin, each product and the sum rounded), returns Q as [T, H, D] and writes K and V into the
// layer's cache [Hkv, pages * page_size, D] at each token's slot.

template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* out, int64_t dim) {
  const int64_t half = dim / 2;
#if ISOSERVE_BF16X16
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (half % kLanes == 0) {
      using namespace isoserve;
      const __m512 sign = _mm512_set1_ps(-0.0f);
      for (int64_t d = 0; d < half; d += kLanes) {
        const __m512 low = load_bf16x16(x + d), high = load_bf16x16(x + d + half);
        store_bf16x16_ftz(out + d, _mm512_add_ps(round_bf16x16_ftz(_mm512_mul_ps(low, load_bf16x16(c + d))),
                                                 round_bf16x16_ftz(_mm512_mul_ps(_mm512_xor_ps(high, sign), load_bf16x16(s + d)))));
        store_bf16x16_ftz(out + d + half, _mm512_add_ps(round_bf16x16_ftz(_mm512_mul_ps(high, load_bf16x16(c + d + half))),
                                                        round_bf16x16_ftz(_mm512_mul_ps(low, load_bf16x16(s + d + half)))));
      }
      return;
    }
  }
#endif
  for (int64_t d = 0; d < half; ++d)
    out[d] = static_cast<T>(round_to<T>(f32(x[d]) * f32(c[d])) + round_to<T>(-f32(x[d + half]) * f32(s[d])));
  for (int64_t d = half; d < dim; ++d)
    out[d] = static_cast<T>(round_to<T>(f32(x[d]) * f32(c[d])) + round_to<T>(f32(x[d - half]) * f32(s[d])));
}

// n values of T (float32 or bfloat16) as float8 codes, 16 at a time (fp8.h), rounded as
// torch's .to() rounds.
template <typename T>
inline void store_fp8(const T* x, fp8_t* out, int64_t n) {
  auto* codes = reinterpret_cast<uint8_t*>(out);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    isoserve::fp8_floats v;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(&v, x + i, sizeof v);
    } else {
#if ISOSERVE_BF16X16
      v = reinterpret_cast<isoserve::fp8_floats>(isoserve::load_bf16x16(x + i));
#else
      for (int j = 0; j < 16; ++j) v[j] = f32(x[i + j]);
#endif
    }
    isoserve::floats_to_e4m3(v, codes + i);
  }
  for (; i < n; ++i) codes[i] = isoserve::float_to_e4m3(f32(x[i]));
}

// The pool's dtype KV may be narrower than the model's T (bfloat16 or float8 under float32,
// float8 under bfloat16): K is rotated in T, then each element rounded to KV (to nearest
// even, as torch's .to() does).
template <typename T, typename KV>
void rotary_rows(const T* qkv, const T* cos, const T* sin, const int64_t* slot, T* q, KV* kc, KV* vc,
                 int64_t tokens, int64_t heads, int64_t kv_heads, int64_t dim, int64_t cache_slots) {
  const int64_t width = (heads + 2 * kv_heads) * dim;
  at::parallel_for(0, tokens, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> rotated(std::is_same_v<T, KV> ? 0 : dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* row = qkv + t * width;
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) rotate(row + h * dim, c, s, q + (t * heads + h) * dim, dim);
      for (int64_t h = 0; h < kv_heads; ++h) {
        KV* key = kc + (h * cache_slots + slot[t]) * dim;
        KV* value = vc + (h * cache_slots + slot[t]) * dim;
        const T* v = row + (heads + kv_heads + h) * dim;
        if constexpr (std::is_same_v<T, KV>) {
          rotate(row + (heads + h) * dim, c, s, key, dim);
          std::copy_n(v, dim, value);
        } else if constexpr (kIsFp8<KV>) {
          rotate(row + (heads + h) * dim, c, s, rotated.data(), dim);
          store_fp8(rotated.data(), key, dim);
          store_fp8(v, value, dim);
        } else {
          rotate(row + (heads + h) * dim, c, s, rotated.data(), dim);
          for (int64_t d = 0; d < dim; ++d) key[d] = static_cast<KV>(f32(rotated[d])), value[d] = static_cast<KV>(f32(v[d]));
        }
      }
    }
  });
}

}  // namespace

// Declared in entry_points.h: decoder_stack.cpp calls it too.
at::Tensor rotary_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                        int64_t heads) {
  check_float_cpu(qkv, "qkv");
  check_float_cpu(cos, "cos");
  check_float_cpu(sin, "sin");
  check_kv_cpu(k_cache, "k_cache");
  check_kv_cpu(v_cache, "v_cache");
  check_index(slots, "slots");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "caches must be [kv_heads, pages, page_size, head_dim]");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(0), dim = k_cache.size(3);
  const int64_t cache_slots = k_cache.size(1) * k_cache.size(2);
  TORCH_CHECK(heads > 0 && kv_heads > 0, "rotary_store needs query and KV heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv must be [tokens, (heads + 2 kv_heads) * head_dim]");
  TORCH_CHECK(dim % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.numel() == tokens * dim && sin.numel() == tokens * dim && slots.numel() == tokens,
              "cos, sin and slots must have one row per token");
  const auto dtype = qkv.scalar_type();
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype, "qkv, cos and sin must share a dtype");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the K and V caches must share a dtype");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < cache_slots, "KV slot ", slot[t], " is outside the pool");
  auto q = at::empty({tokens, heads, dim}, qkv.options());
  ISOSERVE_DISPATCH_KV(dtype, k_cache.scalar_type(), [&] {
    rotary_rows<scalar_t, kv_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                                slot, q.data_ptr<scalar_t>(), k_cache.data_ptr<kv_t>(),
                                v_cache.data_ptr<kv_t>(), tokens, heads, kv_heads, dim, cache_slots);
  });
  return q;
}

namespace {

// ---- Decode attention over pages, in place ----------------------------------------------------
// One query token per sequence. For each (sequence, KV head), the group's query heads score the
// first lens[b] keys of the pages in the sequence's page table, read where they lie in the pool
// (no gathered copy), softmax in float32, and sum the values in float32.
//
// The arithmetic is written on 16-float vectors (GCC vector extensions: AVX-512 registers here,
// split into narrower ones by the compiler where the CPU has none). A 64-wide head is 4 of them.
// A key's score against a query is a dot product, which ends in a horizontal sum; done per key,
// those sums were most of this kernel's time. Here 16 keys are scored at once: each leaves a
// vector of partial products, and one transpose-and-add tree folds the 16 vectors into one
// vector holding the 16 scores (15 two-source shuffles and adds, not 16 separate reductions).

typedef float vfloat16 __attribute__((vector_size(64)));
typedef uint16_t vhalf16 __attribute__((vector_size(32)));
typedef uint32_t vword16 __attribute__((vector_size(64)));
constexpr int64_t kBlock = 16;  // keys scored together, and floats per vector

inline vfloat16 load16(const float* p) {
  vfloat16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// bfloat16 is the top half of a float32: widen each lane and shift it up.
inline vfloat16 load16(const c10::BFloat16* p) {
  vhalf16 h;
  std::memcpy(&h, p, sizeof h);
  return reinterpret_cast<vfloat16>(__builtin_convertvector(h, vword16) << 16);
}

// float8 codes (fp8.h).
inline vfloat16 load16(const fp8_t* p) {
  return isoserve::e4m3_to_floats(reinterpret_cast<const uint8_t*>(p));
}

// The first n (< 16) elements, zeros after: a head_dim that is no multiple of 16 ends in one.
template <typename T>
inline vfloat16 load_partial16(const T* p, int64_t n) {
  float lanes[kBlock] = {0};
  for (int64_t i = 0; i < n; ++i) lanes[i] = f32(p[i]);
  return load16(lanes);
}

template <typename T>
inline vfloat16 load_chunk(const T* p, int64_t c, int64_t dim) {
  const int64_t n = std::min(kBlock, dim - c * kBlock);
  return n == kBlock ? load16(p + c * kBlock) : load_partial16(p + c * kBlock, n);
}

// Lane i of the result is the sum of the lanes of v[i]. Each level adds the two halves of every
// vector, packing two vectors' halves into one, so 16 vectors fold in 8 + 4 + 2 + 1 steps.
inline vfloat16 sum_each(vfloat16* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7,
                                   16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                   24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11,
                                   16, 17, 18, 19, 24, 25, 26, 27) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15,
                                   20, 21, 22, 23, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13,
                                   16, 17, 20, 21, 24, 25, 28, 29) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15,
                                   18, 19, 22, 23, 26, 27, 30, 31);
  return __builtin_shufflevector(v[0], v[1], 0, 2, 4, 6, 8, 10, 12, 14,
                                 16, 18, 20, 22, 24, 26, 28, 30) +
         __builtin_shufflevector(v[0], v[1], 1, 3, 5, 7, 9, 11, 13, 15,
                                 17, 19, 21, 23, 25, 27, 29, 31);
}

// Scores by the CPU's bfloat16 dot product (AVX512-BF16's vdpbf16ps), where it has one: each
// float32 lane adds the exact products of two bfloat16 pairs, so a 64-wide key is 2
// instructions per query head instead of 4 conversions and 4 multiply-adds, and the query is
// used as it is, scaled after the sum. The products are those of the float32 path; the sums
// differ only in order (and inputs below bfloat16's normal range count as zero).
#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
inline __m512bh load_bf16_pairs(const c10::BFloat16* p) {
  return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
}
#else
constexpr bool kHaveBf16Dot = false;
#endif

// Pools whose rows come as bfloat16 pairs, for the dot product and the paired values below:
// bfloat16, and float8 widened to it 32 codes at a time (fp8.h, AVX-512).
template <typename KV>
constexpr bool kBf16PairsKV = std::is_same_v<KV, c10::BFloat16> || (kIsFp8<KV> && ISOSERVE_FP8_AVX512);

// Cache lines [share * per, (share + 1) * per) of a page `lines` long, into L1 (Locality 3) or
// L2 (1).
template <int Locality>
inline void prefetch_share(const void* page, int64_t share, int64_t per, int64_t lines) {
  const char* p = static_cast<const char*>(page);
  for (int64_t l = share * per; l < std::min((share + 1) * per, lines); ++l) __builtin_prefetch(p + l * 64, 0, Locality);
}

// `Lines` cache lines from `p` into L1 (Locality 3) or L2 (1).
template <int Locality, int64_t Lines>
inline void prefetch_lines(const void* p) {
  for (int64_t l = 0; l < Lines; ++l) __builtin_prefetch(static_cast<const char*>(p) + l * 64, 0, Locality);
}

// Values in pairs of dims (the loop below): such a pool with a fixed, even number of chunks.
template <typename KV, int C>
constexpr bool kPairedValues = kBf16PairsKV<KV> && C > 0 && C % 2 == 0;

// 32 values of a pool row as 16 words of bfloat16 pairs (kBf16PairsKV pools only).
inline vword16 bf16_words(const c10::BFloat16* p) {
  vword16 words;
  std::memcpy(&words, p, sizeof words);
  return words;
}
#if ISOSERVE_FP8_AVX512
inline vword16 bf16_words(const fp8_t* p) {
  return reinterpret_cast<vword16>(isoserve::e4m3_to_bf16x32(reinterpret_cast<const uint8_t*>(p)));
}
#endif

// The first 32 N values of a pool row as N vectors of bfloat16 pairs (kBf16PairsKV pools): a
// float8 row 64 codes at a time where the CPU has AVX512-VBMI (fp8.h).
template <int N, typename KV>
inline void bf16_row(const KV* p, vword16* words) {
#if ISOSERVE_FP8_VBMI
  if constexpr (kIsFp8<KV> && N % 2 == 0) {
    for (int i = 0; i < N; i += 2) {
      __m512i first, second;
      isoserve::e4m3_to_bf16x64(reinterpret_cast<const uint8_t*>(p + 32 * i), first, second);
      words[i] = reinterpret_cast<vword16>(first);
      words[i + 1] = reinterpret_cast<vword16>(second);
    }
    return;
  }
#endif
  for (int i = 0; i < N; ++i) words[i] = bf16_words(p + 32 * i);
}

// One (sequence, KV head) task. C and G, when not 0, fix the number of 16-float chunks in a head
// and the query heads per KV head at compile time: the loops over them unroll and the query and
// accumulator vectors stay in registers. 0 takes them from the shapes at run time. DOT scores
// with the bfloat16 dot product above (bfloat16, C a multiple of 2, and a CPU that has it). KV is
// the pool's dtype: T, or bfloat16 under float32 (check_kv_dtype).
template <typename T, typename KV, int C, int G, bool DOT = false>
void attend(const T* q, const KV* kc, const KV* vc, const int64_t* pages, const int64_t* lens, T* out,
            int64_t heads, int64_t kv_heads, int64_t num_pages, int64_t page_size, int64_t dim,
            int64_t width, float scale, int64_t begin, int64_t end) {
  const int64_t chunks = C ? C : (dim + kBlock - 1) / kBlock, group = G ? G : heads / kv_heads;
  // Cache lines in one key's row when the shape is fixed and a row is whole lines, else 0.
  constexpr int64_t kRowBytes = C * kBlock * static_cast<int64_t>(sizeof(KV));
  constexpr int64_t kRowLines = C && kRowBytes % 64 == 0 ? kRowBytes / 64 : 0;
  const int64_t page_stride = page_size * dim, head_stride = num_pages * page_stride;
  const int64_t page_lines = (page_stride * static_cast<int64_t>(sizeof(KV)) + 63) / 64;
  const int64_t lines_per_key = (page_lines + page_size - 1) / page_size;
  std::vector<vfloat16> q_any(C ? 0 : group * chunks), acc_any(C ? 0 : group * chunks),
      parts_any(C ? 0 : group * kBlock);
  vfloat16 q_fixed[C ? C * G : 1], acc_fixed[C ? C * G : 1], parts_fixed[C ? G * kBlock : 1];
  vfloat16* qv = C ? q_fixed : q_any.data();
  vfloat16* acc = C ? acc_fixed : acc_any.data();
  vfloat16* parts = C ? parts_fixed : parts_any.data();
#if defined(__AVX512BF16__)
  __m512bh q_pairs[DOT ? C / 2 * G : 1];
#endif
  std::vector<float> scores, total(group);
  for (int64_t task = begin; task < end; ++task) {
    const int64_t b = task / kv_heads, h = task % kv_heads, len = lens[b];
    const int64_t* table = pages + b * width;
    const T* q_head = q + (b * heads + h * group) * dim;
    // The query as the scores use it: raw bfloat16 pairs for the dot product (scaled after the
    // sum), else scaled float32 vectors.
#if defined(__AVX512BF16__)
    if constexpr (DOT)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t p = 0; p < C / 2; ++p) q_pairs[g * C / 2 + p] = load_bf16_pairs(q_head + g * dim + p * 2 * kBlock);
#endif
    if constexpr (!DOT)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < chunks; ++c) qv[g * chunks + c] = load_chunk(q_head + g * dim, c, dim) * scale;
    // Scores, padded to whole blocks so each block stores one full vector per query head. Keys
    // are walked page by page, slot by slot (no division per key); each is converted once and
    // dotted with every query head of the group.
    const int64_t padded = (len + kBlock - 1) / kBlock * kBlock;
    scores.resize(group * padded);
    const KV* k_head = kc + h * head_stride;
    const KV* v_head = vc + h * head_stride;
    const int64_t pages_read = (len + page_size - 1) / page_size;
    int64_t page = 0, slot = 0;
    for (int64_t start = 0; start < len; start += kBlock) {
      const int64_t n = std::min(kBlock, len - start);
      for (int64_t s = 0; s < kBlock; ++s) {
        if (s >= n) {
          for (int64_t g = 0; g < group; ++g) parts[g * kBlock + s] = vfloat16{};
          continue;
        }
        const KV* key = k_head + table[page] * page_stride + slot * dim;
        // A sequence's pages lie anywhere in the pool, so the hardware prefetcher cannot guess
        // the next one. With each key comes its share of the next page's keys (into L1, read
        // next) and of this page's values (into L2, for the second pass). Issued all at once at
        // a page's first key, the 64 prefetches held up the loads they were meant to help: the
        // kernel took 13% longer at batch 32 in the engine, 20-30% in a 30-layer bench.
        if constexpr (kRowLines > 0) {
          // A key's row is whole cache lines: its share is its own row, the same slot's.
          if (page + 1 < pages_read) prefetch_lines<3, kRowLines>(k_head + table[page + 1] * page_stride + slot * dim);
          prefetch_lines<1, kRowLines>(v_head + table[page] * page_stride + slot * dim);
        } else {
          if (page + 1 < pages_read)
            prefetch_share<3>(k_head + table[page + 1] * page_stride, slot, lines_per_key, page_lines);
          prefetch_share<1>(v_head + table[page] * page_stride, slot, lines_per_key, page_lines);
        }
        if (++slot == page_size) slot = 0, ++page;
#if defined(__AVX512BF16__)
        if constexpr (DOT) {
          static_assert(std::is_same_v<T, c10::BFloat16> && kBf16PairsKV<KV> && C % 2 == 0 && C > 0);
          vword16 pairs[C / 2];
          bf16_row<C / 2>(key, pairs);
          for (int64_t p = 0; p < C / 2; ++p) {
            const __m512bh k = reinterpret_cast<__m512bh>(pairs[p]);
            for (int64_t g = 0; g < G; ++g) {
              const __m512 sum = p ? reinterpret_cast<__m512>(parts[g * kBlock + s]) : _mm512_setzero_ps();
              parts[g * kBlock + s] = reinterpret_cast<vfloat16>(_mm512_dpbf16_ps(sum, q_pairs[g * C / 2 + p], k));
            }
          }
          continue;
        }
#endif
        for (int64_t c = 0; c < chunks; ++c) {
          const vfloat16 k = load_chunk(key, c, dim);
          for (int64_t g = 0; g < group; ++g)
            parts[g * kBlock + s] = (c ? parts[g * kBlock + s] : vfloat16{}) + qv[g * chunks + c] * k;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const vfloat16 block = DOT ? sum_each(parts + g * kBlock) * scale : sum_each(parts + g * kBlock);
        std::memcpy(scores.data() + g * padded + start, &block, sizeof block);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      float* sc = scores.data() + g * padded;
      float tops[kLanes], top = sc[0];
      std::fill(tops, tops + kLanes, sc[0]);
      int64_t i = 0;
      for (; i + kLanes <= len; i += kLanes)
        for (int64_t j = 0; j < kLanes; ++j) tops[j] = std::max(tops[j], sc[i + j]);
      for (; i < len; ++i) top = std::max(top, sc[i]);
      for (int64_t j = 0; j < kLanes; ++j) top = std::max(top, tops[j]);
      int64_t e = 0;
#if ISOSERVE_BF16X16
      for (const __m512 top16 = _mm512_set1_ps(top); e + kLanes <= len; e += kLanes)
        _mm512_storeu_ps(sc + e, isoserve::exp16(_mm512_sub_ps(_mm512_loadu_ps(sc + e), top16)));
#endif
      for (; e < len; ++e) sc[e] = fast_exp(sc[e] - top);
      float lanes[kLanes] = {0}, sum = 0;
      int64_t t = 0;
      for (; t + kLanes <= len; t += kLanes)
        for (int64_t j = 0; j < kLanes; ++j) lanes[j] += sc[t + j];
      for (; t < len; ++t) sum += sc[t];
      total[g] = sum + sum_lanes(lanes);
    }
    // Values: each converted once, added into every query head's sum with its weight.
    for (int64_t i = 0; i < group * chunks; ++i) acc[i] = vfloat16{};
    if constexpr (kPairedValues<KV, C>) {
      // bfloat16 values read 32 at a time as 16 words: a word's high half is the odd dim's
      // float32 with its low half cleared, its low half shifted up the even dim's. Two
      // instructions per 32 dims where widening 16 at a time takes four; each dim's sum is
      // the same multiply-adds in the same order, so the output is the same to the bit.
      // acc[g * C + 2 p] holds dims 32 p + 2 i, acc[g * C + 2 p + 1] dims 32 p + 2 i + 1.
      for (int64_t start = 0, p = 0; start < len; start += page_size, ++p) {
        const int64_t n = std::min(page_size, len - start);
        const KV* values = v_head + table[p] * page_stride;
        for (int64_t s = 0; s < n; ++s) {
          vword16 row[C / 2];
          bf16_row<C / 2>(values + s * dim, row);
          for (int64_t c = 0; c < C / 2; ++c) {
            const vword16 words = row[c];
            const vfloat16 even = reinterpret_cast<vfloat16>(words << 16);
            const vfloat16 odd = reinterpret_cast<vfloat16>(words & 0xFFFF0000u);
            for (int64_t g = 0; g < G; ++g) {
              const float weight = scores[g * padded + start + s];
              acc[g * C + 2 * c] += weight * even;
              acc[g * C + 2 * c + 1] += weight * odd;
            }
          }
        }
      }
      T* o = out + (b * heads + h * group) * dim;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t c = 0; c < C / 2; ++c) {
          float even[kBlock], odd[kBlock];
          const vfloat16 even_mean = acc[g * C + 2 * c] / total[g], odd_mean = acc[g * C + 2 * c + 1] / total[g];
          std::memcpy(even, &even_mean, sizeof even);
          std::memcpy(odd, &odd_mean, sizeof odd);
          for (int64_t i = 0; i < kBlock; ++i) {
            o[g * dim + c * 2 * kBlock + 2 * i] = static_cast<T>(even[i]);
            o[g * dim + c * 2 * kBlock + 2 * i + 1] = static_cast<T>(odd[i]);
          }
        }
      continue;
    }
    for (int64_t start = 0, p = 0; start < len; start += page_size, ++p) {
      const int64_t n = std::min(page_size, len - start);
      const KV* values = v_head + table[p] * page_stride;
      for (int64_t s = 0; s < n; ++s)
        for (int64_t c = 0; c < chunks; ++c) {
          const vfloat16 v = load_chunk(values + s * dim, c, dim);
          for (int64_t g = 0; g < group; ++g) acc[g * chunks + c] += scores[g * padded + start + s] * v;
        }
    }
    T* o = out + (b * heads + h * group) * dim;
    for (int64_t g = 0; g < group; ++g) {
      float row[kBlock];
      for (int64_t c = 0; c < chunks; ++c) {
        const vfloat16 mean = acc[g * chunks + c] / total[g];
        std::memcpy(row, &mean, sizeof row);
        for (int64_t i = 0; i < std::min(kBlock, dim - c * kBlock); ++i) o[g * dim + c * kBlock + i] = static_cast<T>(row[i]);
      }
    }
  }
}

template <typename T, typename KV>
void decode_attention_impl(const T* q, const KV* kc, const KV* vc, const int64_t* pages,
                           const int64_t* lens, T* out, int64_t batch, int64_t heads,
                           int64_t kv_heads, int64_t num_pages, int64_t page_size, int64_t dim,
                           int64_t width, float scale, bool bf16_dot) {
  const int64_t group = heads / kv_heads;
  // float32 on AVX2 (vector_attention.cpp), where this kernel's 16-float vectors spill
  if constexpr (std::is_same_v<T, float> && std::is_same_v<KV, float>) {
    if (vector_decode_attention(q, kc, vc, pages, lens, out, batch, heads, kv_heads, num_pages, page_size, dim,
                                width, scale))
      return;
  } else if constexpr (std::is_same_v<T, float> && std::is_same_v<KV, c10::BFloat16>) {
    if (vector_decode_attention(q, reinterpret_cast<const uint16_t*>(kc), reinterpret_cast<const uint16_t*>(vc),
                                pages, lens, out, batch, heads, kv_heads, num_pages, page_size, dim, width, scale))
      return;
  }
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // The default model's shape (SmolLM2: 64-wide heads, 3 query heads per KV head) runs
    // unrolled, ~1.6x faster; any other runs the same code with its shape read at run time.
    // In bfloat16 it scores by the dot-product instruction where the CPU has one (unless the
    // caller asks for the float32 path): 20-27% faster with the KV in cache, ~5% at batch 32
    // of the default model, where reading the KV from memory bounds the kernel.
    constexpr bool dot = std::is_same_v<T, c10::BFloat16> && kBf16PairsKV<KV> && kHaveBf16Dot;
    if (dot && bf16_dot && dim == 64 && group == 3)
      attend<T, KV, 4, 3, dot>(q, kc, vc, pages, lens, out, heads, kv_heads, num_pages, page_size, dim, width, scale, begin, end);
    else if (dim == 64 && group == 3)
      attend<T, KV, 4, 3>(q, kc, vc, pages, lens, out, heads, kv_heads, num_pages, page_size, dim, width, scale, begin, end);
    else
      attend<T, KV, 0, 0>(q, kc, vc, pages, lens, out, heads, kv_heads, num_pages, page_size, dim, width, scale, begin, end);
  });
}

}  // namespace

// Declared in entry_points.h: decoder_stack.cpp calls it too.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& pages,
                            const at::Tensor& lens, double scale, bool bf16_dot) {
  check_float_cpu(q, "q");
  check_kv_cpu(k_cache, "k_cache");
  check_kv_cpu(v_cache, "v_cache");
  check_index(pages, "pages");
  check_index(lens, "lens");
  TORCH_CHECK(q.dim() == 3, "q must be [batch, heads, head_dim]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "caches must be [kv_heads, pages, page_size, head_dim]");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "the K and V caches must share a dtype");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_pages = k_cache.size(1), page_size = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == dim, "q and the caches disagree on head_dim");
  TORCH_CHECK(kv_heads > 0 && heads > 0 && heads % kv_heads == 0,
              "query heads must be a positive multiple of KV heads");
  TORCH_CHECK(pages.dim() == 2 && pages.size(0) == batch && lens.numel() == batch,
              "pages must be [batch, width] and lens [batch]");
  const int64_t width = pages.size(1);
  const int64_t* table = pages.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    isoserve::check_page_reads(table + b * width, width, len[b], 1, page_size, num_pages, "sequence", b);
  auto out = at::empty_like(q);
  ISOSERVE_DISPATCH_KV(q.scalar_type(), k_cache.scalar_type(), [&] {
    decode_attention_impl<scalar_t, kv_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<kv_t>(),
                                         v_cache.data_ptr<kv_t>(), table, len, out.data_ptr<scalar_t>(),
                                         batch, heads, kv_heads, num_pages, page_size, dim, width,
                                         static_cast<float>(scale), bf16_dot);
  });
  return out;
}

bool has_bf16_dot() { return kHaveBf16Dot; }
bool fast_fp8_kv() { return ISOSERVE_FP8_AVX512; }
#if ISOSERVE_F32X8
bool has_f32x8() { return true; }
#else
bool has_f32x8() { return false; }
#endif

// ---- A float8 pool's pages as bfloat16 ----------------------------------------------------------
// cache [kv_heads, pages, page_size, dim] of float8 codes -> [kv_heads, len(pages), page_size,
// dim] bfloat16 holding the same values (every e4m3 value is a bfloat16): the pages a step's
// prefill chunks read, for the AMX prefill kernel, which takes bfloat16 tiles. torch's own
// conversion took ~2.2 ns an element here, 90 ms of a 32-prompt prefill step; this ~0.1.

at::Tensor fp8_pages_to_bf16(const at::Tensor& cache, const at::Tensor& pages) {
  TORCH_CHECK(cache.device().is_cpu() && cache.scalar_type() == at::kFloat8_e4m3fn && cache.is_contiguous() &&
                  cache.dim() == 4,
              "cache must be a contiguous float8_e4m3fn CPU tensor [kv_heads, pages, page_size, head_dim]");
  check_index(pages, "pages");
  const int64_t heads = cache.size(0), num_pages = cache.size(1), page_elems = cache.size(2) * cache.size(3);
  const int64_t n = pages.numel();
  const int64_t* page = pages.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(page[i] >= 0 && page[i] < num_pages, "page ", page[i], " is outside the pool");
  auto out = at::empty({heads, n, cache.size(2), cache.size(3)}, cache.options().dtype(at::kBFloat16));
  const auto* codes = reinterpret_cast<const uint8_t*>(cache.data_ptr());
  auto* words = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, heads * n, 8, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const uint8_t* from = codes + ((task / n) * num_pages + page[task % n]) * page_elems;
      uint16_t* to = words + task * page_elems;
      int64_t i = 0;
#if ISOSERVE_FP8_VBMI
      for (; i + 64 <= page_elems; i += 64) {
        __m512i first, second;
        isoserve::e4m3_to_bf16x64(from + i, first, second);
        _mm512_storeu_si512(to + i, first);
        _mm512_storeu_si512(to + i + 32, second);
      }
#endif
#if ISOSERVE_FP8_AVX512
      for (; i + 32 <= page_elems; i += 32) _mm512_storeu_si512(to + i, isoserve::e4m3_to_bf16x32(from + i));
#endif
      for (; i < page_elems; ++i) {
        const float v = isoserve::e4m3_to_float(from[i]);
        uint32_t bits;
        std::memcpy(&bits, &v, sizeof bits);
        to[i] = static_cast<uint16_t>(bits >> 16);  // exact: the value has at most 4 significant bits
      }
    }
  });
  return out;
}

namespace {

// ---- Greedy tokens ----------------------------------------------------------------------------
// Each row's index of its first maximal value, as torch.argmax returns it (a NaN counts as the
// maximum, the first NaN wins; all -inf gives 0). One pass on 16-float vectors: each lane keeps
// its largest value and the first index that holds it (a later equal value does not replace
// it, nor does a later NaN replace a NaN), then the lanes and the tail settle it. torch's CPU
// argmax on a [32, 49152] bfloat16 block took 2.95 ms, 0.8 ms after a float32 copy; a scalar
// two-pass version of this kernel took 0.96 ms, this one 0.19 ms (two threads, logits out of
// cache). float32 on AVX2 has its own loop (argmax_row_f32x8).

typedef int32_t vint16 __attribute__((vector_size(64)));

// The running (value, first index) maximum that settles the lanes and the tail: any order of
// candidates gives torch's answer, since ties and NaNs go to the smaller index.
struct RowMax {
  float top = -std::numeric_limits<float>::infinity();
  int64_t top_at = 0;
  void offer(float v, int64_t where) {
    const bool v_nan = v != v, top_nan = top != top;
    if (v_nan ? (!top_nan || where < top_at) : (!top_nan && (v > top || (v == top && where < top_at))))
      top = v, top_at = where;
  }
};

#if ISOSERVE_F32X8
// float32 on AVX2 (the 16-float vectors below split in two there: 5 ms for [32, 49152], 2.8x
// torch's own): four independent 8-lane maxima, each lane seeing its elements in order.
inline int64_t argmax_row_f32x8(const float* x, int64_t n) {
  constexpr int S = 4;
  __m256 best[S];
  __m256i at[S], index[S];
  for (int s = 0; s < S; ++s) {
    best[s] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    index[s] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * s));
    at[s] = index[s];
  }
  const __m256i step = _mm256_set1_epi32(8 * S);
  int64_t i = 0;
  for (; i + 8 * S <= n; i += 8 * S)
    for (int s = 0; s < S; ++s) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * s);
      // v > best, or v is the first NaN of the lane.
      const __m256 take = _mm256_or_ps(_mm256_cmp_ps(v, best[s], _CMP_GT_OQ),
                                       _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(best[s], best[s], _CMP_ORD_Q)));
      best[s] = _mm256_blendv_ps(best[s], v, take);
      at[s] = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(at[s]), _mm256_castsi256_ps(index[s]), take));
      index[s] = _mm256_add_epi32(index[s], step);
    }
  RowMax row;
  if (i > 0)
    for (int s = 0; s < S; ++s) {
      float values[8];
      int32_t where[8];
      _mm256_storeu_ps(values, best[s]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(where), at[s]);
      for (int j = 0; j < 8; ++j) row.offer(values[j], where[j]);
    }
  for (; i < n; ++i) row.offer(x[i], i);
  return row.top_at;
}
#endif

template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
#if ISOSERVE_F32X8
  if constexpr (std::is_same_v<T, float>) return argmax_row_f32x8(x, n);
#endif
  constexpr float kLowest = -std::numeric_limits<float>::infinity();
  vfloat16 best;
  vint16 at, index;
  for (int j = 0; j < kBlock; ++j) best[j] = kLowest, at[j] = j, index[j] = j;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock, index += static_cast<int32_t>(kBlock)) {
    const vfloat16 v = load16(x + i);
    const vint16 take = (v > best) | ((v != v) & (best == best));
    best = take ? v : best;
    at = take ? index : at;
  }
  RowMax row;
  if (i > 0)
    for (int j = 0; j < kBlock; ++j) row.offer(best[j], at[j]);
  for (; i < n; ++i) row.offer(f32(x[i]), i);
  return row.top_at;
}

}  // namespace

at::Tensor argmax_rows(const at::Tensor& logits) {
  check_float_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "argmax_rows takes [rows, n > 0]");
  TORCH_CHECK(logits.size(1) <= std::numeric_limits<int32_t>::max(),
              "argmax_rows keeps indices in 32-bit lanes: rows of at most 2^31 - 1 values");
  const int64_t rows = logits.size(0), n = logits.size(1);
  auto out = at::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  ISOSERVE_DISPATCH(logits.scalar_type(), [&] {
    const scalar_t* x = logits.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row(x + r * n, n);
    });
  });
  return out;
}

// ---- The read guard's check (kv/guard.py) -----------------------------------------------------
// For each sequence b and each page j of its table: the page is in the pool, still in the epoch
// the sequence got it in, and, over the slots this step reads as already written (the first
// read_before[b] positions), written by the sequence's tag. Returns the failing (b, j) pairs;
// guard.py describes them. Plain lists in, so a small batch pays for no tensor construction.

std::vector<std::pair<int64_t, int64_t>> check_reads(
    const at::Tensor& writer, const at::Tensor& epoch, const at::Tensor& filled,
    const std::vector<int64_t>& tags, const std::vector<std::vector<int64_t>>& tables,
    const std::vector<std::vector<int64_t>>& epochs, const std::vector<int64_t>& read_before,
    int64_t page_size) {
  check_index(writer, "writer");
  check_index(epoch, "epoch");
  TORCH_CHECK(filled.device().is_cpu() && filled.scalar_type() == at::kInt && filled.is_contiguous(),
              "filled must be a contiguous int32 CPU tensor");
  const int64_t num_pages = writer.numel();
  TORCH_CHECK(epoch.numel() == num_pages && filled.numel() == num_pages, "page fields disagree in length");
  TORCH_CHECK(tables.size() == tags.size() && epochs.size() == tags.size() && read_before.size() == tags.size(),
              "one tag, page table, epoch list and read_before per sequence");
  const int64_t* w = writer.data_ptr<int64_t>();
  const int64_t* e = epoch.data_ptr<int64_t>();
  const int32_t* f = filled.data_ptr<int32_t>();
  std::vector<std::pair<int64_t, int64_t>> bad;
  for (size_t b = 0; b < tags.size(); ++b) {
    TORCH_CHECK(epochs[b].size() == tables[b].size(), "sequence ", b, ": one epoch per page");
    for (size_t j = 0; j < tables[b].size(); ++j) {
      const int64_t page = tables[b][j];
      const int64_t needed = std::clamp<int64_t>(read_before[b] - static_cast<int64_t>(j) * page_size, 0, page_size);
      const bool ok = page >= 0 && page < num_pages && e[page] == epochs[b][j] &&
                      (needed == 0 || (w[page] == tags[b] && f[page] >= needed));
      if (!ok) bad.emplace_back(b, j);
    }
  }
  return bad;
}
