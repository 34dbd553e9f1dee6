"""A GGUF's Q8_0 blocks as the checkpoint keeps them (the default model's embedding, which is
also its LM head): 32 weights share a float16 scale d, w = d * q with q an int8.

In the checkpoint a Q8_0 weight `X.weight` has two companions (see COMPANIONS): its codes as
int8 [N, K], and d as float16 [N, K / 32]. Only the AMX kernel multiplies by them
(model/amx.py): torch has no CPU kernel for 8-bit weights in groups of 32.
"""
from __future__ import annotations

import numpy as np
import torch

GROUP = 32
CODES, SCALE = ".q8_codes", ".q8_scale"
COMPANIONS = (CODES, SCALE)
_Q8_0_BLOCK_BYTES = 34     # float16 d, 32 int8 codes


def split_q8_0(raw: np.ndarray, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF Q8_0 tensor's bytes -> (codes int8 [rows, cols], d float16 [rows, cols/32])."""
    blocks = np.ascontiguousarray(raw).reshape(rows * cols // GROUP, _Q8_0_BLOCK_BYTES)
    d = blocks[:, 0:2].copy().view(np.float16).reshape(rows, cols // GROUP)
    codes = blocks[:, 2:].copy().view(np.int8).reshape(rows, cols)
    return torch.from_numpy(codes), torch.from_numpy(d)


def companion_shapes(rows: int, cols: int) -> dict[str, tuple[int, int]]:
    return {CODES: (rows, cols), SCALE: (rows, cols // GROUP)}


def has_companions(weights: dict[str, torch.Tensor], name: str) -> bool:
    return all(name + suffix in weights for suffix in COMPANIONS)


def dequantize(weights: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """The weight `name` as its companions define it, d * q in float32."""
    return weights[name + SCALE].float().repeat_interleave(GROUP, dim=1) * weights[name + CODES].float()
