"""Attention over the paged KV pool, for a step that mixes decodes and prefill chunks.

Tokens of all sequences in a step are concatenated ([T, ...]). Single-token queries (decodes)
are attended as one batch, by the fused kernel that reads pages in place (kernels/cpu_ops.cpp)
or by `decode_attention_torch`; multi-token queries (prefill chunks) all in one call of the AMX
kernel (kernels/amx_attention.cpp) in bfloat16 or of the AVX-512 one
(kernels/f32_prefill_attention.cpp) in float32 where they apply; otherwise in float32 the
chunks of at most 512 keys as decode queries with causal lengths (`prefill_queries`, one call
of the decode kernel); the rest one sequence at a time by `prefill_attention_torch`, since
their shapes differ. Every read goes through a page table the guard has checked.

A layer's cache is [kv_heads, pages, page_size, head_dim]: gathering a batch's pages gives
[kv_heads, batch, keys, head_dim] directly, which batched matmuls take without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from isoserve.kv.pool import NO_PAGE, page_tables


@dataclass
class PrefillChunk:
    token_start: int          # first row of this chunk in the step's token list
    num_tokens: int
    context_len: int          # tokens of KV the chunk attends to, its own included
    pages: torch.Tensor       # [ceil(context_len / page_size)] page ids


class PrefillQueries(NamedTuple):
    """A step's short prefill chunks as decode queries (StepAttention.prefill_queries)."""
    longer: list[PrefillChunk]   # the chunks left as they are
    rows: torch.Tensor           # [R] the queries' rows in the step
    pages: torch.Tensor          # [R, width] each query's chunk's page table, padded with NO_PAGE
    lens: torch.Tensor           # [R] keys each query attends to: the chunk's before it and itself


@dataclass
class StepAttention:
    write_slots: torch.Tensor    # [T] pool slot (page * page_size + offset) of each token's K/V
    decode_rows: torch.Tensor    # [Bd] rows of single-token queries
    decode_pages: torch.Tensor   # [Bd, M] page tables, padded with NO_PAGE (-1)
    decode_lens: torch.Tensor    # [Bd] keys each decode attends to, its own included
    prefills: list[PrefillChunk]
    _decode_bias: torch.Tensor | None = field(default=None, repr=False)
    _prefill_tables: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _prefill_queries: dict[int, PrefillQueries] = field(default_factory=dict, repr=False)
    _prefill_pages: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)

    def decode_bias(self, page_size: int) -> torch.Tensor:
        """[Bd, M*page_size] float: 0 for real keys, -inf for padding; built once per step."""
        if self._decode_bias is None:
            keys = torch.arange(self.decode_pages.shape[1] * page_size, device=self.decode_lens.device)
            padding = keys[None, :] >= self.decode_lens[:, None]
            self._decode_bias = torch.zeros(padding.shape, device=padding.device).masked_fill_(
                padding, float("-inf"))
        return self._decode_bias

    def prefill_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([C, 3] first row, rows and context of each prefill chunk, [C, width] their page
        tables padded with NO_PAGE), for the kernel that takes them all at once; built once per step."""
        if self._prefill_tables is None:
            chunks = torch.tensor([[c.token_start, c.num_tokens, c.context_len] for c in self.prefills],
                                  dtype=torch.int64).reshape(-1, 3)
            tables = [c.pages.tolist() for c in self.prefills]
            self._prefill_tables = chunks, page_tables(tables, max(map(len, tables), default=1))
        return self._prefill_tables

    def prefill_pages(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the distinct pool pages the prefill chunks read, ascending; prefill_tables()'s page
        tables with each id replaced by its index in that list, NO_PAGE kept): for a copy of
        just those pages in another dtype. Built once per step."""
        if self._prefill_pages is None:
            _, tables = self.prefill_tables()
            real = tables != NO_PAGE
            used, index = torch.unique(tables[real], return_inverse=True)
            local = torch.full_like(tables, NO_PAGE)
            local[real] = index
            self._prefill_pages = used, local
        return self._prefill_pages

    def prefill_queries(self, max_context: int) -> PrefillQueries:
        """The prefill chunks of at most `max_context` keys as single-token queries, each over
        the keys before it and itself (the others left as chunks); built once per step."""
        if max_context not in self._prefill_queries:
            short = [i for i, c in enumerate(self.prefills) if c.context_len <= max_context]
            chunks = [self.prefills[i] for i in short]
            _, tables = self.prefill_tables()
            counts = torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64)
            self._prefill_queries[max_context] = PrefillQueries(
                longer=[c for c in self.prefills if c.context_len > max_context],
                rows=torch.cat([torch.arange(c.token_start, c.token_start + c.num_tokens) for c in chunks]
                               or [torch.zeros(0, dtype=torch.int64)]),
                pages=tables[short].repeat_interleave(counts, dim=0),
                lens=torch.cat([torch.arange(c.context_len - c.num_tokens + 1, c.context_len + 1) for c in chunks]
                               or [torch.zeros(0, dtype=torch.int64)]))
        return self._prefill_queries[max_context]


DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepAttention, float], torch.Tensor]
# (q, k_cache, v_cache, attn, scale, out): writes the prefill chunks' rows of out.
PrefillAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, StepAttention, float, torch.Tensor], None]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v: [T, kv_heads, head_dim] into their slots, rounded to the pool's dtype where it is
    narrower than the model's (config.parse_kv_dtype)."""
    heads, dim = k_cache.shape[0], k_cache.shape[-1]
    for cache, x in ((k_cache, k), (v_cache, v)):
        rows = x.transpose(0, 1).to(cache.dtype)
        if cache.element_size() == 1:  # torch has no index_copy_ for float8: copy its bytes
            cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
        cache.view(heads, -1, dim).index_copy_(1, slots, rows)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, attn: StepAttention,
                    scale: float, decode_attention: DecodeAttention,
                    prefill_attention: PrefillAttention) -> torch.Tensor:
    """q: [T, heads, head_dim]; caches: [kv_heads, pages, page_size, head_dim] -> [T, heads, head_dim]."""
    if not attn.prefills:
        return decode_attention(q, k_cache, v_cache, attn, scale)
    out = torch.empty_like(q)
    if attn.decode_rows.numel():
        out[attn.decode_rows] = decode_attention(q[attn.decode_rows], k_cache, v_cache, attn, scale)
    prefill_attention(q, k_cache, v_cache, attn, scale, out)
    return out


def prefill_attention_torch(q, k_cache, v_cache, attn: StepAttention, scale, out,
                            chunks: list[PrefillChunk] | None = None) -> None:
    """Each prefill chunk (or each of `chunks`) by torch's scaled_dot_product_attention, one at a time."""
    for chunk in attn.prefills if chunks is None else chunks:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = _prefill_attention(q[rows], k_cache, v_cache, chunk, scale)


def _gather(cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, M] page ids -> [kv_heads, B, M * page_size, head_dim] in the model's `dtype` (a
    bfloat16 pool under a float32 model widens exactly). Padding (NO_PAGE) gathers page 0,
    which the decode bias masks out."""
    # index_select on the flat id list is several times faster on CPU than advanced indexing.
    x = cache.index_select(1, pages.flatten().clamp(min=0))  # [H_kv, B*M, S, D]
    return x.view(cache.shape[0], pages.shape[0], pages.shape[1] * cache.shape[2], cache.shape[3]).to(dtype)


def decode_attention_torch(q, k_cache, v_cache, attn: StepAttention, scale):
    """One query token per sequence, as torch ops: gather the pages, then two batched matmuls
    (torch's CPU flash kernel is built for long query blocks and was 20x slower here for a
    single query)."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    k = _gather(k_cache, attn.decode_pages, q.dtype)  # [H_kv, B, L, D]
    v = _gather(v_cache, attn.decode_pages, q.dtype)
    keys = k.shape[2]
    # Query heads grouped under their KV head: [H_kv, B, G, D].
    qg = q.view(batch, kv_heads, group, dim).transpose(0, 1)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [H_kv, B, G, L]
    scores = scores + attn.decode_bias(k_cache.shape[2]).view(1, batch, 1, keys)
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v)  # [H_kv, B, G, D]
    return out.transpose(0, 1).reshape(batch, heads, dim)


def _prefill_attention(q, k_cache, v_cache, chunk: PrefillChunk, scale):
    n, ctx = chunk.num_tokens, chunk.context_len
    k = _gather(k_cache, chunk.pages[None], q.dtype)[:, 0, :ctx].unsqueeze(0)  # [1, H_kv, ctx, D]
    v = _gather(v_cache, chunk.pages[None], q.dtype)[:, 0, :ctx].unsqueeze(0)
    q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if n == ctx:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # The chunk's queries sit at positions ctx-n .. ctx-1: causal with an offset.
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
