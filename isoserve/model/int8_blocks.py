"""GGUF weights for the int8 block kernels (kernels/int8_matmul.cpp): a GGUF's Q4_1 and Q8_0
blocks multiplied, on AVX2 or AVX512-VNNI, by the step's activations quantized to int8 in
blocks of 32.

Where isoserve runs in float32 (a CPU without a native bfloat16 path, config.native_bfloat16;
or a Q4_1 GGUF on AVX512-VNNI without AMX, where these beat bfloat16's matmuls), a step of many
rows is bound by float32 multiply-adds; byte multiply-adds take 4 times the products an
instruction. This is the arithmetic llama.cpp runs for these files on such CPUs: per
row and block of 32 inputs, a = max |x| / 127 and q = round(x / a), summed exactly against the
weight's codes, then scaled in float32 (`reference` below is that arithmetic in torch, for
tests). Each row's result depends on that row alone, so a sequence's logits do not depend on
the other sequences of its step. `--no-int8-activations` turns it off (model/quantized.py).

Layout (the kernel file documents it too): outputs in panels of 8; inputs in groups of 4 whose
8 x 4 codes fill 32 bytes, [output][input]. Q4_1: a block's 8 groups in 4 chunks of 32 bytes,
chunk c holding group c in its low nibbles and group c + 4 in its high ones: [N / 8, K / 32, 4,
32] bytes. Q8_0: [N / 8, K / 32, 8, 32] int8. d (and m) as float32 [N / 8, K / 32, 8]. The
kernels take panels in pairs, so each pair's codes and scales are interleaved (interleave_pairs):
a pair is one stream in memory, and its two panels' chunks (and scales) one 64-byte load.

A merged gate-up weight goes to q4_1_swiglu_i8 with its panels reordered in pairs, each gate
panel followed by the up panel of the same 8 outputs: the kernel then writes silu(gate) * up
from its two accumulators (cpu_ops.cpp's silu_mul arithmetic, to the bit), half the outputs
and no second pass over the [rows, 2 n] projection.
"""
from __future__ import annotations

import torch

from isoserve.model.int4 import GROUP, merge
from isoserve.model.vector_blocks import PANEL, VectorQ4Weight, VectorQ8Weight, panels


def int8_unavailable(kernels) -> str:
    """'' when the kernels' int8 block matmuls run here, else why not."""
    return "the fused CPU kernels are not in use" if kernels is None else kernels.int8_status()


