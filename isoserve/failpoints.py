"""Named fault-injection points in real code paths, to reproduce known bug classes.

Inert unless the process starts with --enable-failpoints AND ISOSERVE_FAILPOINTS names them,
e.g. "prefill.placeholder_on_reject=always;transfer.truncate=1in3;transfer.delay_ms=200".
Without both, `fire()` is a dictionary lookup on an empty dict and returns False.

Triggers: always | off | once | 1inN (every N-th hit) | P% (seeded, reproducible) | an integer
value for the *_ms points (always fires, with that value), or VALUExN: that value for the first
N hits only, then off. Each process counts its own hits, so a worker the supervisor restarts
starts again from zero: "transfer.delay_ms=1000x4" holds the first 4 transfers of each
prefill process open for a second, and lets the rest go at once.
"""
from __future__ import annotations

import logging
import os
import random
import re

log = logging.getLogger("isoserve.failpoints")

KNOWN = {
    "prefill.placeholder_on_reject": "a prefill worker that cannot take a prompt transfers a one-token placeholder as if complete",
    "transfer.truncate": "send only the first half of a prompt's pages, with a manifest that says so",
    "transfer.drop_page": "leave one page out of a transfer (manifest and payload)",
    "transfer.duplicate": "send a transfer twice",
    "transfer.reorder": "send a transfer's pages in reverse order",
    "transfer.corrupt_bytes": "flip bytes of one page after its checksum was taken",
    "transfer.delay_ms": "wait this many milliseconds before sending a transfer",
    "decode.skip_tag_stamp": "write received KV without stamping the writer tag",
    "decode.stamp_whole_prompt": "stamp every prompt page as written by a transfer, whatever it carried",
    "decode.decode_on_deadline": "when a request's KV misses its deadline, decode over its pages anyway",
    "allocator.skip_epoch_bump": "allocate pages without giving them a fresh epoch",
    "allocator.skip_tag_reset": "allocate pages without resetting writer and filled slots",
    "prefill.crash_mid_transfer": "exit the prefill process while a transfer is being sent",
    "decode.crash_mid_stream": "exit the decode process after a request has streamed some tokens",
    "worker.step_delay_ms": "sleep this many milliseconds after each engine step (a slow model: "
                            "keeps requests in flight long enough to kill a worker under them)",
}


_COUNTED = re.compile(r"\d+x\d+")  # VALUExN: a *_ms value for the first N hits


class Failpoints:
    def __init__(self, spec: str = "", enabled: bool = False, seed: int = 0):
        self._rules: dict[str, str] = {}
        self._hits: dict[str, int] = {}
        self._rng = random.Random(seed)
        if not enabled:
            if spec:
                log.warning("ISOSERVE_FAILPOINTS is set but --enable-failpoints is not: ignored")
            return
        for item in filter(None, (x.strip() for x in spec.split(";"))):
            name, _, trigger = item.partition("=")
            name = name.strip()
            if name not in KNOWN:
                raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(KNOWN))}")
            self._rules[name] = trigger.strip() or "always"
        for name, trigger in self._rules.items():
            log.warning("FAILPOINT ACTIVE: %s=%s (%s)", name, trigger, KNOWN[name])

    def fire(self, name: str) -> bool:
        trigger = self._rules.get(name)
        if trigger is None or trigger == "off":
            return False
        n = self._hits[name] = self._hits.get(name, 0) + 1
        if trigger == "always" or trigger.isdigit():
            return True
        if _COUNTED.fullmatch(trigger):
            return n <= int(trigger.partition("x")[2])
        if trigger == "once":
            return n == 1
        if trigger.startswith("1in"):
            return n % int(trigger[3:]) == 0
        if trigger.endswith("%"):
            return self._rng.random() * 100 < float(trigger[:-1])
        raise ValueError(f"bad trigger {trigger!r} for failpoint {name}")

    def value(self, name: str) -> int:
        """The integer a *_ms failpoint carries, when it fires; else 0."""
        trigger = self._rules.get(name, "")
        if not (trigger.isdigit() or _COUNTED.fullmatch(trigger)):
            return 0
        return int(trigger.partition("x")[0]) if self.fire(name) else 0


# One per process; workers configure it at start from their flags and environment.
FAILPOINTS = Failpoints()


def configure(enabled: bool) -> Failpoints:
    global FAILPOINTS
    FAILPOINTS = Failpoints(os.environ.get("ISOSERVE_FAILPOINTS", ""), enabled)
    return FAILPOINTS


def fire(name: str) -> bool:
    return FAILPOINTS.fire(name)
