"""Which of a GGUF's own quantized forms a Projection multiplies by, and up to how many rows.

Measured on this project's 2-core CPUs (docs/benchmarks.md), a step of R rows is fastest:
  - with AMX (model/amx.py): torch's int4 kernel for R <= 2 (the AMX kernel's time goes into
    widening the blocks, which one or two rows do not pay back), the AMX Q4_1 kernel up to 32;
    the LM head by its Q8_0 blocks on AMX up to 32;
  - without AMX: torch's int4 kernel up to 4 (model/int4.py), the LM head in bfloat16;
  - above those, the prepacked bfloat16 weight (model/projection.py).
In float32 (where `--dtype auto` picks it: a CPU without a native bfloat16 path, or a Q4_1 GGUF
on AVX512-VNNI without AMX, int8_blocks_preferred), on AVX2 or AVX512-VNNI:
  - by default the int8 block kernels (model/int8_blocks.py): the activations quantized to int8
    by blocks of 32, as llama.cpp computes these files; for the Q4_1 projections and the Q8_0
    LM head in every step (faster than float32 at every size measured, 1 to 2,048 rows);
  - with int8 activations off, the float32 block kernels (model/vector_blocks.py) up to 512
    rows, where they were measured faster than the prepacked float32 weight (at 3,200 rows the
    two were even), and the prepacked float32 weight the rest.
`max_rows` (the engine's int4_max_rows) replaces the top limit; 0 turns the quantized forms off.
"""
from __future__ import annotations

import torch

from isoserve.model import q8_0
from isoserve.model.amx import AmxQ4SwigluWeight, AmxQ4Weight, AmxQ8Weight, amx_unavailable
from isoserve.model.int8_blocks import Int8Q4SwigluWeight, Int8Q4Weight, Int8Q8Weight, int8_unavailable
from isoserve.model.int4 import COMPANIONS as Q4_1_COMPANIONS, Int4Weight
from isoserve.model.vector_blocks import VectorQ4Weight, VectorQ8Weight, vector_unavailable

# Names ending so are a GGUF's blocks kept beside a weight, not parameters of the model.
COMPANION_SUFFIXES = Q4_1_COMPANIONS + q8_0.COMPANIONS

AMX_DEFAULT_MAX_ROWS = 32    # up to here AMX beat the prepacked bfloat16 matmul
TORCH_DEFAULT_MAX_ROWS = 4   # from 5 rows on, bfloat16 beat torch's int4 kernel
TORCH_ON_AMX_MAX_ROWS = 2    # and up to here it beat the AMX kernel
VECTOR_DEFAULT_MAX_ROWS = 512  # float32: up to here the AVX2 block kernels beat float32's matmul
# float32, int8 activations: every step. 30 layers' projections on a Zen 3, 2 threads: 32 rows
# 25 ms against 46 (float32 block kernels) and 60 (prepacked float32); 512 rows 370 against 636
# and 808; 2,048 rows 1.48 s against 2.65 and 2.83.
INT8_DEFAULT_MAX_ROWS = EVERY_STEP = 2**62

Weight = (AmxQ4Weight | AmxQ4SwigluWeight | AmxQ8Weight | Int4Weight | VectorQ4Weight | VectorQ8Weight | Int8Q4Weight
          | Int8Q4SwigluWeight | Int8Q8Weight)
Tier = tuple[int, Weight]  # (most rows, weight)


def int8_blocks_preferred(auto) -> bool:
    """Whether `--dtype auto` should run a model (config.AutoInputs: the model and its run's
    options) in float32 with int8 activations on this CPU although it computes in bfloat16
    natively: where the CPU has no AMX, the int8 kernels run their AVX512-VNNI tiles and take
    every step (the float32 tier q4_tiers would build: no --int4-max-rows, above which a step
    would multiply dense float32 weights), and the model is a GGUF with Q4_1 projections. On a
    2-core AMD Zen 4 that ran 1.26x bfloat16's output tokens/s at batch 32 and 1.15x its
    2,000-token prefill (docs/benchmarks.md). With AMX, the AMX kernels multiply bfloat16 by
    those blocks faster still; without VNNI (AVX2 alone) nobody measured this choice on a CPU
    with native bfloat16; and dense weights compute twice as fast in bfloat16 as in float32."""
    from isoserve.kernels import try_cpu_ops
    from isoserve.model.loader import has_q4_1_blocks
    from isoserve.model.registry import resolve_model
    if not auto.fused_kernels or auto.int4_max_rows is not None:
        return False
    try:
        if resolve_model(auto.model).kind != "gguf":
            return False
        kernels, _ = try_cpu_ops()
        if (kernels is None or not _int8_applies(kernels, auto.int8_activations)
                or amx_unavailable(kernels) == "" or kernels.int8_isa() != "avx512-vnni"):
            return False
        return has_q4_1_blocks(auto.model, auto.cache_dir)
    except Exception:  # an unknown or unreadable model: loading it says so, in its own words
        return False


