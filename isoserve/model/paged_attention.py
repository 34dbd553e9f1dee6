"""Attention over the paged KV pool, for a step that mixes decodes and prefill chunks.

Tokens of all sequences in a step are concatenated ([T, ...]). Single-token queries (decodes)
are attended as one padded batch; multi-token queries (prefill chunks) one sequence at a time,
since their shapes differ. Every read goes through a page table the guard has checked.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    token_start: int          # first row of this chunk in the step's token list
    num_tokens: int
    context_len: int          # tokens of KV the chunk attends to, its own included
    pages: torch.Tensor       # [ceil(context_len / page_size)] page ids


@dataclass
class StepAttention:
    write_slots: torch.Tensor    # [T] pool slot (page * page_size + offset) of each token's K/V
    decode_rows: torch.Tensor    # [Bd] rows of single-token queries
    decode_pages: torch.Tensor   # [Bd, M] page tables, padded with page 0 (masked out)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, M*page_size] bool, True where a key is real
    prefills: list[PrefillChunk]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             attn: StepAttention) -> None:
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, attn.write_slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, attn.write_slots, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    attn: StepAttention, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim]; caches: [pages, page_size, kv_heads, head_dim] -> [T, heads, head_dim]."""
    out = torch.empty_like(q)
    if attn.decode_rows.numel():
        out[attn.decode_rows] = _decode_attention(q[attn.decode_rows], k_cache, v_cache, attn, scale)
    for chunk in attn.prefills:
        rows = slice(chunk.token_start, chunk.token_start + chunk.num_tokens)
        out[rows] = _prefill_attention(q[rows], k_cache, v_cache, chunk, scale)
    return out


def _gather(cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """[..., M] page ids -> [..., kv_heads, M * page_size, head_dim]."""
    # index_select on the flat id list is several times faster on CPU than advanced indexing.
    x = cache.index_select(0, pages.flatten())  # [B*M, S, H, D]
    x = x.view(*pages.shape[:-1], pages.shape[-1] * cache.shape[1], *cache.shape[2:])
    return x.transpose(-3, -2)


def _decode_attention(q, k_cache, v_cache, attn: StepAttention, scale):
    k = _gather(k_cache, attn.decode_pages)  # [B, H_kv, L, D]
    v = _gather(v_cache, attn.decode_pages)
    out = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=attn.decode_mask,
                                         scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _prefill_attention(q, k_cache, v_cache, chunk: PrefillChunk, scale):
    n, ctx = chunk.num_tokens, chunk.context_len
    k = _gather(k_cache, chunk.pages)[:, :ctx].unsqueeze(0)  # [1, H_kv, ctx, D]
    v = _gather(v_cache, chunk.pages)[:, :ctx].unsqueeze(0)
    q = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
    if n == ctx:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # The chunk's queries sit at positions ctx-n .. ctx-1: causal with an offset.
        q_pos = torch.arange(ctx - n, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)
