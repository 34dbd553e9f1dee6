"""Page allocation: the only place that hands out pages and takes them back.

Allocation gives each page a fresh epoch and resets its writer to UNWRITTEN, so KV left by an
earlier owner can never pass the guard as the new owner's (it is fenced by the epoch and
by the writer tag). Freeing a page that is not allocated is an engine bug and raises.

Which free page an allocation gets does not matter to isolation, only to speed: decode
attention reads a sequence's pages one after another, and the memory system follows a run of
adjacent pages but not pages scattered over the pool (batch-32 attention over a worker's pool
took 1.3-1.5x as long with the pages scattered, bench/attention_threads.py). Free pages are handed
out oldest-freed first, except that a sequence growing past its last page gets the page right
after it when that one is free, and so do the later pages of one allocation. Without that, the
free list is the order sequences finished in and each sequence grows a page at a time among
everyone else's: after 1,000 requests through a decode worker's pool none of a sequence's next
pages followed its last, and attention took as long as over pages scattered at random. With it
91% do, and attention takes about as long as over a fresh pool (docs/benchmarks.md; the
requests simulated through this allocator by bench/attention_threads.py).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from isoserve import failpoints
from isoserve.kv.pool import UNWRITTEN, KVPool


class OutOfPages(Exception):
    """Not enough free pages right now (the scheduler preempts or waits)."""


class PageAllocator:
    def __init__(self, pool: KVPool, *, scrub_freed_pages: bool = False):
        self.pool = pool
        self.scrub_freed_pages = scrub_freed_pages
        # The free pages, oldest-freed first; a dict so that the page after a sequence's last
        # can leave it from the middle. Always exactly the pages not in _allocated.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(pool.num_pages))
        self._allocated = [False] * pool.num_pages
        self._last_epoch = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.pool.num_pages - len(self._free)

    def allocate(self, n: int, after: int | None = None) -> tuple[list[int], list[int]]:
        """Take `n` pages; returns (pages, their new epochs). `after`: the last page the caller
        already holds, whose successor it would rather have (a hint: any free page is safe)."""
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        pages = []
        for _ in range(n):
            page = self._next_free(pages[-1] if pages else after)
            self._allocated[page] = True
            pages.append(page)
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

    def _next_free(self, after: int | None) -> int:
        """Removes a free page from the free list and returns it: `after + 1` if it is free."""
        if after is not None and after + 1 in self._free:
            del self._free[after + 1]
            return after + 1
        return self._free.popitem(last=False)[0]

    def free(self, pages: list[int]) -> None:
        # Check every page before changing any: a refused free must not release half its pages.
        if len(set(pages)) < len(pages) or not all(self._allocated[p] for p in pages):
            bad = sorted({p for p in pages if not self._allocated[p] or pages.count(p) > 1})
            raise RuntimeError(f"pages {bad} freed twice or never allocated")
        for p in pages:
            self._allocated[p] = False
        if self.scrub_freed_pages:
            self.pool.scrub(pages)
        self._free.update(dict.fromkeys(pages))

    def is_allocated(self, page: int) -> bool:
        return self._allocated[page]
