// DecoderStack: a decode step's decoder layers in one call (decoder_stack.cpp says why and
// how). Declared here for module.cpp, which binds it to Python.
#pragma once

#include "tensors.h"

#include <cstdint>
#include <vector>

#include "line_prefetch.h"

namespace isoserve {

class DecoderStack {
 public:
  // layers: per layer input_norm, qkv codes/d/m, o codes/d/m, post_norm, gate_up codes/d/m (the
  // SwiGLU panel pairs), down codes/d/m, k_cache, v_cache (the KV pool's views of that layer).
  DecoderStack(const std::vector<std::vector<at::Tensor>>& layers, int64_t heads, double eps);

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // What decode() requests of each next layer's keys, as [ranges, 2]: each range's first byte
  // (a cache line's) in a layer's K cache, and its length in lines (tests read it).
  at::Tensor planned_key_lines(const at::Tensor& pages, const at::Tensor& lens) const;

  // x: the residual stream [rows, hidden], updated in place; h = rms_norm(x, layer 0's input
  // norm), as the caller computed it. Afterwards x holds the last layer's output (before the
  // final norm). cos, sin, slots, pages, lens, scale: as rotary_store and decode_attention take them.
  void decode(at::Tensor& x, at::Tensor h, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
              const at::Tensor& pages, const at::Tensor& lens, double scale);

 private:
  // One projection's Q4_1 blocks in int8_matmul.cpp's layout (model/int8_blocks.py).
  struct Blocks {
    at::Tensor codes, d, m;
  };

  struct Layer {
    at::Tensor input_norm, post_norm, k_cache, v_cache;
    Blocks qkv, o, gate_up, down;
  };

  // The bytes of keys a layer's attention reads this step: each sequence's [0, lens[b]) in each
  // KV head (what plan_key_reads plans, before it joins them into lines).
  int64_t key_bytes_read(const at::Tensor& lens) const;

  // The byte ranges of a layer's K cache that decode attention reads for this step: each
  // sequence's keys [0, lens[b]) in each KV head, in the kernel's task order, page by page
  // (consecutive pages joined). The page tables are bounds-checked here as decode_attention
  // checks them, before any address is formed.
  void plan_key_reads(const at::Tensor& pages, const at::Tensor& lens, LinePlan& plan) const;

  std::vector<Layer> layers_;
  int64_t heads_;
  double eps_;
};

}  // namespace isoserve
