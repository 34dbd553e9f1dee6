"""Which of a GGUF's own quantized forms a Projection multiplies by, and up to how many rows.

Measured on this project's 2-core CPUs (docs/benchmarks.md), a step of R rows is fastest:
  - with AMX (model/amx.py): torch's int4 kernel for R <= 2 (the AMX kernel's time goes into
    widening the blocks, which one or two rows do not pay back), the AMX Q4_1 kernel up to 32;
    the LM head by its Q8_0 blocks on AMX up to 32;
  - without AMX: torch's int4 kernel up to 4 (model/int4.py), the LM head in bfloat16;
  - above those, the prepacked bfloat16 weight (model/projection.py).
In float32 (a CPU without a native bfloat16 path, where `--dtype auto` picks it) the float32
block kernels (model/vector_blocks.py, AVX2) take the Q4_1 projections and the Q8_0 LM head up
to 512 rows, where they were measured faster than the prepacked float32 weight (at 3,200 rows
the two were even), and the prepacked weight the rest.
`max_rows` (the engine's int4_max_rows) replaces the top limit; 0 turns the quantized forms off.
"""
from __future__ import annotations

import torch

from isoserve.model import q8_0
from isoserve.model.amx import AmxQ4Weight, AmxQ8Weight, amx_unavailable
from isoserve.model.int4 import COMPANIONS as Q4_1_COMPANIONS, Int4Weight
from isoserve.model.vector_blocks import VectorQ4Weight, VectorQ8Weight, vector_unavailable

# Names ending so are a GGUF's blocks kept beside a weight, not parameters of the model.
COMPANION_SUFFIXES = Q4_1_COMPANIONS + q8_0.COMPANIONS

AMX_DEFAULT_MAX_ROWS = 32    # up to here AMX beat the prepacked bfloat16 matmul
TORCH_DEFAULT_MAX_ROWS = 4   # from 5 rows on, bfloat16 beat torch's int4 kernel
TORCH_ON_AMX_MAX_ROWS = 2    # and up to here it beat the AMX kernel
VECTOR_DEFAULT_MAX_ROWS = 512  # float32: up to here the AVX2 block kernels beat float32's matmul

Tier = tuple[int, AmxQ4Weight | AmxQ8Weight | Int4Weight | VectorQ4Weight | VectorQ8Weight]  # (most rows, weight)


def _float32_tier(weight, max_rows: int | None) -> list[Tier]:
    if weight is None:
        return []
    return [(VECTOR_DEFAULT_MAX_ROWS if max_rows is None else max_rows, weight)]


def q4_tiers(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype: torch.dtype,
             kernels=None, max_rows: int | None = None) -> list[Tier]:
    """A projection's tiers from its Q4_1 (codes, d, m) parts; [] where none applies."""
    if max_rows == 0:
        return []
    if dtype == torch.float32 and vector_unavailable(kernels) == "":
        return _float32_tier(VectorQ4Weight.from_companions(parts, kernels), max_rows)
    if dtype != torch.bfloat16:
        return []
    torch_int4 = Int4Weight.from_companions(parts, dtype)
    amx = None  # built only where it takes rows torch's kernel does not
    if amx_unavailable(kernels) == "" and (torch_int4 is None or max_rows is None
                                           or max_rows > TORCH_ON_AMX_MAX_ROWS):
        amx = AmxQ4Weight.from_companions(parts, kernels)
    if amx is None:
        rows = TORCH_DEFAULT_MAX_ROWS if max_rows is None else max_rows
        return [(rows, torch_int4)] if torch_int4 is not None else []
    rows = AMX_DEFAULT_MAX_ROWS if max_rows is None else max_rows
    if torch_int4 is None:
        return [(rows, amx)]
    return [(TORCH_ON_AMX_MAX_ROWS, torch_int4), (rows, amx)]


def q8_tiers(codes: torch.Tensor, d: torch.Tensor, dtype: torch.dtype, kernels=None,
             max_rows: int | None = None) -> list[Tier]:
    """The LM head's tiers from its Q8_0 codes and d: AMX in bfloat16, AVX2 in float32; [] elsewhere."""
    if max_rows == 0:
        return []
    if dtype == torch.float32 and vector_unavailable(kernels) == "":
        return _float32_tier(VectorQ8Weight.from_companions(codes, d, kernels), max_rows)
    if dtype != torch.bfloat16 or amx_unavailable(kernels) != "":
        return []
    amx = AmxQ8Weight.from_companions(codes, d, kernels)
    return [] if amx is None else [(AMX_DEFAULT_MAX_ROWS if max_rows is None else max_rows, amx)]
