"""GGUF weights for the float32 block kernels (kernels/vector_matmul.cpp): Q4_1 and Q8_0 blocks
widened to float32 on AVX2, in registers for steps of up to 8 rows, into a per-thread buffer
for bigger ones.

Where isoserve runs in float32 (a CPU without a native bfloat16 path, config.native_bfloat16),
a decode step of a few sequences is bound by reading the weights: float32 reads 32 bits a
weight, these read the file's 5 (Q4_1) or 8.5 (Q8_0). The kernels widen each block to the very
float32 weights the loader dequantizes (fma(d, q, m), or d * q), so only the order of the sums
differs from the float32 matmul. model/quantized.py decides up to how many rows they serve.

Layout (the kernel file documents it too): the outputs in panels of 8; within a panel, each
input's 8 codes side by side, so the kernel widens one load to 8 outputs' weights for one input.
Q4_1: [N / 8, K / 2, 8] bytes, input 2i in the low nibble and 2i + 1 in the high one. Q8_0:
[N / 8, K, 8] int8 codes. d (and m) as float32 [N / 8, K / 32, 8].
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from isoserve.model.int4 import GROUP, merge


def vector_unavailable(kernels) -> str:
    """'' when the kernels' float32 block matmuls run here, else why not."""
    return "the fused CPU kernels are not in use" if kernels is None else kernels.vector_status()


PANEL = 8  # outputs a panel holds (kernels/vector_matmul.cpp's kPanel)


def panels(t: torch.Tensor) -> torch.Tensor:
    """[N, C] -> [N / 8, C, 8]: column c of each panel's 8 rows side by side."""
    rows, cols = t.shape
    return t.reshape(rows // PANEL, PANEL, cols).transpose(1, 2).contiguous()


def q4_1_panel_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) -> [N / 8, K / 2, 8] bytes: inputs 2i (low nibble) and 2i + 1 (high)
    of each of a panel's 8 outputs."""
    c = codes.to(torch.uint8)
    return panels(c[:, 0::2] | (c[:, 1::2] << 4))


def q8_0_panel_codes(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes [N, K] -> [N / 8, K, 8], seen as bytes."""
    return panels(codes.to(torch.int8)).view(torch.uint8)


def shape_fits(rows: int, cols: int) -> bool:
    # Outputs that do not fill panels of 8 keep the dense weight: hidden sizes and the
    # vocabularies of the Llama-family models here (32000, 49152, 128256, 151936) all do.
    return rows % PANEL == 0 and cols % GROUP == 0


@dataclass
class VectorQ4Weight:
    """A Q4_1 weight in a block kernel's layout. model/int8_blocks.py's kernels take the same
    d and m in another code layout, so they subclass this with their own layout and kernel."""
    codes: torch.Tensor   # layout(...)
    d: torch.Tensor       # float32 [N / 8, K / 32, 8]
    m: torch.Tensor
    kernels: object
    name = "float32 4-bit"
    layout = staticmethod(q4_1_panel_codes)
    scale_layout = staticmethod(panels)  # d and m
    kernel = "q4_1_linear_f32"

    def __post_init__(self):
        self._linear = getattr(self.kernels, self.kernel)  # once, not on every decode step

    @classmethod
    def from_companions(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        kernels) -> VectorQ4Weight | None:
        """One weight from the Q4_1 (codes, d, m) of one or more projections stacked by output
        rows (merged QKV, gate-up); None where the kernel cannot take the shape."""
        return cls.from_blocks(*merge(parts), kernels)

    @classmethod
    def from_blocks(cls, codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kernels) -> VectorQ4Weight | None:
        """From merged codes [N, K] (0..15), d and m [N, K / 32]; None where the shape does not fit."""
        if not shape_fits(*codes.shape):
            return None
        return cls(cls.layout(codes), cls.scale_layout(d.float()), cls.scale_layout(m.float()), kernels)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] float32 @ W^T -> [M, N] (a strided x is copied once, as F.linear would)."""
        return self._linear(x.contiguous(), self.codes, self.d, self.m)


@dataclass
class VectorQ8Weight:
    """A Q8_0 weight in a block kernel's layout (subclassed as VectorQ4Weight is)."""
    codes: torch.Tensor   # layout(...)
    d: torch.Tensor       # float32 [N / 8, K / 32, 8]
    kernels: object
    name = "float32 8-bit"
    layout = staticmethod(q8_0_panel_codes)
    scale_layout = staticmethod(panels)
    kernel = "q8_0_linear_f32"

    def __post_init__(self):
        self._linear = getattr(self.kernels, self.kernel)

    @classmethod
    def from_companions(cls, codes: torch.Tensor, d: torch.Tensor, kernels) -> VectorQ8Weight | None:
        if not shape_fits(*codes.shape):
            return None
        return cls(cls.layout(codes), cls.scale_layout(d.float()), kernels)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x.contiguous(), self.codes, self.d)
