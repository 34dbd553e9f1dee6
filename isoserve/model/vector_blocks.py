"""GGUF weights for the float32 block kernels (kernels/vector_matmul.cpp): Q4_1 and Q8_0 blocks
widened to float32 in AVX2 registers.

Where isoserve runs in float32 (a CPU without a native bfloat16 path, config.native_bfloat16),
a decode step of a few sequences is bound by reading the weights: float32 reads 32 bits a
weight, these read the file's 5 (Q4_1) or 8.5 (Q8_0). The kernels widen each block to the very
float32 weights the loader dequantizes (fma(d, q, m), or d * q), so only the order of the sums
differs from the float32 matmul. model/quantized.py decides up to how many rows they serve.

Layout (the kernel file documents it too): codes row by row, block after block. Q4_1: 16 bytes
a block, byte j holding input j in its low nibble and input j + 16 in its high one. Q8_0: the
32 int8 codes of a block. d (and m) as float32 [N, K / 32].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from isoserve.model.int4 import GROUP, merge


def vector_unavailable(kernels) -> str:
    """'' when the kernels' float32 block matmuls run here, else why not."""
    return "the fused CPU kernels are not in use" if kernels is None else kernels.vector_status()


def q4_1_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> [N, K / 2] bytes, 16 a block: input j low, input j + 16 high."""
    rows, cols = codes.shape
    c = codes.to(torch.uint8).reshape(rows, cols // GROUP, 2, GROUP // 2)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(rows, cols // 2).contiguous()


@dataclass
class VectorQ4Weight:
    codes: torch.Tensor   # q4_1_codes(...)
    d: torch.Tensor       # float32 [N, K / 32]
    m: torch.Tensor
    kernels: object
    name = "float32 4-bit"

    @classmethod
    def from_companions(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        kernels) -> VectorQ4Weight | None:
        """One weight from the Q4_1 (codes, d, m) of one or more projections stacked by output
        rows (merged QKV, gate-up); None where the kernel cannot take the shape."""
        codes, d, m = merge(parts)
        if codes.shape[1] % GROUP:
            return None
        return cls(q4_1_codes(codes), d.float().contiguous(), m.float().contiguous(), kernels)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] (a strided x is copied once, as F.linear would)."""
        return self.kernels.q4_1_linear_f32(x.contiguous(), self.codes, self.d, self.m)


@dataclass
class VectorQ8Weight:
    codes: torch.Tensor   # int8 [N, K] seen as bytes
    d: torch.Tensor       # float32 [N, K / 32]
    kernels: object
    name = "float32 8-bit"

    @classmethod
    def from_companions(cls, codes: torch.Tensor, d: torch.Tensor, kernels) -> VectorQ8Weight | None:
        if codes.shape[1] % GROUP:
            return None
        return cls(codes.to(torch.int8).contiguous().view(torch.uint8), d.float().contiguous(), kernels)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_0_linear_f32(x.contiguous(), self.codes, self.d)
