"""Engine configuration and the pool capacity arithmetic.

torch is imported only where a dtype is decided: the CLI imports this module, and its commands
that run no model (tenants, probe, bench against a URL) then start without torch's ~2 s import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def default_cache_dir() -> Path:
    """isoserve's own cache: converted weights (model/loader.py) and built kernels (kernels/)."""
    return Path(os.environ.get("ISOSERVE_CACHE_DIR") or Path.home() / ".cache" / "isoserve")


GUARD_NAMES = ("admission", "capacity_audit", "writer_tags", "transfer_coverage", "transfer_checksum")

# Accepted names -> torch's names for them.
DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
          "float16": "float16", "fp16": "float16"}
DTYPE_CHOICES = ("auto", "bfloat16", "float32", "float16")  # the --dtype flags' choices
# A KV pool may also be 8-bit float (e4m3, as vLLM's `--kv-cache-dtype fp8`): half bfloat16's
# bytes for each decode step to read, twice the tokens a pool holds (parse_kv_dtype).
FP8_NAMES = ("float8_e4m3fn", "fp8", "fp8_e4m3")
KV_DTYPE_CHOICES = DTYPE_CHOICES + FP8_NAMES  # the --kv-dtype flags' choices


def native_bfloat16(device: str = "cpu") -> bool:
    """Whether bfloat16 matmuls run natively here. On CPU that is oneDNN's own test (AVX-512
    BW/VL/DQ, or AVX-NE-CONVERT): without it oneDNN refuses to prepack a bfloat16 weight, and
    torch's fallback widens every weight to float32 on every call, slower than float32 itself."""
    import torch

    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@dataclass(frozen=True)
class AutoInputs:
    """What `--dtype auto` looks at besides the device: the model, where its converted weights
    are cached, and the options that decide which kernels multiply its blocks (EngineConfig's
    fields of those names; model/quantized.py's int8_blocks_preferred reads them). Without a
    model, "auto" is the device's own choice: what the benchmarks' peers run in."""
    model: str | None = None
    cache_dir: str | None = None
    fused_kernels: bool = True
    int8_activations: bool | None = None
    int4_max_rows: int | None = None

    @classmethod
    def of(cls, run) -> AutoInputs:
        """From an EngineConfig or the parsed command line: both name these fields alike (a
        command whose --model defaults to None runs the default model)."""
        from isoserve.model.registry import DEFAULT_MODEL
        return cls(getattr(run, "model", None) or DEFAULT_MODEL, getattr(run, "cache_dir", None),
                   getattr(run, "fused_kernels", True), getattr(run, "int8_activations", None),
                   getattr(run, "int4_max_rows", None))


def parse_dtype(name: str | torch.dtype, device: str = "cpu", auto: AutoInputs = AutoInputs()) -> torch.dtype:
    """A dtype by name. "auto" is bfloat16 where the device runs it natively, else float32;
    except that on a CPU without AMX whose int8 block kernels have AVX512-VNNI (AMD Zen 4, say),
    a GGUF whose projections are Q4_1 runs in float32 with int8 activations, which beat its
    bfloat16 matmuls there (model/quantized.py, int8_blocks_preferred)."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name in FP8_NAMES:  # parse_kv_dtype takes these
        raise ValueError("float8 is a KV cache dtype (--kv-dtype); a model runs in bfloat16 or float32")
    if name == "auto":
        if not native_bfloat16(device):
            return torch.float32
        if torch.device(device).type == "cpu" and auto.model is not None:
            from isoserve.model.quantized import int8_blocks_preferred
            if int8_blocks_preferred(auto):
                return torch.float32
        return torch.bfloat16
    try:
        return getattr(torch, DTYPES[name])
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPE_CHOICES)}") from None


def dtype_name(name: str | torch.dtype, device: str = "cpu", auto: AutoInputs = AutoInputs()) -> str:
    """The dtype's full name, "auto" decided: what logs show and workers are started with."""
    return str(parse_dtype(name, device, auto)).removeprefix("torch.")


