// y = x W^T for a GGUF's Q4_1 or Q8_0 weights on AMX: each 16 x 32 block of W is widened to
// bfloat16 in vector registers and multiplied by the AMX tile unit, so a decode step reads 5
// (Q4_1) or 8.5 (Q8_0) bits per weight instead of bfloat16's 16 and never writes a dequantized
// copy to memory.
//
// Why: a decode step of up to a few dozen sequences is bound by reading the weights. oneDNN's
// bfloat16 matmul on the prepacked weight runs near the memory bandwidth at those sizes, so only
// fewer bytes make it faster; torch's int4 CPU kernel reads fewer bytes but multiplies on the
// vector units and is slower than bfloat16 from ~5 rows on (docs/benchmarks.md).
//
// Exactness: a weight is bf16(d * q + m) (Q4_1) or bf16(d * q) (Q8_0) computed in float32, as
// gguf-py's dequantizer and the loader's rounding to bfloat16 make it. d is a float16 and q has
// at most 8 bits, so d * q is exact in float32 and one fused multiply-add rounds the same as the
// two steps. The tile unit then sees the very bfloat16 weights the bfloat16 path multiplies by.
//
// Block layout (model/amx.py builds it; both sides must agree): W [N, K] is cut into blocks of
// 16 output rows x 32 inputs, ordered by pairs of row blocks (32 outputs), then by input block,
// then the two row blocks of the pair. Line r of a block holds inputs 2r and 2r + 1 of its 16
// rows in two halves, rows 0-7 and rows 8-15; within a half, position i is row i / 2 at input
// 2r + i % 2. That is the order of an AMX B tile line (16 outputs x a pair of inputs) cut in
// two, so each line widens to one tile line with no shuffle.
//   Q4_1 block (320 bytes): 16 lines of 16 bytes (low nibbles: the low half, high nibbles: the
//     high half), then 16 d and 16 m as float16.
//   Q8_0 block (544 bytes): 16 lines of 32 int8 codes (the low half, then the high half), then
//     16 d as float16.
//
// SwiGLU (q4_1_swiglu): a merged gate-up weight whose pairs are 16 gate rows and the same 16
// outputs' up rows (model/amx.py orders them) gives silu(gate) * up in the pair's epilogue,
// from the gate and up values rounded to bfloat16 as q4_1_linear stores them and by
// silu_mul's own steps (bf16x16.h), so the result is silu_mul(q4_1_linear(...)) to the bit.
// One kernel call per layer instead of two, and the [rows, 2n] gate-up never goes to memory.
#include "tensors.h"

#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "amx.h"
#include "bf16x16.h"

namespace {

using isoserve::TileConfig;
using isoserve::load_tile_config;

constexpr int64_t kTileLine = 64;      // bytes per tile line: 32 bfloat16 or 16 float32
constexpr int64_t kRowsPerChunk = 32;  // x rows per pass: two 16-row A tiles
// How far ahead of the block being widened its successors are asked for (4 k steps of Q4_1,
// 2.4 of Q8_0).
// A thread walks its weights in order, but the widening and the tile unit do not keep enough
// loads in flight to cover the memory's latency. With this and the looked-up nibbles below,
// decode steps alternating old and new kernels in one engine run took 15% / 8% / 5% less at
// batch 8 / 16 / 32. (A prefetch past the end of the weights is harmless: it never faults.)
constexpr int64_t kPrefetchBytes = 2560;

std::string probe_amx() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "the CPU reports no extended features";
  const bool tile = d & (1u << 24), amx_bf16 = d & (1u << 22);
  const bool avx512 = (b & (1u << 16)) && (b & (1u << 30)) && (b & (1u << 31));  // F, BW, VL
  __get_cpuid_count(7, 1, &a, &b, &c, &d);
  const bool avx512_bf16 = a & (1u << 5);
  if (!tile || !amx_bf16) return "the CPU has no AMX-BF16";
  if (!avx512 || !avx512_bf16) return "the CPU has AMX but not AVX-512 BF16";
  // Linux hands a process the (large) tile register state only on request; without it the
  // first tile instruction faults. ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18.
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) return "the OS did not grant AMX tile state";
  return "";
}

// Tiles: 0-3 accumulators (x rows 0-15 and 16-31, times output blocks 0 and 1 of a pair),
// 4-5 the two A tiles of x, 6-7 the B tiles of the two weight blocks.
ISOSERVE_AMX void configure_tiles(int rows0, int rows1) {
  TileConfig cfg;
  const int r1 = rows1 > 0 ? rows1 : 1;  // an unused tile still needs a valid shape
  const int rows[8] = {rows0, rows0, r1, r1, rows0, r1, 16, 16};
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = static_cast<uint8_t>(rows[t]);
    cfg.bytes_per_row[t] = kTileLine;
  }
  load_tile_config(cfg);
}

