"""Projection: y = x W^T (+ b), the way that is fastest for the step's number of rows.

Two ways, both decided at load time and measured on this project's 2-core CPUs
(`docs/benchmarks.md`):
  - steps of at most `int4_max_rows` rows multiply by the GGUF's own 4-bit blocks
    (model/int4.py): a small decode batch is bound by reading weights, and 4-bit weights are a
    quarter of the bytes;
  - every other step multiplies by the weight in oneDNN's blocked layout, reordered once here.
    torch's F.linear hands oneDNN the plain [out, in] weight and it re-blocks it on every call;
    prepacked, the default model's projections took two-thirds of the time at 32 rows and
    about half at 4-8 rows (one thread). This is the op torch's own compiler emits for frozen
    CPU linears.
Elsewhere (CUDA, float16, a torch without oneDNN) it is plain F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from isoserve.model.int4 import Int4Weight

_ONEDNN_DTYPES = (torch.bfloat16, torch.float32)


class Projection:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 int4: Int4Weight | None = None, int4_max_rows: int = 0):
        self.bias = bias
        self.int4 = int4 if int4_max_rows > 0 else None
        self.int4_max_rows = int4_max_rows
        self.out_features, self.in_features = weight.shape
        self.packed = _onednn_packed(weight)
        self.weight = weight if self.packed is None else None  # the packed copy replaces it

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.int4 is not None and x.shape[0] <= self.int4_max_rows:
            y = self.int4.matmul(x)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    if (weight.device.type != "cpu" or weight.dtype not in _ONEDNN_DTYPES
            or not torch.backends.mkldnn.is_available()):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
