"""Page allocation: the only place that hands out pages and takes them back.

Allocation gives each page a fresh epoch and resets its writer to UNWRITTEN, so KV left by an
earlier owner can never pass the guard as the new owner's (it is fenced by the epoch and
by the writer tag). Freeing a page that is not allocated is an engine bug and raises.
"""
from __future__ import annotations

from collections import deque

import torch

from isoserve import failpoints
from isoserve.kv.pool import UNWRITTEN, KVPool


class OutOfPages(Exception):
    """Not enough free pages right now (the scheduler preempts or waits)."""


class PageAllocator:
    def __init__(self, pool: KVPool, *, scrub_freed_pages: bool = False):
        self.pool = pool
        self.scrub_freed_pages = scrub_freed_pages
        self._free: deque[int] = deque(range(pool.num_pages))
        self._allocated = [False] * pool.num_pages
        self._last_epoch = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.pool.num_pages - len(self._free)

    def allocate(self, n: int) -> tuple[list[int], list[int]]:
        """Take `n` pages; returns (pages, their new epochs)."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._allocated[p] = True
        if failpoints.fire("allocator.skip_epoch_bump"):
            epochs = self.pool.epoch[pages].tolist()  # the bug: pages keep their old epoch
        else:
            epochs = list(range(self._last_epoch + 1, self._last_epoch + 1 + n))
            self._last_epoch += n
            self.pool.epoch[pages] = torch.tensor(epochs, dtype=torch.int64)
        if not failpoints.fire("allocator.skip_tag_reset"):
            self.pool.writer[pages] = UNWRITTEN
            self.pool.filled[pages] = 0
        return pages, epochs

    def free(self, pages: list[int]) -> None:
        # Check every page before changing any: a refused free must not release half its pages.
        if len(set(pages)) < len(pages) or not all(self._allocated[p] for p in pages):
            bad = sorted({p for p in pages if not self._allocated[p] or pages.count(p) > 1})
            raise RuntimeError(f"pages {bad} freed twice or never allocated")
        for p in pages:
            self._allocated[p] = False
        if self.scrub_freed_pages:
            self.pool.scrub(pages)
        self._free.extend(pages)

    def is_allocated(self, page: int) -> bool:
        return self._allocated[page]

