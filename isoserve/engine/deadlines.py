"""Per-request time limits, each ending the request with its own error code.

    queue       from arrival until work on the request begins        -> 503 queue_timeout
    generation  from arrival until the last token                   -> 504 generation_timeout
    (transfer   decode side: until the verified KV arrives; see disagg/roles.py
                                                                      -> 500 kv_transfer_incomplete)

They travel between processes as seconds left (clocks of different hosts are not compared)
and become monotonic instants where they are enforced.
"""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Deadlines:
    queue_s: float | None = None
    generation_s: float | None = None

    def to_wire(self) -> dict:
        return {"queue_s": self.queue_s, "generation_s": self.generation_s}

    @classmethod
    def from_wire(cls, data: dict | None) -> Deadlines:
        data = data or {}
        return cls(_seconds(data.get("queue_s")), _seconds(data.get("generation_s")))

    def remaining(self, since: float) -> Deadlines:
        """What is left of these limits `since` (a time.monotonic() instant) has passed."""
        spent = time.monotonic() - since
        return Deadlines(None if self.queue_s is None else max(0.0, self.queue_s - spent),
                         None if self.generation_s is None else max(0.0, self.generation_s - spent))

    def instants(self, now: float | None = None) -> tuple[float | None, float | None]:
        """(queue, generation) as time.monotonic() instants."""
        now = time.monotonic() if now is None else now
        return (None if self.queue_s is None else now + self.queue_s,
                None if self.generation_s is None else now + self.generation_s)


def _seconds(value) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not value >= 0:  # also NaN
        raise ValueError(f"a deadline must be a number of seconds >= 0, got {value!r}")
    return value
