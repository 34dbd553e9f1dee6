"""Projection: y = x W^T (+ b), the way that is fastest for the step's number of rows.

The ways are decided at load time and were measured on this project's 2-core CPUs
(`docs/benchmarks.md`):
  - quantized tiers (model/quantized.py): a step of at most a tier's rows multiplies by the
    GGUF's own Q4_1 (or, for the LM head, Q8_0) blocks, a third (a half) of bfloat16's bytes; a
    decode step is bound by reading weights. Where the CPU has AMX: torch's int4 kernel up to 2
    rows, isoserve's AMX kernels up to 32; elsewhere torch's int4 kernel up to 4 rows.
  - every other step multiplies by the weight in oneDNN's blocked layout, reordered once here.
    torch's F.linear hands oneDNN the plain [out, in] weight and it re-blocks it on every call;
    prepacked, the default model's projections took two-thirds of the time at 32 rows and
    about half at 4-8 rows (one thread). This is the op torch's own compiler emits for frozen
    CPU linears.
Elsewhere (CUDA, float16, a torch without oneDNN, bfloat16 on a CPU without oneDNN's bfloat16
path) it is plain F.linear.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from isoserve.config import native_bfloat16
from isoserve.model.quantized import Tier

_ONEDNN_DTYPES = (torch.bfloat16, torch.float32)


class Projection:
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, tiers: list[Tier] = ()):
        """tiers: by rising row limit; a step takes the first whose limit it is within."""
        self.bias = bias
        self.tiers = sorted(((rows, q4) for rows, q4 in tiers if rows > 0), key=lambda tier: tier[0])
        self.out_features, self.in_features = weight.shape
        self.packed = _onednn_packed(weight)
        self.weight = weight if self.packed is None else None  # the packed copy replaces it

    def quantized_for(self, rows: int):
        """The quantized weight a step of `rows` rows multiplies by, or None (the bfloat16 one)."""
        for max_rows, q4 in self.tiers:
            if rows <= max_rows:
                return q4
        return None

    def bytes_read(self, rows: int) -> int:
        """Weight bytes a step of `rows` rows reads (bench/roofline: the floor of what it reads)."""
        form = self.quantized_for(rows)
        if form is not None:
            return form.nbytes
        dense = self.packed if self.packed is not None else self.weight
        return self.out_features * self.in_features * dense.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        q4 = self.quantized_for(x.shape[0])
        if q4 is not None and not getattr(q4, "fuses_swiglu", False):
            y = q4.matmul(x)
            return y if self.bias is None else y + self.bias
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def swiglu(self, x: torch.Tensor, silu_mul) -> torch.Tensor:
        """silu(gate) * up of this merged [gate; up] projection: one kernel call where the step's
        weight computes both (model/int8_blocks.py, model/amx.py; it adds no bias), else the projection and then
        silu_mul."""
        q4 = self.quantized_for(x.shape[0])
        if getattr(q4, "fuses_swiglu", False) and self.bias is None:
            return q4.swiglu(x)
        return silu_mul(self(x))


def _onednn_packed(weight: torch.Tensor) -> torch.Tensor | None:
    if (weight.device.type != "cpu" or weight.dtype not in _ONEDNN_DTYPES
            or not torch.backends.mkldnn.is_available()):
        return None
    if weight.dtype == torch.bfloat16 and not native_bfloat16():
        return None  # oneDNN refuses (no AVX-512 or AVX-NE-CONVERT): torch's own bfloat16 matmul
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), None)
