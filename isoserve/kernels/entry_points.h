// The kernels' entry points: module.cpp binds them all to Python; decoder_stack.cpp calls the
// decode step's kernels directly.
#pragma once

#include "tensors.h"

#include <cstdint>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "line_prefetch.h"

// cpu_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
at::Tensor add_rms_norm(at::Tensor& x, const at::Tensor& y, const at::Tensor& w, double eps);
at::Tensor rotary_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots, int64_t heads);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& pages, const at::Tensor& lens, double scale, bool bf16_dot);
// What this build's kernels run on: decode_attention scores a bfloat16 pool with the CPU's
// bfloat16 dot product (AVX512-BF16); a float8 pool's codes widen on AVX-512 (fp8.h; elsewhere
// its attention runs ~2.5x a bfloat16 pool's time: AVX2, float32 model, batch 32); float32 has
// kernels of its own on AVX2 (f32x8.h)
bool has_bf16_dot();
bool fast_fp8_kv();
bool has_f32x8();
at::Tensor silu_mul(const at::Tensor& gate_up);
at::Tensor fp8_pages_to_bf16(const at::Tensor& cache, const at::Tensor& pages);
at::Tensor argmax_rows(const at::Tensor& logits);
// The read guard's check (kv/guard.py): the (sequence, page index) pairs that fail
std::vector<std::pair<int64_t, int64_t>> check_reads(
    const at::Tensor& writer, const at::Tensor& epoch, const at::Tensor& filled, const std::vector<int64_t>& tags,
    const std::vector<std::vector<int64_t>>& tables, const std::vector<std::vector<int64_t>>& epochs,
    const std::vector<int64_t>& read_before, int64_t page_size);
// amx_matmul.cpp
std::string amx_status();
at::Tensor q4_1_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features);
at::Tensor q4_1_swiglu(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features);
at::Tensor q8_0_linear(const at::Tensor& x, const at::Tensor& blocks, int64_t out_features);
// vector_matmul.cpp
std::string vector_status();
at::Tensor q4_1_linear_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                           const at::Tensor& m);
at::Tensor q8_0_linear_f32(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d);
// int8_matmul.cpp
std::string int8_status();
std::string int8_isa();
// side: another kernel's input, requested into cache while the tiles run (line_prefetch.h)
at::Tensor q4_1_linear_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                          const at::Tensor& m, const isoserve::LineSlice<>* side = nullptr);
at::Tensor q4_1_swiglu_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                          const at::Tensor& m);
at::Tensor q8_0_linear_i8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d);
// The int8 activations those kernels multiply by, quantized in tiles of tile_rows (for tests): codes
// [rows, K] int8, scale and sum [rows, K / 32]
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_rows_i8(const at::Tensor& x, int64_t tile_rows,
                                                                bool flipped);
// amx_attention.cpp
void prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& chunks, const at::Tensor& pages, at::Tensor& out,
                       double scale);
// f32_prefill_attention.cpp
std::string f32_prefill_status();
void prefill_attention_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& chunks, const at::Tensor& pages, at::Tensor& out,
                           double scale);
// nucleus.cpp: each row's top-p nucleus (engine/nucleus.py)
at::Tensor nucleus_rows(const at::Tensor& probs, const at::Tensor& top_p);
// draw.cpp: a token from each row of softmax(logits / temperature), -1 where it is no distribution
// (on AVX-512, or AVX2 and FMA: has_temperature_draw)
bool has_temperature_draw();
at::Tensor temperature_draw(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& u);
