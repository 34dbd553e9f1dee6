"""The KV pool: pages of `page_size` token slots spanning all layers, and who wrote each page.

Layout is page-major, [pages, layers, 2 (K, V), page_size, kv_heads, head_dim], so one page is
one contiguous block of bytes: a transfer, a checksum or a scrub touches a page as a whole.

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


class KVPool:
    def __init__(self, model: ModelConfig, num_pages: int, page_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"a KV pool needs pages (got {num_pages}) of at least one slot "
                             f"(got page_size={page_size})")
        self.page_size = page_size
        self.kv = torch.zeros(num_pages, model.num_layers, 2, page_size, model.num_kv_heads,
                              model.head_dim, dtype=dtype, device=device)
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
        return self.kv.shape[0]

    @property
    def capacity_tokens(self) -> int:
        """Real capacity, read from the allocated tensor rather than from the configuration."""
        return self.kv.shape[0] * self.kv.shape[3]

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def layer_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views [pages, page_size, kv_heads, head_dim] of one layer's K and V."""
        return self.kv[:, layer, 0], self.kv[:, layer, 1]

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
            self.kv[torch.as_tensor(pages, dtype=torch.long, device=self.kv.device)] = 0