// Lane i of a line's low half is output row i / 2 of the block, of its high half 8 + i / 2.
ISOSERVE_AMX inline void per_half(const uint8_t* halves, __m512& low, __m512& high) {
  const __m512 v = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(halves)));
  low = _mm512_permutexvar_ps(_mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0), v);
  high = _mm512_permutexvar_ps(_mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8), v);
}

ISOSERVE_AMX inline void store_line(uint16_t* tile_line, __m512 low, __m512 high) {
  _mm512_store_si512(reinterpret_cast<__m512i*>(tile_line),
                     reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
}

// Each format widens one block's codes to its 16 x 32 bfloat16 weights as a B tile
// (16 lines of 64 bytes).
struct Q4_1 {
  static constexpr int64_t kBlockBytes = 320;
  static constexpr const char* kName = "q4_1_linear";
  ISOSERVE_AMX static inline void widen(const uint8_t* block, uint16_t* tile) {
    __m512 d_low, d_high, m_low, m_high;
    per_half(block + 256, d_low, d_high);
    per_half(block + 288, m_low, m_high);
    // A code's float is looked up, not converted: vpermps reads only the low 4 bits of each
    // index, so the low nibble needs no mask (one shuffle where a mask and a conversion were
    // two instructions; the same floats, so the same weights).
    const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (int line = 0; line < 16; ++line) {
      const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 16 * line)));
      const __m512 low = _mm512_fmadd_ps(_mm512_permutexvar_ps(codes, values), d_low, m_low);
      const __m512 high = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), values), d_high, m_high);
      store_line(tile + 32 * line, low, high);
    }
  }
};

struct Q8_0 {
  static constexpr int64_t kBlockBytes = 544;
  static constexpr const char* kName = "q8_0_linear";
  ISOSERVE_AMX static inline void widen(const uint8_t* block, uint16_t* tile) {
    __m512 d_low, d_high;
    per_half(block + 512, d_low, d_high);
    for (int line = 0; line < 16; ++line) {
      const uint8_t* codes = block + 32 * line;
      const __m512i low = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
      const __m512i high = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
      store_line(tile + 32 * line, _mm512_mul_ps(_mm512_cvtepi32_ps(low), d_low),
                 _mm512_mul_ps(_mm512_cvtepi32_ps(high), d_high));
    }
  }
};

// What a pair's 32 accumulated outputs of a row become: themselves (32 columns of y), or
// silu(gate) * up of its 16 gate and 16 up outputs (16 columns).
enum class Epilogue { kLinear, kSwiglu };

template <Epilogue E>
ISOSERVE_AMX inline void store_pair_row(const float* acc_row, uint16_t* y_row, int64_t pair) {
  const __m512i rounded = reinterpret_cast<__m512i>(
      _mm512_cvtne2ps_pbh(_mm512_load_ps(acc_row + 16), _mm512_load_ps(acc_row)));
  if constexpr (E == Epilogue::kLinear) {
    _mm512_storeu_si512(reinterpret_cast<__m512i*>(y_row + 32 * pair), rounded);
  } else {
#if ISOSERVE_BF16X16
    using namespace isoserve;
    const __m512 gate = widen_bf16x16(_mm512_castsi512_si256(rounded));
    const __m512 up = widen_bf16x16(_mm512_extracti64x4_epi64(rounded, 1));
    const __m512 one = _mm512_set1_ps(1.0f), sign = _mm512_set1_ps(-0.0f);
    const __m512 silu = round_bf16x16_ftz(_mm512_div_ps(gate, _mm512_add_ps(one, exp16(_mm512_xor_ps(gate, sign)))));
    store_bf16x16_ftz(y_row + 16 * pair, _mm512_mul_ps(silu, up));
#endif
  }
}

