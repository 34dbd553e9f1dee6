"""The read guard (DESIGN invariant 3): before a forward step, every page a sequence's
attention will read must have been written by that sequence, in the page's current epoch,
over every slot read.

It works on page tables, not on attention kernels, so it covers every attention variant the
model runs. One vectorized check covers the whole batch; a sequence that fails is reported
and dropped from the step, the others go on.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from isoserve.kv.pool import KVPool


@dataclass
class ReadCheck:
    """Per-sequence facts the guard compares with the pool, as [B] / [B, M] tensors."""
    tags: torch.Tensor         # [B] writer tag of each sequence
    page_table: torch.Tensor   # [B, M] pages of each sequence, padded with 0
    page_valid: torch.Tensor   # [B, M] bool, False on padding
    epochs: torch.Tensor       # [B, M] epoch each page had when the sequence got it
    read_before: torch.Tensor  # [B] positions [0, read_before) must already hold own KV


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


def check_reads(pool: KVPool, check: ReadCheck) -> list[Violation]:
    page_size = pool.page_size
    pages = check.page_table
    col = torch.arange(pages.shape[1], dtype=torch.int64)
    # Slots of page j that this step reads as already-written KV.
    needed = (check.read_before[:, None] - col[None, :] * page_size).clamp(0, page_size)
    writer = pool.writer[pages]
    epoch = pool.epoch[pages]
    filled = pool.filled[pages]
    epoch_ok = epoch == check.epochs
    owner_ok = (needed == 0) | ((writer == check.tags[:, None]) & (filled >= needed))
    bad = check.page_valid & ~(epoch_ok & owner_ok)
    if not bool(bad.any()):
        return []
    violations = []
    for row in torch.nonzero(bad.any(dim=1)).flatten().tolist():
        cols = torch.nonzero(bad[row]).flatten()
        violations.append(Violation(
            row=row, pages=pages[row, cols].tolist(), expected_tag=int(check.tags[row]),
            found_tags=writer[row, cols].tolist(), expected_epochs=check.epochs[row, cols].tolist(),
            found_epochs=epoch[row, cols].tolist(), filled=filled[row, cols].tolist(),
            needed=needed[row, cols].tolist()))
    return violations
