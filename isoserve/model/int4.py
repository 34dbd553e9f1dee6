"""A GGUF's Q4_1 blocks as the checkpoint keeps them, and torch's int4 kernel over them.

Why: a decode step of up to a few dozen sequences is bound by reading the weights, and in
bfloat16 the default model's projections are 212 MB a step. Its GGUF stores them as Q4_1 anyway
(32 weights share a scale d and a minimum m: w = d * q + m, q in 0..15), 5 bits a weight.

`Int4Weight` is that form for torch's CPU int4 kernel: w = (q - 8) * scale + zero per group of
32 along the input dimension, so scale = d and zero = m + 8 d. The codes are the file's own:
this path adds no quantization; only scale and zero are rounded to bfloat16, the dtype the
kernel takes them in. It multiplies on the vector units, so from ~5 rows on it is slower than a
bfloat16 matmul. Where the CPU has AMX, isoserve's own kernel takes the same blocks further
(model/amx.py); model/quantized.py decides which form serves which rows.

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


def merge(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """The (packed codes, d, m) of projections stacked by output rows (merged QKV, gate-up) ->
    one weight's codes [N, K] (0..15), d and m [N, K / 32] (float16)."""
    packed, d, m = (torch.cat(column) for column in zip(*parts))
    return unpack_codes(packed), d, m


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
        codes, d, m = merge(parts)
        rows, cols = codes.shape
        if rows % 16 or cols % GROUP:  # the CPU kernel packs 16 output rows at a time
            return None
        d, m = d.float(), m.float()
        zero = m + 8 * d
        scale_zero = torch.stack([d.t(), zero.t()], dim=-1).to(dtype).contiguous()
        return cls(torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1),
                   scale_zero)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale_zero))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, K] @ W^T -> [M, N]."""
        return torch._weight_int4pack_mm_for_cpu(x, self.packed, GROUP, self.scale_zero)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