def parse_kv_dtype(name: str | torch.dtype, dtype: str | torch.dtype, device: str = "cpu",
                   auto: AutoInputs = AutoInputs()) -> torch.dtype:
    """The KV pool's dtype, for a model run in `dtype` (as asked for: "auto" or a name).

    A pool keeps the model's dtype, or bfloat16 under a float32 model: half the bytes each decode
    step reads (decode attention waits on memory at batch 32) and twice the tokens a pool holds.
    K and V are then rounded to bfloat16 as they are written and widened back exactly as read.
    "auto" is the model's dtype, except where `--dtype auto` chose float32 on a CPU (for want
    of native bfloat16, or for the int8 block kernels): there the model runs in float32 only
    for its matmuls' sake, and its KV cache is bfloat16, whatever the checkpoint's dtype
    (`--kv-dtype float32` keeps float32).

    float8_e4m3fn (also "fp8"), under a bfloat16 or float32 model on a CPU: K and V rounded to
    8-bit floats as they are written (to nearest even, saturating at +-448, as torch's .to()
    does), widened exactly as read. Half bfloat16's bytes: at batch 32 of the default model the
    KV a decode step reads outweighs its 4-bit weights. Not exact: each element keeps 3
    mantissa bits, so logits move and greedy tokens can differ from a bfloat16 pool's.
    Any other pair is refused: no kernel reads it."""
    import torch

    model = parse_dtype(dtype, device, auto)
    if name == "auto":
        fell_back = dtype == "auto" and model == torch.float32 and torch.device(device).type == "cpu"
        return torch.bfloat16 if fell_back else model
    kv = torch.float8_e4m3fn if name in FP8_NAMES else parse_dtype(name)
    if kv == torch.float8_e4m3fn:
        if torch.device(device).type != "cpu":
            raise ValueError(f"a float8 KV cache runs on the CPU's kernels only, not on {device}: "
                             f"use --kv-dtype auto there")
        if model not in (torch.bfloat16, torch.float32):
            raise ValueError(f"a float8 KV cache needs a bfloat16 or float32 model, not {dtype_name(model)}")
        return kv
    if kv != model and not (model == torch.float32 and kv == torch.bfloat16):
        raise ValueError(f"a {dtype_name(model)} model cannot keep its KV cache in {dtype_name(kv)}: "
                         f"use --kv-dtype auto or {dtype_name(model)}, or bfloat16 under --dtype float32")
    return kv


def resolve_dtypes(dtype: str, kv_dtype: str, device: str = "cpu", auto: AutoInputs = AutoInputs()) -> tuple[str, str]:
    """(--dtype, --kv-dtype) with "auto" decided, as names: the KV cache's first, since its
    "auto" depends on whether --dtype was "auto". Raises ValueError for a pair no kernel reads."""
    kv = dtype_name(parse_kv_dtype(kv_dtype, dtype, device, auto))
    return dtype_name(dtype, device, auto), kv


def parse_guard_names(text: str | None) -> frozenset[str]:
    names = frozenset(n.strip() for n in (text or "").split(",") if n.strip())
    unknown = names - set(GUARD_NAMES)
    if unknown:
        raise ValueError(f"unknown guard(s) {sorted(unknown)}; guards are {', '.join(GUARD_NAMES)}")
    return names


@dataclass
class EngineConfig:
    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"                  # bfloat16 where the device runs it natively, else float32 (parse_dtype)
    kv_dtype: str = "auto"               # the KV pool's: the model's, or bfloat16 under float32 (parse_kv_dtype)
    device: str = "cpu"
    page_size: int = 16
    kv_tokens: int | None = None         # pool capacity in tokens ...
    kv_memory_bytes: int | None = None   # ... or as a memory budget; default: 2 x context length
    context_length: int | None = None    # default: the model's
    max_num_seqs: int = 64
    # Tokens per step, so the prefill chunk. 2,000-token prompts were 18% faster in one chunk
    # than in chunks of 512 (each chunk gathers the prompt's KV again); a bigger chunk delays
    # the decodes sharing its step, which in disaggregated serving run on another worker.
    max_batched_tokens: int = 2048
    scrub_freed_pages: bool = False
    # Steps of at most this many tokens use a GGUF's own Q4_1 blocks, and on AMX its Q8_0 LM
    # head (bfloat16 on CPU; 0 turns it off; None: the defaults of the kernels that run). Where
    # the CPU has AMX, isoserve's AMX kernels multiply by them, faster than prepacked bfloat16
    # up to 32 rows; elsewhere torch's int4 kernel, ~2.5x cheaper than bfloat16 for one sequence
    # and slower from 5 rows on. See model/quantized.py.
    int4_max_rows: int | None = None
    # In float32 on AVX2 or AVX512-VNNI, the GGUF's Q4_1 and Q8_0 blocks multiply the
    # activations quantized to int8 by blocks of 32, llama.cpp's arithmetic for these files:
    # 1.6x faster matmuls than float32 at 32 rows on a Zen 3, 1.3x bfloat16's on a Zen 4. None: wherever that kernel runs; False: the
    # float32 block kernels; True: required (an error where it cannot run). model/int8_blocks.py.
    int8_activations: bool | None = None
    # Norms, RoPE + KV write, decode attention and SwiGLU as fused CPU kernels (isoserve/kernels)
    # where they build; torch ops otherwise. See model/layer_ops.py.
    fused_kernels: bool = True
    disabled_guards: frozenset[str] = field(default_factory=frozenset)
    cache_dir: str | None = None
    # A running request's output goes out every this many tokens (its first token and its end at
    # once): fewer, larger stream events for less per-token work in the router and the client.
    stream_interval: int = 1

    def pool_tokens_request(self, context_length: int) -> dict:
        """Keyword arguments for KVPool.pages_for: explicit size, or twice the context."""
        if self.kv_tokens is not None:
            return {"kv_tokens": self.kv_tokens}
        if self.kv_memory_bytes is not None:
            return {"kv_memory_bytes": self.kv_memory_bytes}
        return {"kv_tokens": 2 * context_length}
