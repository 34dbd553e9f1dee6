// A decode step's decoder layers in one call: the same kernels, in the same order, as
// LlamaModel.forward's loop over its layers (model/llama.py), without Python in between.
//
// Why: at batch 32 on a 2-core Zen 4 the main thread spent ~9% of a decode step between
// kernels (the interpreter, pybind11's argument casts, Projection's tier lookup, tensors'
// wrappers), while the OpenMP worker spun at the end of the previous parallel region waiting
// for it (`perf record -e cpu-clock`, docs/benchmarks.md, session 33). Here that glue is a C++
// loop with the GIL released.
//
// Which steps: decode-only steps of a float32 model whose projections all multiply by the int8
// block kernels (int8_matmul.cpp: q4_1_linear_i8, and q4_1_swiglu_i8 for the merged gate-up)
// with no bias, on the fused kernels (cpu_ops.cpp). model/decoder_stack.py decides, and builds
// the stack once per KV pool; every other step runs the Python loop. Each kernel checks its
// arguments as it does when Python calls it (the inputs here are the contiguous outputs of the
// kernel before, as Projection's .contiguous() leaves them there), and the two ways give the
// same bits (tests/test_decoder_stack.py).
//
// One thing the loop cannot do: while a layer's down projection computes, its tiles request the
// next layer's keys into cache for that layer's attention (line_prefetch.h).
//
// The KV pool's pages are read and written only through the page tables and slots the step
// passes, which the read guard checked before the step (kv/guard.py), as in the Python loop.
// The keys requested ahead are those same pages' (a prefetch reads nothing into the step).
#include "decoder_stack.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "entry_points.h"
#include "page_reads.h"

namespace isoserve {

namespace {

// A layer's tensors, in the order DecoderStack takes them.
constexpr size_t kLayerTensors = 16;

// The most keys a layer, per row of the step, requested during a down projection (whose time
// grows with its rows). On a 2-core Zen 4 (docs/benchmarks.md, session 34) a batch-32 step
// with up to 6 MB of keys a layer (500 tokens each) and a batch-16 one with 1 MB took 3-4% less
// time with them. With 16 sequences of 1,560 tokens (10 MB), requesting all, or the first
// 3 MB, made the step 2-3% slower, the first 1.5 MB changed nothing: the down projection's
// share of the memory bandwidth and the L2s were full, so past this the stack requests none.
constexpr int64_t kKeyPrefetchBytesPerRow = int64_t{192} << 10;

}  // namespace

DecoderStack::DecoderStack(const std::vector<std::vector<at::Tensor>>& layers, int64_t heads, double eps)
  : heads_(heads), eps_(eps) {
  TORCH_CHECK(!layers.empty(), "DecoderStack needs at least one layer");
  TORCH_CHECK(heads > 0, "DecoderStack: heads must be positive, not ", heads);
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& t = layers[i];
    TORCH_CHECK(t.size() == kLayerTensors, "DecoderStack: layer ", i, " has ", t.size(), " tensors, not ",
                kLayerTensors, " (input_norm, qkv codes/d/m, o codes/d/m, post_norm, gate_up codes/d/m, "
                "down codes/d/m, k_cache, v_cache)");
    layers_.push_back(Layer{t[0], t[7], t[14], t[15], Blocks{t[1], t[2], t[3]}, Blocks{t[4], t[5], t[6]},
                            Blocks{t[8], t[9], t[10]}, Blocks{t[11], t[12], t[13]}});
    // One plan of key offsets serves every layer (plan_key_reads): their caches must be alike.
    const at::Tensor &k = layers_.back().k_cache, &first = layers_[0].k_cache;
    TORCH_CHECK(k.dim() == 4 && k.is_contiguous() && k.sizes() == first.sizes() &&
                    k.scalar_type() == first.scalar_type(),
                "DecoderStack: layer ", i, "'s k_cache must be contiguous [kv_heads, pages, page_size, head_dim] "
                "and shaped as layer 0's");
  }
}

