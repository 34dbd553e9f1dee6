"""The read guard (DESIGN invariant 3): before a forward step, every page a sequence's
attention will read must have been written by that sequence, in the page's current epoch,
over every slot read.

It works on page tables, not on attention kernels, so it covers every attention variant the
model runs. One check covers the whole batch; a sequence that fails is reported and dropped
from the step, the others go on.

Finding the failing pages is done one of two ways with one meaning: by the fused CPU kernels'
`check_reads` (kernels/cpu_ops.cpp), one pass over the lists the scheduler already holds,
or by `failing_pages_torch`, the same comparisons as tensor ops, which is the reference the
kernel is tested against (tests/test_kv_properties.py). At batch 1 the tensor version's
~20 small ops were 2% of a decode step.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from isoserve.kv.pool import KVPool, page_tables


@dataclass
class ReadCheck:
    """Per-sequence facts the guard compares with the pool."""
    tags: list[int]            # writer tag of each sequence
    tables: list[list[int]]    # pages of each sequence, in order
    epochs: list[list[int]]    # epoch each page had when the sequence got it
    read_before: list[int]     # positions [0, read_before) must already hold own KV


@dataclass
class Violation:
    row: int
    pages: list[int]
    expected_tag: int
    found_tags: list[int]
    expected_epochs: list[int]
    found_epochs: list[int]
    filled: list[int]
    needed: list[int]

    def describe(self) -> str:
        return (f"pages={self.pages} expected_tag={self.expected_tag} found_tags={self.found_tags} "
                f"expected_epochs={self.expected_epochs} found_epochs={self.found_epochs} "
                f"filled={self.filled} needed={self.needed}")


def check_reads(pool: KVPool, check: ReadCheck, kernels: ModuleType | None = None) -> list[Violation]:
    """Every page of every sequence must be in the pool, in the epoch the sequence got it in,
    and written by the sequence over the slots read before this step. One Violation per
    sequence that fails, naming its failing pages."""
    if not check.tags:
        return []
    if kernels is not None:  # it refuses mismatched lists itself (RuntimeError)
        bad = kernels.check_reads(pool.writer, pool.epoch, pool.filled, check.tags, check.tables,
                                  check.epochs, check.read_before, pool.page_size)
    else:
        bad = failing_pages_torch(pool, check)
    return _violations(pool, check, bad) if bad else []


def needed_slots(read_before: int, col: int, page_size: int) -> int:
    """Slots of a sequence's page `col` that this step reads as already-written KV."""
    return max(0, min(page_size, read_before - col * page_size))


def failing_pages_torch(pool: KVPool, check: ReadCheck) -> list[tuple[int, int]]:
    """(row, col) of every failing page, as one batch of tensor ops."""
    if any(len(e) != len(t) for e, t in zip(check.epochs, check.tables)) or not (
            len(check.tags) == len(check.tables) == len(check.epochs) == len(check.read_before)):
        # Padded and broadcast, mismatched lists would be compared without an error.
        raise ValueError("a read check needs one tag, table, epoch list and read_before per "
                         "sequence, and one epoch per page")
    page_size, width = pool.page_size, max(len(t) for t in check.tables)
    if width == 0:
        return []
    pages = page_tables(check.tables, width)
    valid = torch.arange(width)[None, :] < torch.tensor([len(t) for t in check.tables])[:, None]
    in_pool = (pages >= 0) & (pages < pool.num_pages)
    safe = pages.where(in_pool, 0)  # look up something for out-of-pool ids; they fail anyway
    col = torch.arange(width, dtype=torch.int64)
    needed = (torch.tensor(check.read_before)[:, None] - col[None, :] * page_size).clamp(0, page_size)
    epoch_ok = pool.epoch[safe] == page_tables(check.epochs, width)
    owner_ok = (needed == 0) | ((pool.writer[safe] == torch.tensor(check.tags)[:, None])
                                & (pool.filled[safe] >= needed))
    bad = valid & ~(in_pool & epoch_ok & owner_ok)
    return [tuple(rc) for rc in torch.nonzero(bad).tolist()]


def _violations(pool: KVPool, check: ReadCheck, bad: list[tuple[int, int]]) -> list[Violation]:
    by_row: dict[int, list[int]] = {}
    for row, col in bad:
        by_row.setdefault(row, []).append(col)

    def field(values: torch.Tensor, page: int) -> int:
        return int(values[page]) if 0 <= page < pool.num_pages else -1  # -1: not a page of the pool

    violations = []
    for row, cols in sorted(by_row.items()):
        pages = [check.tables[row][c] for c in cols]
        violations.append(Violation(
            row=row, pages=pages, expected_tag=check.tags[row],
            found_tags=[field(pool.writer, p) for p in pages],
            expected_epochs=[check.epochs[row][c] for c in cols],
            found_epochs=[field(pool.epoch, p) for p in pages],
            filled=[field(pool.filled, p) for p in pages],
            needed=[needed_slots(check.read_before[row], c, pool.page_size) for c in cols]))
    return violations

