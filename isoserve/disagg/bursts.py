"""Short, bounded waits that keep a burst of requests in one step.

On a CPU host a step costs mostly its weights (read and widened once per step, whatever the
batch): a step of 1 prompt followed by a step of 31 costs nearly two steps of 32, and a decode
step of 1 sequence nearly one of 32. The split also persists in a closed loop: requests that
start decoding together end together, their successors arrive together, and a request one
step ahead of the rest prefills and decodes alone again at every turn, holding a core that
its peers' prefill needs. On a 2-core host at 32 concurrent requests these waits (with the
transfers built on one thread, worker.py) took every decode step to a full batch of 32 and
tokens/s from 1,074-1,128 to 1,175-1,197 (docs/benchmarks.md). Two waits keep a burst together:

  PromptGather   a prefill worker with no step running holds newly arrived prompts until none
                 has arrived for `quiet_s` (at most GATHER_LIMIT times that from the first), or
                 a full step's worth of prompts is waiting. 0 turns it off.
  TransferBurst  a decode worker starts no step while a prefill step's KV transfers to it are
                 still arriving: each transfer says how many more the sender is sending right
                 after it (Manifest.following). The wait ends at the last one, or TRANSFER_GAP_S
                 after the latest, whichever comes first.

Both only delay a step; neither drops, reorders or times out a request.
"""
from __future__ import annotations

GATHER_LIMIT = 5  # a gather never holds the first prompt longer than this many quiet periods
# Transfers of one prefill step leave ~1-2 ms apart (build_manifest, one thread); a gap this long
# means the rest are not coming (a sender that failed between two sends).
TRANSFER_GAP_S = 0.05


class PromptGather:
    def __init__(self, quiet_s: float, max_tokens: int, max_seqs: int):
        self.quiet_s = quiet_s
        self.max_tokens = max_tokens
        self.max_seqs = max_seqs
        self._first: float | None = None  # arrival times of the prompts held so far
        self._last = 0.0

    @property
    def holding(self) -> bool:
        return self._first is not None

    def arrived(self, now: float) -> None:
        if self._first is None:
            self._first = now
        self._last = now

    def hold_s(self, now: float, *, idle: bool, waiting_tokens: int, waiting_seqs: int) -> float:
        """Seconds to wait before the next step (0: start it now). `idle`: no step of this
        worker is under way (no prompt mid-prefill)."""
        if self._first is None:
            return 0.0
        full = waiting_tokens >= self.max_tokens or waiting_seqs >= self.max_seqs
        left = min(self._last + self.quiet_s, self._first + GATHER_LIMIT * self.quiet_s) - now
        if not idle or full or left <= 0:
            self._first = None  # released: the next gather starts at the next arrival
            return 0.0
        return left


class TransferBurst:
    def __init__(self, gap_s: float = TRANSFER_GAP_S):
        self.gap_s = gap_s
        self._until: float | None = None

    def received(self, following: int, now: float) -> None:
        """A transfer came in; `following` more of its burst are on their way."""
        self._until = now + self.gap_s if following > 0 else None

    def hold_s(self, now: float) -> float:
        if self._until is None:
            return 0.0
        left = self._until - now
        if left <= 0:
            self._until = None
            return 0.0
        return left
