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
// The KV pool's pages are read and written only through the page tables and slots the step
// passes, which the read guard checked before the step (kv/guard.py), as in the Python loop.
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "entry_points.h"

namespace {

// One projection's Q4_1 blocks in int8_matmul.cpp's layout (model/int8_blocks.py).
struct Blocks {
  torch::Tensor codes, d, m;
};

struct Layer {
  torch::Tensor input_norm, post_norm, k_cache, v_cache;
  Blocks qkv, o, gate_up, down;
};

// A layer's tensors, in the order DecoderStack takes them.
constexpr size_t kLayerTensors = 16;

class DecoderStack {
 public:
  // layers: per layer input_norm, qkv codes/d/m, o codes/d/m, post_norm, gate_up codes/d/m (the
  // SwiGLU panel pairs), down codes/d/m, k_cache, v_cache (the KV pool's views of that layer).
  DecoderStack(const std::vector<std::vector<torch::Tensor>>& layers, int64_t heads, double eps) : heads_(heads), eps_(eps) {
    TORCH_CHECK(!layers.empty(), "DecoderStack needs at least one layer");
    TORCH_CHECK(heads > 0, "DecoderStack: heads must be positive, not ", heads);
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& t = layers[i];
      TORCH_CHECK(t.size() == kLayerTensors, "DecoderStack: layer ", i, " has ", t.size(), " tensors, not ",
                  kLayerTensors, " (input_norm, qkv codes/d/m, o codes/d/m, post_norm, gate_up codes/d/m, "
                  "down codes/d/m, k_cache, v_cache)");
      layers_.push_back(Layer{t[0], t[7], t[14], t[15], Blocks{t[1], t[2], t[3]}, Blocks{t[4], t[5], t[6]},
                              Blocks{t[8], t[9], t[10]}, Blocks{t[11], t[12], t[13]}});
    }
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // x: the residual stream [rows, hidden], updated in place; h = rms_norm(x, layer 0's input
  // norm), as the caller computed it. Afterwards x holds the last layer's output (before the
  // final norm). cos, sin, slots, pages, lens, scale: as rotary_store and decode_attention take them.
  void decode(torch::Tensor& x, torch::Tensor h, const torch::Tensor& cos, const torch::Tensor& sin,
              const torch::Tensor& slots, const torch::Tensor& pages, const torch::Tensor& lens, double scale) {
    for (size_t i = 0; i < layers_.size(); ++i) {
      Layer& layer = layers_[i];
      const auto qkv = q4_1_linear_i8(h, layer.qkv.codes, layer.qkv.d, layer.qkv.m);
      const auto q = rotary_store(qkv, cos, sin, layer.k_cache, layer.v_cache, slots, heads_);
      // bf16_dot: the binding's default, as FusedOps.decode_attention calls it (float32 ignores it)
      const auto a = decode_attention(q, layer.k_cache, layer.v_cache, pages, lens, scale, true);
      const auto attended = q4_1_linear_i8(a.reshape({a.size(0), -1}), layer.o.codes, layer.o.d, layer.o.m);
      h = add_rms_norm(x, attended, layer.post_norm, eps_);
      const auto gated = q4_1_swiglu_i8(h, layer.gate_up.codes, layer.gate_up.d, layer.gate_up.m);
      const auto mlp = q4_1_linear_i8(gated, layer.down.codes, layer.down.d, layer.down.m);
      if (i + 1 < layers_.size())  // the residual add, fused with the next layer's norm
        h = add_rms_norm(x, mlp, layers_[i + 1].input_norm, eps_);
      else
        x.add_(mlp);
    }
  }

 private:
  std::vector<Layer> layers_;
  int64_t heads_;
  double eps_;
};

}  // namespace

// Called from cpu_ops.cpp's module definition.
void register_decoder_stack(pybind11::module& m) {
  pybind11::class_<DecoderStack>(m, "DecoderStack",
                                 "A decode step's decoder layers in one call (model/decoder_stack.py)")
      .def(pybind11::init<const std::vector<std::vector<torch::Tensor>>&, int64_t, double>(),
           pybind11::arg("layers"), pybind11::arg("heads"), pybind11::arg("eps"))
      .def_property_readonly("num_layers", &DecoderStack::num_layers)
      .def("decode", &DecoderStack::decode, "run every layer of a decode-only step; x updated in place",
           pybind11::arg("x"), pybind11::arg("h"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("slots"),
           pybind11::arg("pages"), pybind11::arg("lens"), pybind11::arg("scale"),
           pybind11::call_guard<pybind11::gil_scoped_release>());
}