def require_int8_activations(dtype: torch.dtype, kernels, max_rows: int | None) -> str:
    """'' when int8 activations can run for this model, else why not."""
    if dtype != torch.float32:
        return f"they are for float32 runs, and this one is in {str(dtype).removeprefix('torch.')}"
    if max_rows == 0:
        return "the quantized forms are off (int4_max_rows 0)"
    return int8_unavailable(kernels)


def _float32_tier(int8: Weight | None, vector: Weight | None, max_rows: int | None) -> list[Tier]:
    """The int8 kernel's weight where there is one, else the float32 block kernel's."""
    if int8 is not None:
        return [(INT8_DEFAULT_MAX_ROWS if max_rows is None else max_rows, int8)]
    if vector is None:
        return []
    return [(VECTOR_DEFAULT_MAX_ROWS if max_rows is None else max_rows, vector)]


def _int8_applies(kernels, int8_activations: bool | None) -> bool:
    return int8_activations is not False and int8_unavailable(kernels) == ""


def q4_tiers(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], dtype: torch.dtype,
             kernels=None, max_rows: int | None = None, int8_activations: bool | None = None,
             gate_up: bool = False) -> list[Tier]:
    """A projection's tiers from its Q4_1 (codes, d, m) parts; [] where none applies.
    int8_activations: in float32, None or True takes the int8 kernel where it runs.
    gate_up: the parts are a gate and an up projection; the int8 or AMX kernel then computes
    SwiGLU too."""
    if max_rows == 0:
        return []
    if dtype == torch.float32 and vector_unavailable(kernels) == "":
        int8 = None
        if _int8_applies(kernels, int8_activations):
            int8 = ((Int8Q4SwigluWeight.from_companions(parts, kernels) if gate_up else None)
                    or Int8Q4Weight.from_companions(parts, kernels))
        return _float32_tier(int8, None if int8 else VectorQ4Weight.from_companions(parts, kernels), max_rows)
    if dtype != torch.bfloat16:
        return []
    torch_int4 = Int4Weight.from_companions(parts, dtype)
    amx = None  # built only where it takes rows torch's kernel does not
    if amx_unavailable(kernels) == "" and (torch_int4 is None or max_rows is None
                                           or max_rows > TORCH_ON_AMX_MAX_ROWS):
        amx = ((AmxQ4SwigluWeight.from_companions(parts, kernels) if gate_up else None)
               or AmxQ4Weight.from_companions(parts, kernels))
    if amx is None:
        rows = TORCH_DEFAULT_MAX_ROWS if max_rows is None else max_rows
        return [(rows, torch_int4)] if torch_int4 is not None else []
    rows = AMX_DEFAULT_MAX_ROWS if max_rows is None else max_rows
    if torch_int4 is None:
        return [(rows, amx)]
    return [(TORCH_ON_AMX_MAX_ROWS, torch_int4), (rows, amx)]


def q8_tiers(codes: torch.Tensor, d: torch.Tensor, dtype: torch.dtype, kernels=None,
             max_rows: int | None = None, int8_activations: bool | None = None) -> list[Tier]:
    """The LM head's tiers from its Q8_0 codes and d: AMX in bfloat16, AVX2 in float32; [] elsewhere."""
    if max_rows == 0:
        return []
    if dtype == torch.float32 and vector_unavailable(kernels) == "":
        int8 = Int8Q8Weight.from_companions(codes, d, kernels) if _int8_applies(kernels, int8_activations) else None
        return _float32_tier(int8, None if int8 else VectorQ8Weight.from_companions(codes, d, kernels), max_rows)
    if dtype != torch.bfloat16 or amx_unavailable(kernels) != "":
        return []
    amx = AmxQ8Weight.from_companions(codes, d, kernels)
    return [] if amx is None else [(AMX_DEFAULT_MAX_ROWS if max_rows is None else max_rows, amx)]