def q4_1_group_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> [N / 8, K / 32, 4, 32] bytes (the layout above)."""
    n, k = codes.shape
    c = codes.to(torch.uint8).reshape(n // PANEL, PANEL, k // GROUP, 2, 4, 4)  # panel, output, block, half, chunk, input
    nibbles = c[:, :, :, 0] | (c[:, :, :, 1] << 4)
    return nibbles.permute(0, 2, 3, 1, 4).contiguous().reshape(n // PANEL, k // GROUP, 4, 32)


def q8_0_group_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> [N / 8, K / 32, 8, 32], seen as bytes."""
    n, k = codes.shape
    c = codes.to(torch.int8).reshape(n // PANEL, PANEL, k // GROUP, 8, 4)
    return c.permute(0, 2, 3, 1, 4).contiguous().reshape(n // PANEL, k // GROUP, 8, 32).view(torch.uint8)


def interleave_pairs(t: torch.Tensor) -> torch.Tensor:
    """A per-panel layout [P, B, ..., U] with each pair of panels (2i, 2i + 1) interleaved by
    its innermost units: for each block, panel 2i's first unit then panel 2i + 1's, and so on
    ([P / 2, B, ..., 2, U] in memory, the shape kept). An odd count's last panel stays as it
    was, after the pairs.

    Why: the kernel reads a pair's codes, d and m block by block, and a decode step of a few
    rows is bound by reading them. Apart, the two panels made six streams a core walked at
    14-17 GB/s where one sequential read makes 26-31 (Zen 4, microbenchmark); interleaved, they
    are three, and a pair's chunk and its scales load as one vector each instead of two joined
    halves. 30 gate-up projections at one row took 1.2-1.5 ms instead of 2.3-2.8, a batch-1
    decode step 5.6-6.7 ms instead of 7.4-7.9 (docs/benchmarks.md)."""
    paired = t.shape[0] - t.shape[0] % 2
    pairs = t[:paired].reshape(paired // 2, 2, *t.shape[1:]).movedim(1, -2).reshape(paired, *t.shape[1:])
    return torch.cat([pairs, t[paired:]]) if paired < t.shape[0] else pairs.contiguous()


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' int8 activations of float32 x [R, K]: codes [R, K / 32, 32] (as float32) and
    scales [R, K / 32], in the kernels' float32 operations (127 / amax, then a multiply)."""
    rows, k = x.shape
    blocks = x.float().reshape(rows, k // GROUP, GROUP)
    amax = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros((), dtype=torch.float32))
    return torch.round(blocks * inverse), (amax / 127.0).squeeze(-1)


def reference(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """x W^T in float64 for W = d * codes (+ m) by blocks of 32 ([N, K] codes, [N, K / 32] d and
    m), from the kernels' int8 activations: what they compute, up to float32's sums of blocks."""
    q, scale = quantize_activations(x)
    n = codes.shape[0]
    sums = torch.einsum("rbk,nbk->rnb", q.double(), codes.double().reshape(n, -1, GROUP))
    y = d.double()[None] * scale.double()[:, None] * sums
    if m is not None:
        y = y + m.double()[None] * (scale.double() * q.double().sum(-1))[:, None]
    return y.sum(-1)


class Int8Q4Weight(VectorQ4Weight):
    """A Q4_1 weight for q4_1_linear_i8: the codes in groups, codes, d and m in pairs of panels."""
    name = "int8 x 4-bit"
    layout = staticmethod(lambda codes: interleave_pairs(q4_1_group_codes(codes)))
    scale_layout = staticmethod(lambda t: interleave_pairs(panels(t)))
    kernel = "q4_1_linear_i8"


def gate_up_panel_pairs(rows: int) -> torch.Tensor:
    """Row order of a merged [gate; up] weight of `rows` rows for q4_1_swiglu_i8: each gate
    panel of 8 outputs, then the up panel of the same outputs."""
    n = rows // 2
    gate = torch.arange(n).view(n // PANEL, PANEL)
    return torch.stack([gate, gate + n], dim=1).flatten()


class Int8Q4SwigluWeight(Int8Q4Weight):
    """A merged gate-up Q4_1 weight for q4_1_swiglu_i8: `swiglu(x)` is silu(x G^T) * (x U^T) in
    one kernel call. It has no plain x W^T: Projection multiplies by its dense weight instead."""
    name = "int8 x 4-bit with SwiGLU"
    kernel = "q4_1_swiglu_i8"
    fuses_swiglu = True

    @classmethod
    def from_companions(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        kernels) -> Int8Q4SwigluWeight | None:
        """From the (codes, d, m) of the gate and the up projection; None where the kernel cannot
        take the shape (two halves of whole panels)."""
        if len(parts) != 2 or parts[0][0].shape != parts[1][0].shape or parts[0][0].shape[0] % PANEL:
            return None
        codes, d, m = merge(parts)
        order = gate_up_panel_pairs(codes.shape[0])
        return cls.from_blocks(codes[order], d[order], m[order], kernels)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("a SwiGLU gate-up weight gives silu(gate) * up (swiglu), not x W^T")

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 -> silu(x G^T) * (x U^T) [M, N / 2]."""
        return self._linear(x.contiguous(), self.codes, self.d, self.m)


class Int8Q8Weight(VectorQ8Weight):
    name = "int8 x 8-bit"
    layout = staticmethod(lambda codes: interleave_pairs(q8_0_group_codes(codes)))
    scale_layout = staticmethod(lambda t: interleave_pairs(panels(t)))
    kernel = "q8_0_linear_i8"
