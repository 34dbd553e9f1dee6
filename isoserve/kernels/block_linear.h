// The argument checks of the kernels that multiply by a GGUF's blocks in 8-output panels
// (vector_matmul.cpp's float32 ones, int8_matmul.cpp's int8 ones): one set, so that both
// refuse the same inputs with the same words before they read a byte.
#pragma once

#include "tensors.h"

#include <cstdint>

namespace isoserve {

// x [rows, K] float32, d (and m, where the format has it) [N / 8, K / 32, 8] float32, and
// `panel_code_bytes(K)` bytes of codes for each of the N / 8 panels.
template <typename PanelCodeBytes>
inline void check_block_linear(const char* name, const at::Tensor& x, const at::Tensor& codes,
                               const at::Tensor& d, const at::Tensor* m, PanelCodeBytes panel_code_bytes) {
  constexpr int64_t panel = 8;
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2,
              name, " takes x as a contiguous float32 CPU tensor [rows, in_features]");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.is_contiguous() && d.dim() == 3 && d.size(2) == panel,
              name, " takes d as contiguous float32 [N / 8, K / 32, 8]");
  const int64_t K = x.size(1), panels = d.size(0);
  TORCH_CHECK(K % 32 == 0 && d.size(1) == K / 32, name, ": x has ", K, " inputs, d covers ", d.size(1), " blocks of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == panels * panel_code_bytes(K),
              name, ": ", codes.numel(), " code bytes do not make a [", panels * panel, ", ", K, "] weight");
  if (m) TORCH_CHECK(m->scalar_type() == at::kFloat && m->is_contiguous() && m->sizes() == d.sizes(), name, ": m must be shaped as d");
}

}  // namespace isoserve
