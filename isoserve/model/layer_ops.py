"""The steps of a decoder layer between its matmuls, two ways with one meaning.

  rms_norm        RMSNorm in float32, rounded to the model dtype, times the weight
  add_rms_norm    the residual add (in place) followed by the next RMSNorm
  rotary_store    RoPE on Q and K from the merged QKV projection; K and V into their pool slots
  decode_attention  single-query attention over each sequence's pages
  prefill_attention causal attention of each prefill chunk over its pages
  silu_mul        SwiGLU over the merged gate-up projection
  argmax          greedy tokens: each logits row's first maximal index (the sampler's, not a
                  layer's, but the same choice of implementation)
  nucleus         top-p: each row's probabilities inside its nucleus (the sampler's too, and
                  on the CPU whatever the model's device: kernels/nucleus.cpp wherever it
                  is built, the reference engine/nucleus.py with --no-fused-kernels or
                  where nothing is built)
  draw            a token from each row of softmax(logits / temperature), for the rows
                  with neither top-k nor top-p (kernels/draw.cpp, on the CPU, with AVX-512 or AVX2;
                  None: the sampler's torch ops, the reference)

`TorchOps` runs them as torch ops; it is the reference. `FusedOps` runs each as one call into
the fused CPU kernels (kernels/cpu_ops.cpp and the others kernels/module.cpp binds), which round where the
reference rounds, but for the plain draw: its weights round apart from torch's softmax (the
same distribution; a target within ~1e-7 of a boundary may take the neighbouring token). At batch 1
the torch versions are ~50 small op calls per layer, a third of the step's time; fused, a
handful. The decode kernel also reads K and V where they lie in the pool instead of gathering
a padded copy first. Prefill attention takes every chunk of the step in one kernel call on
AMX in bfloat16 (kernels/amx_attention.cpp) and on AVX-512 in float32
(kernels/f32_prefill_attention.cpp); elsewhere torch's flash kernel, one chunk at a time, or in
float32 on AVX2 the decode kernel for short chunks.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from isoserve.engine.nucleus import nucleus_weights
from isoserve.model.paged_attention import (StepAttention, decode_attention_torch, prefill_attention_torch,
                                             write_kv)
from isoserve.model.rope import apply_rotary

log = logging.getLogger("isoserve.model")

FUSED_DTYPES = (torch.bfloat16, torch.float32)


class TorchOps:
    name = "torch ops"
    kernels = None  # the read guard (kv/guard.py) then checks with tensor ops too

    def __init__(self, nucleus=nucleus_weights, draw=None):
        # The sampler's top-p: the reference, or a built CPU kernel with its bits (select_ops);
        # its plain temperature draw: torch ops (None), or a built CPU kernel.
        self.nucleus = nucleus
        self.draw = draw

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # Normalize in float32 as the reference implementation does, then return to the model dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x.add_(y)
        return cls.rms_norm(x, weight, eps)

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    @staticmethod
    def rotary_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor, heads: int) -> torch.Tensor:
        kv_heads, dim = k_cache.shape[0], k_cache.shape[-1]
        qk, v = qkv.split([(heads + kv_heads) * dim, kv_heads * dim], dim=-1)
        # Q and K heads are adjacent in the merged projection: one rotation serves both.
        qk = apply_rotary(qk.reshape(-1, heads + kv_heads, dim), cos, sin)
        q, k = qk.split([heads, kv_heads], dim=1)
        write_kv(k_cache, v_cache, k, v.view(-1, kv_heads, dim), slots)
        return q

    decode_attention = staticmethod(decode_attention_torch)
    prefill_attention = staticmethod(prefill_attention_torch)

    @staticmethod
    def amx_prefill_for(head_dim: int, page_size: int, kv_dtype: torch.dtype) -> bool:
        return False

    @staticmethod
    def prefill_kernel_for(head_dim: int, page_size: int, kv_dtype: torch.dtype) -> str:
        return ""

    @staticmethod
    def argmax(logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)



# Where the AVX-512 float32 prefill kernel does not apply (AVX2), prefill chunks of at most this
# many keys go through the float32 decode kernel, one query row at a time
# (FusedOps.prefill_attention); longer ones through torch's flash kernel.
SHORT_PREFILL_CONTEXT = 512


class FusedOps:
    name = "fused CPU kernels"

    def __init__(self, kernels, dtype: torch.dtype):
        self.kernels = kernels  # the read guard uses them too (kv/guard.py)
        self._amx_prefill = dtype == torch.bfloat16 and kernels.amx_status() == ""
        self._f32_prefill = dtype == torch.float32 and kernels.f32_prefill_status() == ""
        self._prefill_as_decode = dtype == torch.float32
        self.rms_norm = kernels.rms_norm
        self.add_rms_norm = kernels.add_rms_norm
        self.silu_mul = kernels.silu_mul
        self.rotary_store = kernels.rotary_store
        self.argmax = kernels.argmax_rows
        self.nucleus = kernels.nucleus_rows
        self.draw = cpu_draw(kernels)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         attn: StepAttention, scale: float) -> torch.Tensor:
        # q comes contiguous from rotary_store (or from indexing the decode rows); the kernel
        # refuses anything else rather than copying on the hot path.
        return self.kernels.decode_attention(q, k_cache, v_cache, attn.decode_pages,
                                             attn.decode_lens, scale)

    def amx_prefill_for(self, head_dim: int, page_size: int, kv_dtype: torch.dtype) -> bool:
        """Whether prefill attention runs on AMX for this shape: the kernel takes a head of 32 or
        64 dims (its four output tiles) and pages of whole 16-key tiles, in bfloat16 (a float8
        pool's pages are widened to it first); torch's kernel the rest."""
        return (self._amx_prefill and kv_dtype in (torch.bfloat16, torch.float8_e4m3fn)
                and head_dim in (32, 64) and page_size % 16 == 0)

    def f32_prefill_for(self, head_dim: int, kv_dtype: torch.dtype) -> bool:
        """Whether float32 prefill attention runs on the AVX-512 kernel (f32_prefill_attention.cpp)
        for this shape: a head of 32, 64 or 128 dims over a float32, bfloat16 or float8 pool (a
        float8 pool's pages widened to bfloat16 first); elsewhere the decode kernel and torch's."""
        return self._f32_prefill and head_dim in (32, 64, 128) and kv_dtype in (
            torch.float32, torch.bfloat16, torch.float8_e4m3fn)

    def prefill_kernel_for(self, head_dim: int, page_size: int, kv_dtype: torch.dtype) -> str:
        """The kernel that takes every prefill chunk of a step in one call, for the startup log:
        "AMX", "AVX-512 float32", or "" where the chunks go their other ways."""
        if self.amx_prefill_for(head_dim, page_size, kv_dtype):
            return "AMX"
        return "AVX-512 float32" if self.f32_prefill_for(head_dim, kv_dtype) else ""

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          attn: StepAttention, scale: float, out: torch.Tensor) -> None:
        kernel = self.prefill_kernel_for(q.shape[-1], k_cache.shape[2], k_cache.dtype)
        if kernel:
            chunks, pages = attn.prefill_tables()
            if k_cache.dtype == torch.float8_e4m3fn:
                # The pages the chunks read (the read guard passed their tables), widened exactly to
                # bfloat16 in a pool of their own: the same scores a bfloat16 pool holding these
                # values gives. Whole pages, so a last page's slots past its chunk's context come
                # along; neither kernel reads a key past a context there either.
                # 32 x 100-token prompts: ~0.1 ms a layer to widen; the decode kernel on the
                # float8 pool instead took the whole step 30% longer (AMX).
                used, pages = attn.prefill_pages()
                k_cache = self.kernels.fp8_pages_to_bf16(k_cache, used)
                v_cache = self.kernels.fp8_pages_to_bf16(v_cache, used)
            call = self.kernels.prefill_attention if kernel == "AMX" else self.kernels.prefill_attention_f32
            call(q, k_cache, v_cache, chunks, pages, out, scale)
        elif self._prefill_as_decode:
            # A short chunk's queries as decode queries with causal lengths, all chunks in one
            # call: torch's flash kernel spends more on a chunk's setup than on its arithmetic
            # here (32 chunks of 100 tokens: 27.9 ms a layer, 11.0 this way, on a Zen 3; the
            # whole step 1.45 s against 1.60 on a Zen 4), but shares each key across a block of
            # queries, which a long context pays back (2,000 tokens: 62 ms a layer against
            # 126). Each query row's attention is then the same however its prompt was cut
            # into chunks, so chunked prefill and recompute after preemption give the tokens of
            # an unsplit prefill (tests/test_engine_batching.py); flash's blocks differ by cut.
            short = attn.prefill_queries(SHORT_PREFILL_CONTEXT)
            if short.rows.numel():
                out[short.rows] = self.kernels.decode_attention(q[short.rows], k_cache, v_cache, short.pages,
                                                                short.lens, scale)
            prefill_attention_torch(q, k_cache, v_cache, attn, scale, out, short.longer)
        else:
            prefill_attention_torch(q, k_cache, v_cache, attn, scale, out)


def cpu_draw(kernels):
    """The CPU kernel's temperature draw where it was built (AVX-512, or AVX2 with FMA), else None."""
    return kernels.temperature_draw if kernels.has_temperature_draw else None


def select_ops(device: torch.device, dtype: torch.dtype, fused: bool = True) -> tuple[TorchOps | FusedOps, str]:
    """The fused kernels where asked for, built and applicable; else torch ops, with the reason
    (and, where only the model's device or dtype rules the kernels out, the built CPU kernel's
    top-p nuclei and plain draw: the sampler runs on the CPU)."""
    if not fused:
        return TorchOps(), "fused kernels turned off"
    if device.type != "cpu" or dtype not in FUSED_DTYPES:
        # The sampler draws on the CPU whatever the model's device: its top-p nuclei (the
        # reference's bits, ~10x faster) and its plain draw (~3x) take the CPU kernels where
        # they are built, never waiting for a build.
        from isoserve.kernels import built_cpu_ops
        kernels = built_cpu_ops()
        ops = TorchOps(kernels.nucleus_rows, cpu_draw(kernels)) if kernels is not None else TorchOps()
        return ops, f"fused kernels are for float32/bfloat16 on CPU, not {dtype} on {device.type}"
    from isoserve.kernels import try_cpu_ops
    kernels, why = try_cpu_ops()
    if kernels is None:
        log.warning("%s; running the layers as torch ops", why)
        return TorchOps(), why
    return FusedOps(kernels, dtype), ""
