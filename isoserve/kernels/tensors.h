// The part of ATen the kernels use: tensors and their allocation, TORCH_CHECK and
// at::parallel_for. Only module.cpp, which binds the kernels to Python, includes torch's Python
// API. Every source used to include torch/extension.h, whose inline code alone took 34 s of -O3
// per source on a 2-core Zen 3 (~3/4 of each source's build); this header takes ~6. (One source,
// vector_attention.cpp, takes no tensors: it includes ATen/Parallel.h alone.)
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
