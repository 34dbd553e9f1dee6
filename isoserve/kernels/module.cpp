// The Python module of the fused CPU kernels: binds every entry point (entry_points.h) and the
// DecoderStack class (decoder_stack.h).
//
// This is the only source that includes torch's Python API (pybind11 and its tensor casters),
// whose inline code made most of every source's build (tensors.h). torch/python.h, not
// torch/extension.h, which adds the rest of torch's C++ frontend: 30 s of -O3 instead of 53 here.
#include <torch/python.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <vector>

#include "decoder_stack.h"
#include "entry_points.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of [rows, n] rows");
  m.def("add_rms_norm", &add_rms_norm, "x += y in place, then RMSNorm of x");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a merged [rows, 2n] gate-up");
  m.def("rotary_store", &rotary_store, "RoPE on Q and K; K and V written to their cache slots");
  m.def("decode_attention", &decode_attention, "one-query attention over paged KV, in place",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("pages"), py::arg("lens"),
        py::arg("scale"), py::arg("bf16_dot") = true);
  m.attr("has_bf16_dot") = has_bf16_dot();
  m.attr("fast_fp8_kv") = fast_fp8_kv();
  m.def("fp8_pages_to_bf16", &fp8_pages_to_bf16, "pages of a float8 KV cache as bfloat16, exactly",
        py::arg("cache"), py::arg("pages"));
  m.attr("has_f32x8") = has_f32x8();  // float32 kernels of their own on AVX2 (f32x8.h)
  m.def("argmax_rows", &argmax_rows, "each row's first index of its maximum, as torch.argmax");
  m.def("nucleus_rows", &nucleus_rows, "each row's probabilities inside its top-p nucleus, 0 outside",
        py::arg("probs"), py::arg("top_p"));
  m.attr("has_temperature_draw") = has_temperature_draw();  // else the sampler's torch ops
  m.def("temperature_draw", &temperature_draw,
        "a token from each row of softmax(logits / temperature) at u of its mass, -1 where the row is "
        "no distribution", py::arg("logits"), py::arg("temperature"), py::arg("u"));
  m.def("check_reads", &check_reads, "the read guard: (sequence, page index) pairs that fail");
  m.def("amx_status", &amx_status, "'' when q4_1_linear can run on this machine, else why not");
  m.def("q4_1_linear", &q4_1_linear, "x W^T for Q4_1 weight blocks (model/amx.py), on AMX",
        py::arg("x"), py::arg("blocks"), py::arg("out_features"));
  m.def("q4_1_swiglu", &q4_1_swiglu,
        "silu(x G^T) * (x U^T) for a gate-up weight of Q4_1 blocks in pairs of 16 gate and 16 up "
        "rows (model/amx.py), on AMX", py::arg("x"), py::arg("blocks"), py::arg("out_features"));
  m.def("q8_0_linear", &q8_0_linear, "x W^T for Q8_0 weight blocks (model/amx.py), on AMX",
        py::arg("x"), py::arg("blocks"), py::arg("out_features"));
  m.def("vector_status", &vector_status, "'' when q4_1_linear_f32 can run on this machine, else why not");
  m.def("q4_1_linear_f32", &q4_1_linear_f32, "x W^T in float32 for Q4_1 blocks (model/vector_blocks.py), AVX2",
        py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("m"));
  m.def("q8_0_linear_f32", &q8_0_linear_f32, "x W^T in float32 for Q8_0 blocks (model/vector_blocks.py), AVX2",
        py::arg("x"), py::arg("codes"), py::arg("d"));
  m.def("int8_status", &int8_status, "'' when q4_1_linear_i8 can run on this machine, else why not");
  m.def("int8_isa", &int8_isa, "the int8 block matmuls' tiles: 'avx512-vnni', 'avx2', or '' where they cannot run");
  m.def("q4_1_linear_i8",
        [](const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d, const at::Tensor& m) {
          return q4_1_linear_i8(x, codes, d, m);
        },
        "x W^T for Q4_1 blocks with x quantized to int8 by blocks of 32 (model/int8_blocks.py), AVX2 or AVX512-VNNI",
        py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("m"));
  m.def("q4_1_swiglu_i8", &q4_1_swiglu_i8,
        "silu(x G^T) * (x U^T) for a gate-up weight of Q4_1 blocks in pairs of gate and up panels, "
        "x quantized to int8 by blocks of 32 (model/int8_blocks.py), AVX2 or AVX512-VNNI",
        py::arg("x"), py::arg("codes"), py::arg("d"), py::arg("m"));
  m.def("q8_0_linear_i8", &q8_0_linear_i8,
        "x W^T for Q8_0 blocks with x quantized to int8 by blocks of 32 (model/int8_blocks.py), AVX2 or AVX512-VNNI",
        py::arg("x"), py::arg("codes"), py::arg("d"));
  m.def("quantize_rows_i8", &quantize_rows_i8,
        "the int8 activations those kernels multiply by: x quantized by blocks of 32 in tiles of tile_rows "
        "(flipped: as Q8_0's AVX-512 tiles take them, codes + 128), returned as codes [rows, K] int8, scale and "
        "sum [rows, K / 32]",
        py::arg("x"), py::arg("tile_rows"), py::arg("flipped"));
  m.def("prefill_attention", &prefill_attention,
        "causal attention of a step's prefill chunks over their pages into out's rows, on AMX",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("chunks"), py::arg("pages"),
        py::arg("out"), py::arg("scale"));
  m.def("f32_prefill_status", &f32_prefill_status, "'' when prefill_attention_f32 can run on this machine, else why not");
  m.def("prefill_attention_f32", &prefill_attention_f32,
        "causal attention of a step's prefill chunks over their pages into out's rows, in float32 on AVX-512",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("chunks"), py::arg("pages"),
        py::arg("out"), py::arg("scale"));
  // module_local: two builds of this module in one process (a benchmark comparing them) each keep
  // their own DecoderStack type instead of clashing in pybind11's registry of global types.
  py::class_<isoserve::DecoderStack>(m, "DecoderStack", "A decode step's decoder layers in one call (model/decoder_stack.py)",
                                     py::module_local())
      .def(py::init<const std::vector<std::vector<at::Tensor>>&, int64_t, double>(), py::arg("layers"), py::arg("heads"),
           py::arg("eps"))
      .def_property_readonly("num_layers", &isoserve::DecoderStack::num_layers)
      .def("planned_key_lines", &isoserve::DecoderStack::planned_key_lines,
           "the byte ranges of a layer's K cache requested during the layer before's down projection: "
           "[ranges, 2] of (first byte, cache lines)",
           py::arg("pages"), py::arg("lens"))
      .def("decode", &isoserve::DecoderStack::decode, "run every layer of a decode-only step; x updated in place",
           py::arg("x"), py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("slots"), py::arg("pages"),
           py::arg("lens"), py::arg("scale"), py::call_guard<py::gil_scoped_release>());
}
