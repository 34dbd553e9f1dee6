"""Continuous batching with chunked prefill and preemption by recompute.

Each step: running sequences in decode get one token each, then prefill chunks (of running
sequences mid-prefill, then of waiting ones) fill the rest of the token budget. When pages
run out, the most recently arrived running sequence is preempted: its pages go back and it
waits to recompute its KV from scratch, so a sequence only ever reads pages it holds.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from isoserve.engine.sequence import Sequence, Status
from isoserve.kv.allocator import PageAllocator


@dataclass
class ScheduledChunk:
    seq: Sequence
    num_tokens: int  # tokens seq.all_token_ids[num_computed : num_computed + num_tokens]


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_num_seqs: int,
                 max_batched_tokens: int):
        self.allocator = allocator
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self.max_batched_tokens = max_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose pages already hold its KV (a verified transfer) joins decoding."""
        seq.status = Status.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledChunk]:
        chunks: list[ScheduledChunk] = []
        decoding = [s for s in self.running if s.num_uncomputed == 1]
        prefilling = [s for s in self.running if s.num_uncomputed > 1]
        scheduled = 0  # tokens in chunks
        for seq in decoding + prefilling:
            if scheduled == self.max_batched_tokens:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            n = min(seq.num_uncomputed, self.max_batched_tokens - scheduled)
            preemptions = self.num_preemptions
            if self._reserve(seq, n, chunks):  # False: seq itself was preempted
                chunks.append(ScheduledChunk(seq, n))
                scheduled += n
            if self.num_preemptions != preemptions:  # a preemption may have taken chunks back
                scheduled = sum(c.num_tokens for c in chunks)
        budget = self.max_batched_tokens - scheduled
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            n = min(seq.num_uncomputed, budget)
            if self._pages_missing(seq, n) > self.allocator.num_free:
                break  # admission never preempts; it waits for pages
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            self._grow(seq, n)
            chunks.append(ScheduledChunk(seq, n))
            budget -= n
        return chunks

    def finish(self, seq: Sequence) -> None:
        """Take a sequence out of scheduling; pages are released by the engine."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _pages_missing(self, seq: Sequence, n: int) -> int:
        needed = -(-(seq.num_computed + n) // self.page_size)
        return max(0, needed - len(seq.pages))

    def _grow(self, seq: Sequence, n: int) -> None:
        missing = self._pages_missing(seq, n)
        if missing:
            # The page after its last where that one is free: its pages stay in one run.
            pages, epochs = self.allocator.allocate(missing, after=seq.pages[-1] if seq.pages else None)
            seq.pages += pages
            seq.page_epochs += epochs

    def _reserve(self, seq: Sequence, n: int, chunks: list[ScheduledChunk]) -> bool:
        """Make room for `n` more tokens of `seq`, preempting the newest sequences if needed."""
        while self._pages_missing(seq, n) > self.allocator.num_free:
            victim = max(self.running, key=lambda s: s.arrival)
            self._preempt(victim, chunks)
            if victim is seq:
                return False
        self._grow(seq, n)
        return True

    def _preempt(self, seq: Sequence, chunks: list[ScheduledChunk]) -> None:
        for i, chunk in enumerate(chunks):
            if chunk.seq is seq:  # un-schedule it: it holds no pages any more
                del chunks[i]
                break
        self.running.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages, seq.page_epochs = [], []
        seq.num_computed = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
