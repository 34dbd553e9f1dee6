"""One forward step: scheduled chunks -> guard -> model -> stamp pool -> sample.

The guard is a visible step here: a sequence whose pages fail it is taken out of the batch
before the model runs, so no token is ever computed from KV it does not own.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from isoserve.engine.sampler import sample
from isoserve.engine.scheduler import ScheduledChunk
from isoserve.engine.sequence import Sequence, TokenLogprob
from isoserve.kv.guard import ReadCheck, Violation, check_reads
from isoserve.kv.pool import KVPool, page_tables
from isoserve.model.llama import LlamaModel
from isoserve.model.paged_attention import PrefillChunk, StepAttention

log = logging.getLogger("isoserve.engine")


@dataclass
class StepResult:
    sampled: list[tuple[Sequence, int, TokenLogprob | None]]  # sequences that got a new token
    violations: list[tuple[Sequence, Violation]]              # sequences the guard stopped


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, *, check_writer_tags: bool = True):
        self.model = model
        self.pool = pool
        self.check_writer_tags = check_writer_tags
        self.device = model.device

    def execute(self, chunks: list[ScheduledChunk]) -> StepResult:
        violations = self.guard(chunks) if self.check_writer_tags else []
        if violations:
            stopped = {id(seq) for seq, _ in violations}
            chunks = [c for c in chunks if id(c.seq) not in stopped]
        if not chunks:
            return StepResult([], violations)
        inputs = self._build_inputs(chunks)
        logits = self.model.forward(inputs["token_ids"], inputs["positions"], inputs["attn"],
                                    self.pool, inputs["logits_rows"])
        self._stamp(chunks)
        samplers = inputs["samplers"]
        for c in chunks:
            c.seq.num_computed += c.num_tokens
        ops = self.model.ops
        tokens, logprobs = sample(logits, samplers, ops.argmax, ops.nucleus, ops.draw) if samplers else ([], [])
        return StepResult(list(zip(samplers, tokens, logprobs)), violations)

    def guard(self, chunks: list[ScheduledChunk]) -> list[tuple[Sequence, Violation]]:
        return self.guard_sequences([c.seq for c in chunks], [c.seq.num_computed for c in chunks])

    def guard_sequences(self, seqs: list[Sequence], read_before: list[int]) -> list[tuple[Sequence, Violation]]:
        """Check that each sequence owns positions [0, read_before) of its pages (one batch check)."""
        check = ReadCheck(tags=[s.tag for s in seqs], tables=[s.pages for s in seqs],
                          epochs=[s.page_epochs for s in seqs], read_before=read_before)
        found = check_reads(self.pool, check, self.model.ops.kernels)
        for v in found:
            log.error("KV isolation violation: request %s (tag %d) would read KV it does not own: %s",
                      seqs[v.row].request_id, seqs[v.row].tag, v.describe())
        return [(seqs[v.row], v) for v in found]

    def _stamp(self, chunks: list[ScheduledChunk]) -> None:
        """Record the writes of this step: each touched page's writer and filled slots."""
        size = self.pool.page_size
        pages, tags, ends = [], [], []
        for c in chunks:
            s = c.seq
            start, end = s.num_computed, s.num_computed + c.num_tokens
            for j in range(start // size, (end - 1) // size + 1):
                pages.append(s.pages[j])
                tags.append(s.tag)
                ends.append(min(size, end - j * size))
        self.pool.stamp_writes(torch.tensor(pages), torch.tensor(tags, dtype=torch.int64),
                               torch.tensor(ends))

    def _build_inputs(self, chunks: list[ScheduledChunk]) -> dict:
        size = self.pool.page_size
        token_ids, positions, write_slots, logits_rows, samplers = [], [], [], [], []
        decode_rows, decode_tables, decode_lens, prefills = [], [], [], []
        for c in chunks:
            s, n = c.seq, c.num_tokens
            row = len(token_ids)
            start = s.num_computed
            token_ids += s.token_ids_slice(start, start + n)
            positions += range(start, start + n)
            write_slots += (s.pages[p // size] * size + p % size for p in range(start, start + n))
            ctx = start + n
            used_pages = s.pages[: -(-ctx // size)]
            if n == 1:
                decode_rows.append(row)
                decode_tables.append(used_pages)
                decode_lens.append(ctx)
            else:
                prefills.append(PrefillChunk(row, n, ctx, torch.tensor(used_pages, device=self.device)))
            if ctx == s.num_tokens:  # the chunk reaches the last token: sample after it
                logits_rows.append(row + n - 1)
                samplers.append(s)
        pos = torch.tensor(positions, dtype=torch.int64)
        attn = StepAttention(write_slots=torch.tensor(write_slots, dtype=torch.int64, device=self.device),
                             decode_rows=torch.tensor(decode_rows, dtype=torch.int64, device=self.device),
                             decode_pages=self._decode_table(decode_tables),
                             decode_lens=torch.tensor(decode_lens, dtype=torch.int64, device=self.device),
                             prefills=prefills)
        return dict(token_ids=torch.tensor(token_ids, dtype=torch.int64, device=self.device),
                    positions=pos.to(self.device), attn=attn,
                    logits_rows=torch.tensor(logits_rows, dtype=torch.int64, device=self.device),
                    samplers=samplers)

    def _decode_table(self, tables: list[list[int]]) -> torch.Tensor:
        if not tables:
            return torch.zeros(0, 1, dtype=torch.int64, device=self.device)
        return page_tables(tables, max(len(t) for t in tables)).to(self.device)

