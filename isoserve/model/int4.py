"""4-bit weights for decode steps, taken from a GGUF's Q4_1 blocks as they are.

Why: a decode step of up to a few dozen sequences is bound by reading the weights, and in
bfloat16 the default model's projections are 212 MB a step. Its GGUF stores them as Q4_1 anyway
(32 weights share a scale d and a minimum m: w = d * q + m, q in 0..15), 5 bits a weight. The
codes are the file's own: neither form below adds quantization.

Two kernels multiply by them, each with the weight laid out its own way:
  - `AmxQ4Weight`: isoserve's AMX kernel (kernels/amx_matmul.cpp), where the CPU has AMX-BF16.
    It widens each block to the exact bfloat16 weights the bfloat16 path uses (d * q + m in
    float32, rounded once) inside the registers and multiplies on the tile unit: the bfloat16
    path's arithmetic, at a third of its bytes. Faster than bfloat16 up to 32 rows.
  - `Int4Weight`: torch's CPU int4 kernel, elsewhere. It computes w = (q - 8) * scale + zero
    per group of 32 along the input dimension, so scale = d and zero = m + 8 d, both rounded to
    bfloat16, the dtype it takes them in. It multiplies on the vector units, so from ~5 rows on
    it is slower than a bfloat16 matmul.
The model keeps the bfloat16 weight as well, and `Projection` (model/projection.py) picks one
form per call by rows.

In the checkpoint a Q4_1 weight `X.weight` has three companions (see COMPANIONS): its codes
packed two per byte (even column in the low nibble), and d and m as float16, [N, K / 32] each.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

GROUP = 32                 # weights per Q4_1 block, and the kernel's group size
CODES, SCALE, MIN = ".q4_codes", ".q4_scale", ".q4_min"
COMPANIONS = (CODES, SCALE, MIN)
_Q4_1_BLOCK_BYTES = 20     # float16 d, float16 m, 16 bytes of codes
# AmxQ4Weight's block: 16 lines of 16 code bytes, then the block's 16 d and 16 m as float16.
AMX_BLOCK_BYTES = 16 * 16 + 2 * 16 * 2
AMX_DEFAULT_MAX_ROWS = 32    # up to here AMX beat the prepacked bfloat16 matmul (docs/benchmarks.md)
TORCH_DEFAULT_MAX_ROWS = 4   # from 5 rows on, bfloat16 beat torch's int4 kernel
TORCH_ON_AMX_MAX_ROWS = 2    # and up to here it beat the AMX kernel


def split_q4_1(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A GGUF Q4_1 tensor's bytes -> (packed codes uint8 [rows, cols/2], d and m float16 [rows, cols/32])."""
    blocks = np.ascontiguousarray(raw).reshape(rows * cols // GROUP, _Q4_1_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).reshape(rows, cols // GROUP)
    m = blocks[:, 2:4].copy().view(np.float16).reshape(rows, cols // GROUP)
    nibbles = blocks[:, 4:]
    # ggml keeps weight j of a block in the low nibble of byte j and weight j + 16 in the high one.
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=1).reshape(rows, cols)
    return _pack(torch.from_numpy(codes)), torch.from_numpy(d), torch.from_numpy(m)


def companion_shapes(rows: int, cols: int) -> dict[str, tuple[int, int]]:
    return {CODES: (rows, cols // 2), SCALE: (rows, cols // GROUP), MIN: (rows, cols // GROUP)}


def has_companions(weights: dict[str, torch.Tensor], name: str) -> bool:
    return all(name + suffix in weights for suffix in COMPANIONS)


def dequantize(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The weight `name` as its companions define it, d * q + m in float32."""
    codes = unpack_codes(weights[name + CODES]).float()
    d, m = (weights[name + s].float().repeat_interleave(GROUP, dim=1) for s in (SCALE, MIN))
    return d * codes + m


@dataclass
class Int4Weight:
    packed: torch.Tensor       # torch's CPU int4 layout of the codes
    scale_zero: torch.Tensor   # [K / GROUP, N, 2]: scale and zero per group and output row
    name = "torch int4"

    @classmethod
    def from_companions(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        dtype: torch.dtype) -> Int4Weight | None:
        """One weight from the (codes, d, m) of one or more projections stacked by output rows
        (merged QKV, gate-up); None where the kernel cannot take the shape."""
        codes = unpack_codes(torch.cat([c for c, _, _ in parts]))
        d = torch.cat([d for _, d, _ in parts]).float()
        m = torch.cat([m for _, _, m in parts]).float()
        rows, cols = codes.shape
        if rows % 16 or cols % GROUP:  # the CPU kernel packs 16 output rows at a time
            return None
        zero = m + 8 * d
        scale_zero = torch.stack([d.t(), zero.t()], dim=-1).to(dtype).contiguous()
        return cls(torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1),
                   scale_zero)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N]."""
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)


def amx_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (0..15) with their d, m [N, K / 32] -> the AMX kernel's blocks, uint8.

    The kernel (kernels/amx_matmul.cpp, which documents the layout) reads W in blocks of 16
    output rows x 32 inputs, by pairs of row blocks, then input block, then the pair's two
    blocks. Line r of a block holds inputs 2r and 2r + 1; byte i's low nibble is row i // 2,
    its high nibble row 8 + i // 2, both at input 2r + i % 2."""
    rows, cols = codes.shape
    pairs, k_blocks = rows // 32, cols // GROUP
    # n = 32 pair + 16 block + 8 half + a, k = 32 kb + 2 line + kk; byte i = 2a + kk.
    c = codes.to(torch.uint8).reshape(pairs, 2, 2, 8, k_blocks, 16, 2)  # pair, block, half, a, kb, line, kk
    c = c.permute(0, 4, 1, 5, 3, 6, 2)                                  # pair, kb, block, line, a, kk, half
    code_bytes = (c[..., 0] | (c[..., 1] << 4)).reshape(pairs, k_blocks, 2, 256)

    def per_block(x: torch.Tensor) -> torch.Tensor:  # [N, K / 32] float16 -> [pairs, kb, block, 32] bytes
        x = x.to(torch.float16).reshape(pairs, 2, 16, k_blocks).permute(0, 3, 1, 2).contiguous()
        return x.view(torch.uint8).reshape(pairs, k_blocks, 2, 32)

    return torch.cat([code_bytes, per_block(d), per_block(m)], dim=-1).contiguous().flatten()


@dataclass
class AmxQ4Weight:
    blocks: torch.Tensor   # amx_blocks(...)
    out_features: int
    kernels: object        # the built kernels module (isoserve.kernels)
    name = "AMX"

    @classmethod
    def from_companions(cls, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                        kernels) -> AmxQ4Weight | None:
        """As Int4Weight.from_companions; None where the kernel cannot take the shape."""
        codes = unpack_codes(torch.cat([c for c, _, _ in parts]))
        rows, cols = codes.shape
        if rows % 32 or cols % GROUP:  # the kernel takes outputs in pairs of 16-row blocks
            return None
        d = torch.cat([d for _, d, _ in parts])
        m = torch.cat([m for _, _, m in parts])
        return cls(amx_blocks(codes, d, m), rows, kernels)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] bfloat16 @ W^T -> [M, N]."""
        return self.kernels.q4_1_linear(x, self.blocks, self.out_features)


def q4_tiers(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype: torch.dtype,
             kernels=None, max_rows: int | None = None) -> list[tuple[int, AmxQ4Weight | Int4Weight]]:
    """The 4-bit forms a Projection multiplies by, each with the most rows it takes.

    Where the kernels are built and the CPU has AMX: torch's int4 kernel up to
    TORCH_ON_AMX_MAX_ROWS rows (for one or two rows it was faster than the AMX kernel, whose
    time goes into widening the blocks), then AMX up to `max_rows` (default
    AMX_DEFAULT_MAX_ROWS). Elsewhere torch's int4 kernel up to `max_rows` (default
    TORCH_DEFAULT_MAX_ROWS). [] where no kernel takes the shape or max_rows is 0."""
    if max_rows == 0 or dtype != torch.bfloat16:
        return []
    torch_int4 = Int4Weight.from_companions(parts, dtype)
    amx = AmxQ4Weight.from_companions(parts, kernels) if amx_unavailable(kernels) == "" else None
    if amx is None:
        rows = TORCH_DEFAULT_MAX_ROWS if max_rows is None else max_rows
        return [(rows, torch_int4)] if torch_int4 is not None else []
    rows = AMX_DEFAULT_MAX_ROWS if max_rows is None else max_rows
    if torch_int4 is None:
        return [(rows, amx)]
    if rows <= TORCH_ON_AMX_MAX_ROWS:
        return [(rows, torch_int4)]
    return [(TORCH_ON_AMX_MAX_ROWS, torch_int4), (rows, amx)]


def amx_unavailable(kernels) -> str:
    """'' when the kernels' AMX matmul runs here, else why not."""
    return "the fused CPU kernels are not in use" if kernels is None else kernels.amx_status()


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