at::Tensor DecoderStack::planned_key_lines(const at::Tensor& pages, const at::Tensor& lens) const {
  LinePlan keys;
  plan_key_reads(pages, lens, keys);
  auto out = at::empty({static_cast<int64_t>(keys.ranges()), 2}, at::kLong);
  auto rows = out.accessor<int64_t, 2>();
  for (size_t r = 0; r < keys.ranges(); ++r)
    rows[r][0] = keys.first(r), rows[r][1] = keys.end(r) - keys.before(r);
  return out;
}

void DecoderStack::decode(at::Tensor& x, at::Tensor h, const at::Tensor& cos, const at::Tensor& sin,
                          const at::Tensor& slots, const at::Tensor& pages, const at::Tensor& lens, double scale) {
  // The keys each layer's attention reads, as offsets into a layer's K cache: the same in every
  // layer. The next layer's are requested while this layer's down projection computes
  // (line_prefetch.h), where they are few enough for it (kKeyPrefetchBytesPerRow); only then
  // is the plan built.
  const bool keys_ahead = key_bytes_read(lens) <= kKeyPrefetchBytesPerRow * x.size(0);
  LinePlan keys;
  if (keys_ahead) plan_key_reads(pages, lens, keys);
  for (size_t i = 0; i < layers_.size(); ++i) {
    Layer& layer = layers_[i];
    LineSlice<> next_keys;
    if (keys_ahead && i + 1 < layers_.size())
      next_keys = LineSlice<>::all(keys, reinterpret_cast<uintptr_t>(layers_[i + 1].k_cache.data_ptr()));
    const auto qkv = q4_1_linear_i8(h, layer.qkv.codes, layer.qkv.d, layer.qkv.m);
    const auto q = rotary_store(qkv, cos, sin, layer.k_cache, layer.v_cache, slots, heads_);
    // bf16_dot: the binding's default, as FusedOps.decode_attention calls it (float32 ignores it)
    const auto a = decode_attention(q, layer.k_cache, layer.v_cache, pages, lens, scale, true);
    const auto attended = q4_1_linear_i8(a.reshape({a.size(0), -1}), layer.o.codes, layer.o.d, layer.o.m);
    h = add_rms_norm(x, attended, layer.post_norm, eps_);
    const auto gated = q4_1_swiglu_i8(h, layer.gate_up.codes, layer.gate_up.d, layer.gate_up.m);
    const auto mlp = q4_1_linear_i8(gated, layer.down.codes, layer.down.d, layer.down.m, &next_keys);
    if (i + 1 < layers_.size())  // the residual add, fused with the next layer's norm
      h = add_rms_norm(x, mlp, layers_[i + 1].input_norm, eps_);
    else
      x.add_(mlp);
  }
}

int64_t DecoderStack::key_bytes_read(const at::Tensor& lens) const {
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.dim() == 1,
              "DecoderStack: lens must be contiguous int64 [batch]");
  const at::Tensor& cache = layers_[0].k_cache;
  const int64_t* len = lens.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t b = 0; b < lens.numel(); ++b) keys += std::max<int64_t>(0, len[b]);
  return keys * cache.size(0) * cache.size(3) * cache.element_size();
}

void DecoderStack::plan_key_reads(const at::Tensor& pages, const at::Tensor& lens, LinePlan& plan) const {
  TORCH_CHECK(pages.scalar_type() == at::kLong && pages.is_contiguous() && pages.dim() == 2 &&
                  lens.scalar_type() == at::kLong && lens.is_contiguous() && lens.numel() == pages.size(0),
              "DecoderStack: pages must be contiguous int64 [batch, width] and lens int64 [batch]");
  const at::Tensor& cache = layers_[0].k_cache;
  const int64_t kv_heads = cache.size(0), num_pages = cache.size(1), page_size = cache.size(2);
  const int64_t key_bytes = cache.size(3) * cache.element_size(), page_bytes = page_size * key_bytes;
  const int64_t batch = pages.size(0), width = pages.size(1);
  const int64_t* table = pages.data_ptr<int64_t>();
  const int64_t* len = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b)
    check_page_reads(table + b * width, width, len[b], 1, page_size, num_pages, "sequence", b);
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t p = 0; p * page_size < len[b]; ++p)
        plan.add((h * num_pages + table[b * width + p]) * page_bytes,
                 std::min(page_size, len[b] - p * page_size) * key_bytes);
}

}  // namespace isoserve
