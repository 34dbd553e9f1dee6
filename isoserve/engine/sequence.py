"""State of one request inside an engine: its tokens, its pages, how far its KV is computed."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from isoserve.engine.sampling_params import SamplingParams
from isoserve.errors import IsoserveError

if TYPE_CHECKING:
    from isoserve.engine.detokenizer import OutputText


class Status(enum.Enum):
    WAITING = "waiting"            # queued, holds no pages
    AWAITING_KV = "awaiting_kv"    # holds pages that a KV transfer must fill (decode workers)
    RUNNING = "running"            # scheduled step by step
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the k most likely tokens and their logprobs


@dataclass
class Sequence:
    request_id: str
    tag: int  # writer tag stamped on every page this sequence writes; unique in its engine
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # order of arrival, for FIFO and for picking preemption victims
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    page_epochs: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in this sequence's pages
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: IsoserveError | None = None
    text: str = ""          # detokenized output so far (stop strings applied)
    output_text: OutputText | None = None  # detokenizes it token by token (engine/detokenizer.py)
    emitted_text_len: int = 0
    emitted_tokens: int = 0
    keep_kv_on_finish: bool = False  # prefill workers hand the pages to a transfer first
    num_preemptions: int = 0
    # time.monotonic() instants (see engine/deadlines.py); None: no limit
    queue_deadline: float | None = None
    generation_deadline: float | None = None

    @property
    def queued(self) -> bool:
        """Waiting and never started (a preempted sequence has started: it is not queued)."""
        return self.status is Status.WAITING and self.num_preemptions == 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (decode reads one token)."""
        n = len(self.prompt_token_ids)
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return (self.prompt_token_ids + self.output_token_ids)[start:end]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
