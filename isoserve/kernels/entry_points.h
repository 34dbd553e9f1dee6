// The kernels' entry points that one source file calls in another: cpu_ops.cpp's module
// definition binds them all; decoder_stack.cpp calls the decode step's kernels directly.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <tuple>

#include "line_prefetch.h"

// cpu_ops.cpp (the rest of its kernels are bound where they are defined)
torch::Tensor add_rms_norm(torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& w, double eps);
torch::Tensor rotary_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                           torch::Tensor& k_cache, torch::Tensor& v_cache, const torch::Tensor& slots, int64_t heads);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               const torch::Tensor& pages, const torch::Tensor& lens, double scale, bool bf16_dot);
// amx_matmul.cpp
std::string amx_status();
torch::Tensor q4_1_linear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t out_features);
torch::Tensor q4_1_swiglu(const torch::Tensor& x, const torch::Tensor& blocks, int64_t out_features);
torch::Tensor q8_0_linear(const torch::Tensor& x, const torch::Tensor& blocks, int64_t out_features);
// vector_matmul.cpp
std::string vector_status();
torch::Tensor q4_1_linear_f32(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                              const torch::Tensor& m);
torch::Tensor q8_0_linear_f32(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d);
// int8_matmul.cpp
std::string int8_status();
std::string int8_isa();
// side: another kernel's input, requested into cache while the tiles run (line_prefetch.h)
torch::Tensor q4_1_linear_i8(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                             const torch::Tensor& m, const isoserve::LineSlice<>* side = nullptr);
torch::Tensor q4_1_swiglu_i8(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                             const torch::Tensor& m);
torch::Tensor q8_0_linear_i8(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d);
// The int8 activations those kernels multiply by, quantized in tiles of tile_rows (for tests): codes
// [rows, K] int8, scale and sum [rows, K / 32]
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_rows_i8(const torch::Tensor& x, int64_t tile_rows,
                                                                         bool flipped);
// amx_attention.cpp
void prefill_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                       const torch::Tensor& chunks, const torch::Tensor& pages, torch::Tensor& out,
                       double scale);
// f32_prefill_attention.cpp
std::string f32_prefill_status();
void prefill_attention_f32(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                           const torch::Tensor& chunks, const torch::Tensor& pages, torch::Tensor& out,
                           double scale);
// nucleus.cpp: each row's top-p nucleus (engine/nucleus.py)
torch::Tensor nucleus_rows(const torch::Tensor& probs, const torch::Tensor& top_p);
// draw.cpp: a token from each row of softmax(logits / temperature), -1 where it is no distribution
torch::Tensor temperature_draw(const torch::Tensor& logits, const torch::Tensor& temperature, const torch::Tensor& u);
// decoder_stack.cpp: adds the DecoderStack class to the module
void register_decoder_stack(pybind11::module& m);