// Output columns [32 * pair_begin, 32 * pair_end) of x W^T (the columns of pairs
// [pair_begin, pair_end) of the SwiGLU), for every row of x. y has N columns (N / 2 for SwiGLU).
template <typename Format, Epilogue E = Epilogue::kLinear>
ISOSERVE_AMX void linear_columns(const uint16_t* x, int64_t rows, int64_t K, const uint8_t* blocks,
                               uint16_t* y, int64_t N, int64_t pair_begin, int64_t pair_end) {
  const int64_t k_blocks = K / 32;
  const int64_t x_stride = K * 2;
  alignas(64) uint16_t b_tiles[2][2][512];  // two k steps in flight, two blocks each
  alignas(64) float acc[32 * 32];
  int configured0 = -1, configured1 = -1;
  for (int64_t m0 = 0; m0 < rows; m0 += kRowsPerChunk) {
    const int rows0 = static_cast<int>(std::min<int64_t>(16, rows - m0));
    const int rows1 = static_cast<int>(std::max<int64_t>(0, std::min<int64_t>(16, rows - m0 - 16)));
    if (rows0 != configured0 || rows1 != configured1) {
      configure_tiles(rows0, rows1);
      configured0 = rows0;
      configured1 = rows1;
    }
    const uint16_t* x0 = x + m0 * K;
    const uint16_t* x1 = rows1 > 0 ? x0 + 16 * K : x0;  // rows 16-31 of the chunk, if it has them
    for (int64_t pair = pair_begin; pair < pair_end; ++pair) {
      const uint8_t* pair_blocks = blocks + pair * k_blocks * 2 * Format::kBlockBytes;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t kb = 0; kb < k_blocks; ++kb) {
        uint16_t* b0 = b_tiles[kb & 1][0];
        uint16_t* b1 = b_tiles[kb & 1][1];
        const uint8_t* ahead = pair_blocks + (2 * kb) * Format::kBlockBytes + kPrefetchBytes;
        for (int64_t line = 0; line < 2 * Format::kBlockBytes; line += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + line), _MM_HINT_T0);
        Format::widen(pair_blocks + (2 * kb) * Format::kBlockBytes, b0);
        Format::widen(pair_blocks + (2 * kb + 1) * Format::kBlockBytes, b1);
        _tile_loadd(6, b0, kTileLine);
        _tile_loadd(7, b1, kTileLine);
        _tile_loadd(4, x0 + 32 * kb, x_stride);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (rows1 > 0) {
          _tile_loadd(5, x1 + 32 * kb, x_stride);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      // Accumulators out as float32 [32 rows][32 outputs], then rounded to bfloat16 once.
      _tile_stored(0, acc, 128);
      _tile_stored(1, acc + 16, 128);
      if (rows1 > 0) {
        _tile_stored(2, acc + 512, 128);
        _tile_stored(3, acc + 512 + 16, 128);
      }
      const int64_t y_stride = E == Epilogue::kLinear ? N : N / 2;
      for (int i = 0; i < rows0 + rows1; ++i) store_pair_row<E>(acc + 32 * i, y + (m0 + i) * y_stride, pair);
    }
  }
  _tile_release();  // hand the tile state back: a thread holding it costs every context switch
}

}  // namespace

// "" when the AMX matmuls can run here, else why not (for the startup log and q4_tiers).
std::string amx_status() {
  static const std::string status = probe_amx();
  return status;
}

namespace {

template <typename Format, Epilogue E = Epilogue::kLinear>
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features,
                      const char* name = Format::kName) {
  TORCH_CHECK(amx_status().empty(), name, " needs AMX: ", amx_status());
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.dim() == 2,
              name, " takes x as a contiguous bfloat16 CPU tensor [rows, in_features]");
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              name, " takes the weight blocks as a contiguous uint8 CPU tensor");
  const int64_t rows = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(K > 0 && K % 32 == 0 && N > 0 && N % 32 == 0,
              name, " needs in and out features that are multiples of 32, got ", K, " and ", N);
  TORCH_CHECK(blocks.numel() == (N / 16) * (K / 32) * Format::kBlockBytes,
              name, ": ", blocks.numel(), " bytes of blocks do not make a [", N, ", ", K, "] weight");
  auto y = at::empty({rows, E == Epilogue::kLinear ? N : N / 2}, x.options());
  if (rows == 0) return y;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  at::parallel_for(0, N / 32, 1, [&](int64_t begin, int64_t end) {
    linear_columns<Format, E>(xp, rows, K, bp, yp, N, begin, end);
  });
  return y;
}

}  // namespace

at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  return amx_linear<Q4_1>(x, blocks, out_features);
}

at::Tensor q4_1_swiglu(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
#if ISOSERVE_BF16X16
  return amx_linear<Q4_1, Epilogue::kSwiglu>(x, blocks, out_features, "q4_1_swiglu");
#else
  // Refused as the other AMX calls are ("needs AMX: why"). amx_status probes the CPU and the OS,
  // not this build: on a CPU it finds fit, the reason is that -march left AVX-512 out.
  TORCH_CHECK(false, "q4_1_swiglu needs AMX: ",
              amx_status().empty() ? std::string("these kernels were built without AVX-512") : amx_status());
#endif
}

at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features) {
  return amx_linear<Q8_0>(x, blocks, out_features);
}
