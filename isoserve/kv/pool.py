"""The KV pool: pages of `page_size` token slots spanning all layers, and who wrote each page.

A page is the same range of token slots in every layer. The tensor is layer-major,
[layers, 2 (K, V), kv_heads, pages, page_size, head_dim], so each layer's K and V are
contiguous per head: the hot path writes and gathers them with a single index op, and a
gathered batch is already in the [heads, batch, keys, dim] shape attention multiplies.
Whole-page access (transfer, scrub) goes through read_page / write_page.

Next to the tensor, each page carries three fields (DESIGN invariant 3), kept on the CPU
because the scheduler and the guard run there:
  writer  -- tag of the request that wrote it since its allocation, UNWRITTEN after allocation
  epoch   -- allocation epoch, a fresh, ever-growing number at every allocation
  filled  -- how many of its slots (from slot 0) hold KV written by `writer`
"""
from __future__ import annotations

import torch

from isoserve.model.config import ModelConfig

UNWRITTEN = 0  # writer tag of a page that nobody has written since it was allocated
NO_PAGE = -1   # pads page tables: never a page of the pool, so a kernel that reads it fails


def page_tables(rows: list[list[int]], width: int) -> torch.Tensor:
    """Page lists as one [len(rows), width] int64 tensor, padded with NO_PAGE: a row whose
    length ran past its own pages makes the fused decode kernel refuse the step rather than
    read another sequence's page."""
    return torch.tensor([r + [NO_PAGE] * (width - len(r)) for r in rows], dtype=torch.int64)


class KVPool:
    def __init__(self, model: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"a KV pool needs pages (got {num_pages}) of at least one slot "
                             f"(got page_size={page_size})")
        self.page_size = page_size
        self.kv = torch.zeros(model.num_layers, 2, model.num_kv_heads, num_pages, page_size,
                              model.head_dim, dtype=dtype, device=device)
        # Each layer's K and V views, made once: indexing the tensor anew for every layer of
        # every step cost 0.16 ms (60 index ops), more than the read guard does at batch 32.
        self._layer_views = [(self.kv[i, 0], self.kv[i, 1]) for i in range(model.num_layers)]
        self.writer = torch.zeros(num_pages, dtype=torch.int64)
        self.epoch = torch.zeros(num_pages, dtype=torch.int64)
        self.filled = torch.zeros(num_pages, dtype=torch.int32)

    @staticmethod
    def page_bytes(model: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
        return page_size * model.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size())

    @classmethod
    def pages_for(cls, model: ModelConfig, page_size: int, dtype: torch.dtype, *,
                  kv_tokens: int | None = None, kv_memory_bytes: int | None = None) -> int:
        """Pages for a capacity given in tokens (rounded up to whole pages) or in bytes."""
        if (kv_tokens is None) == (kv_memory_bytes is None):
            raise ValueError("give the KV pool size either in tokens or as a memory budget")
        if kv_tokens is not None:
            return -(-kv_tokens // page_size)
        return kv_memory_bytes // cls.page_bytes(model, page_size, dtype)

    @property
    def num_pages(self) -> int:
        return self.kv.shape[3]

    @property
    def capacity_tokens(self) -> int:
        """Real capacity, read from the allocated tensor rather than from the configuration."""
        return self.kv.shape[3] * self.kv.shape[4]

    @property
    def slot_bytes(self) -> int:
        """Bytes of one token slot over all layers, K and V."""
        return self.kv[:, :, :, 0, 0].numel() * self.kv.element_size()

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [kv_heads, pages, page_size, head_dim] of one layer's K and V."""
        return self._layer_views[layer]

    def read_page(self, page: int, filled: int) -> torch.Tensor:
        """A page's first `filled` slots in every layer, as one contiguous [layers, 2, heads,
        filled, dim] tensor: slots past `filled` (an earlier owner's KV) are never copied out."""
        return self.kv[:, :, :, page, :filled].contiguous()

    def write_page(self, page: int, data: torch.Tensor) -> None:
        """Write slots [0, data.shape[3]) of a page; the caller stamps the writer."""
        self.kv[:, :, :, page, :data.shape[3]] = data.to(self.kv.device)

    def stamp_writes(self, pages: torch.Tensor, tags: torch.Tensor, end_slots: torch.Tensor) -> None:
        """Record that `tags[i]` wrote slots [.., end_slots[i]) of `pages[i]`.

        Writes of one request are appends (the guard has checked that a write never starts
        past the filled slots of its own page), so the filled count is the end of the write.
        """
        self.writer[pages] = tags
        self.filled[pages] = end_slots.to(torch.int32)

    def scrub(self, pages: list[int]) -> None:
        """Zero pages (defense in depth on release; the guard does not depend on it)."""
        if pages:
            self.kv[:, :, :, torch.as_tensor(pages, dtype=torch.long, device=self.kv.device)] = 0
