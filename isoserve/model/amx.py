"""GGUF weights for isoserve's AMX kernels (kernels/amx_matmul.cpp): Q4_1 and Q8_0 blocks laid
out as the tile unit reads them.

The kernels widen each block to the exact bfloat16 weights the bfloat16 path uses (float32
d * q (+ m), rounded once, as gguf-py's dequantizer and the loader compute them) inside the
registers, and multiply on the tile unit: the bfloat16 path's arithmetic at a third (Q4_1) or a
half (Q8_0) of its bytes, since a decode step is bound by reading weights. They run where the
CPU has AMX-BF16 and the fused kernels are built (`amx_unavailable` says why not elsewhere).

Layout (the kernel file documents it too; both sides must agree): W [N, K] in blocks of 16
output rows x 32 inputs, ordered by pairs of row blocks (32 outputs), then input block, then
the pair's two blocks. Line r of a block holds inputs 2r and 2r + 1 of its 16 rows, split in a
low half (rows 0-7) and a high half (rows 8-15); within a half, position i is row i // 2 at
input 2r + i % 2. Q4_1: the halves are the low and high nibbles of 16 bytes, then 16 d and
16 m as float16. Q8_0: the halves are two runs of 16 int8 codes, then 16 d as float16.

A merged gate-up weight for the SwiGLU kernel (AmxQ4SwigluWeight) has its rows reordered first,
so that each pair is 16 gate outputs and the same 16 outputs' up rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from isoserve.model.int4 import GROUP, merge

Q4_1_BLOCK_BYTES = 16 * 16 + 2 * 16 * 2   # codes, d, m
Q8_0_BLOCK_BYTES = 16 * 32 + 16 * 2       # codes, d


def amx_unavailable(kernels) -> str:
    """'' when the kernels' AMX matmuls run here, else why not."""
    return "the fused CPU kernels are not in use" if kernels is None else kernels.amx_status()


def _tile_order(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [pairs, k blocks, block, line, half, i // 2, i % 2] (see the module doc)."""
    rows, cols = codes.shape
    # n = 32 pair + 16 block + 8 half + a, k = 32 kb + 2 line + kk, position i = 2a + kk.
    c = codes.reshape(rows // 32, 2, 2, 8, cols // GROUP, 16, 2)  # pair, block, half, a, kb, line, kk
    return c.permute(0, 4, 1, 5, 2, 3, 6)


def _per_block(x: torch.Tensor) -> torch.Tensor:
    """[N, K / 32] scales -> [pairs, k blocks, block, 32] bytes: each block's 16 as float16."""
    rows, k_blocks = x.shape
    x = x.to(torch.float16).reshape(rows // 32, 2, 16, k_blocks).permute(0, 3, 1, 2).contiguous()
    return x.view(torch.uint8).reshape(rows // 32, k_blocks, 2, 32)


def q4_1_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) with their d, m [N, K / 32] -> the Q4_1 kernel's blocks, uint8."""
    c = _tile_order(codes.to(torch.uint8))
    code_bytes = (c[..., 0, :, :] | (c[..., 1, :, :] << 4)).reshape(*c.shape[:3], 256)
    return torch.cat([code_bytes, _per_block(d), _per_block(m)], dim=-1).contiguous().flatten()


def q8_0_blocks(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] int8 with their d [N, K / 32] -> the Q8_0 kernel's blocks, uint8."""
    c = _tile_order(codes.to(torch.int8).view(torch.uint8))
    return torch.cat([c.reshape(*c.shape[:3], 512), _per_block(d)], dim=-1).contiguous().flatten()


def _fits(rows: int, cols: int) -> bool:
    return rows % 32 == 0 and cols % GROUP == 0  # outputs in pairs of 16-row blocks


@dataclass
class AmxQ4Weight:
    blocks: torch.Tensor   # q4_1_blocks(...)
    out_features: int
    kernels: object        # the built kernels module (isoserve.kernels)
    name = "AMX"

    @classmethod
    def from_companions(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        kernels) -> AmxQ4Weight | None:
        """One weight from the Q4_1 (codes, d, m) of one or more projections stacked by output
        rows (merged QKV, gate-up); None where the kernel cannot take the shape."""
        codes, d, m = merge(parts)
        if not _fits(*codes.shape):
            return None
        return cls(q4_1_blocks(codes, d, m), codes.shape[0], kernels)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 @ W^T -> [M, N]. (The kernel takes rows as they lie: a strided x
        is copied once here, as the bfloat16 path copies it.)"""
        return self.kernels.q4_1_linear(x.contiguous(), self.blocks, self.out_features)


def gate_up_pairs(rows: int) -> torch.Tensor:
    """Row order of a merged [gate; up] weight of `rows` rows for q4_1_swiglu: 16 gate rows,
    then the up rows of the same 16 outputs, and so on."""
    n = rows // 2
    gate = torch.arange(n).view(n // 16, 16)
    return torch.stack([gate, gate + n], dim=1).flatten()


@dataclass
class AmxQ4SwigluWeight(AmxQ4Weight):
    """A merged gate-up weight for q4_1_swiglu: `swiglu(x)` is silu(x G^T) * (x U^T) in one
    kernel call, equal to silu_mul of the plain kernel's output to the bit. It has no plain
    x W^T: Projection multiplies by its dense weight instead."""
    name = "AMX with SwiGLU"
    fuses_swiglu = True

    @classmethod
    def from_companions(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        kernels) -> AmxQ4SwigluWeight | None:
        """From the (codes, d, m) of the gate and the up projection; None where the kernel cannot
        take the shape (halves of whole 16-row blocks, pairs of 32 rows)."""
        if len(parts) != 2 or parts[0][0].shape != parts[1][0].shape:
            return None
        codes, d, m = merge(parts)
        if not _fits(*codes.shape):  # whole pairs of 32 rows: each half whole 16-row blocks
            return None
        order = gate_up_pairs(codes.shape[0])
        return cls(q4_1_blocks(codes[order], d[order], m[order]), codes.shape[0], kernels)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("a SwiGLU gate-up weight gives silu(gate) * up (swiglu), not x W^T")

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 -> silu(x G^T) * (x U^T) [M, N / 2]."""
        return self.kernels.q4_1_swiglu(x.contiguous(), self.blocks, self.out_features)


@dataclass
class AmxQ8Weight:
    blocks: torch.Tensor   # q8_0_blocks(...)
    out_features: int
    kernels: object
    name = "AMX 8-bit"

    @classmethod
    def from_companions(cls, codes: torch.Tensor, d: torch.Tensor, kernels) -> AmxQ8Weight | None:
        if not _fits(*codes.shape):
            return None
        return cls(q8_0_blocks(codes, d), codes.shape[0], kernels)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.kernels.q8_0_linear(x.contiguous(), self.blocks, self.out_features)
