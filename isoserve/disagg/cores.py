"""Sharing one host's cores between the workers `serve` starts on it.

Disaggregated workers on one host would otherwise split its cores (cores / workers each). Under
real load they are rarely busy at once: closed-loop clients move in waves, so the prefill
worker is idle while the decode worker generates, and the other way round. A core held by an
idle worker is wasted. So each worker marks itself busy or idle in a small shared file, and
the busy ones share the cores by one of two policies:

  split (the default): before each step a busy worker takes `cores // busy workers` torch
      threads, all of them when it is alone. Steps overlap: a prompt's prefill starts on its
      share while decode goes on. But no step starts on cores a peer's running step holds: a
      step that began with every core (its peers were idle then) keeps them until it ends, and
      a peer that turns busy meanwhile waits for that end, receiving as it waits, then both
      split. Starting at once would put a third thread on two cores, and an OpenMP thread
      preempted by the other process stalls its whole step at the next barrier: 25 ms decode
      steps took 100-130 ms beside a one-prompt prefill, ten to eighteen times a run. Waiting
      out the step (at most one decode step, ~25 ms, of a prompt's TTFT) gave 919 / 951 / 874
      tok/s against 841 / 849 / 832 at 32 concurrent requests (docs/benchmarks.md).
  turns: one busy worker steps at a time, with every core, and the busy ones take turns step
      by step. No step runs on a core another worker's step also wants (an OpenMP thread
      preempted by the other process stalls its whole step at the next barrier), and decode
      steps start with fuller batches. On the project's 2-core VMs at 32 concurrent requests it
      gave split's tokens/s within the drift (0.92-1.07x) in ~30% fewer decode steps, an equal
      or lower inter-token p99, a TTFT p99 within 5% or lower, and a 1.4-1.7x higher median
      TTFT (a prefill step waits for each decode step).

The file holds one 8-byte slot per worker (0 when idle, the worker's pid while busy), then one
8-byte count of turns taken, then one 8-byte slot per worker for the step it is running (0, or
its threads << 32 | its pid). A slot whose pid no longer runs counts as idle and stepping on no
cores, so a worker that died busy, or in a step, holds none. The turn itself is an advisory
lock on the file (flock): the kernel releases it when its holder exits, however it exits. A
worker waiting for its turn (or, split, for cores) does not block on it: it goes on receiving (a
decode worker takes in KV transfers and reserves pages for new requests, so the prefill it
waits for can start) and tries again between polls.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
from typing import Callable

SLOT = struct.Struct("<q")
PID_MASK = 0xFFFFFFFF  # a running step's slot: its threads << 32 | its pid
POLICIES = ("split", "turns")

log = logging.getLogger("isoserve.cores")

# A worker waiting for its turn keeps receiving (router messages, KV transfers, reservations)
# and checks the lock between polls of its sockets; it polls this long (ms) while it waits.
TURN_POLL_MS = 1
# After its step a worker leaves the turn to a waiting peer (for at most this long), so that it
# cannot take it straight back; it sends its outputs and goes on receiving meanwhile.
HANDOFF_WAIT_S = 0.005
# No step of a model we serve holds the turn (or, split, the cores) this long; past it, the
# waiting worker steps anyway (oversubscribing the cores) rather than stall behind a stuck peer.
TURN_WAIT_LIMIT_S = 60.0


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def create_share_file(path: str, workers: int) -> None:
    """A share file for `workers` slots, all idle, and a turn count of 0. `serve` makes one per
    host before starting its workers; each worker opens it with its own slot."""
    with open(path, "wb") as f:
        f.write(bytes(SLOT.size * (2 * workers + 1)))


class CoreShare:
    def __init__(self, path: str, slot: int, cores: int | None = None, policy: str = "split",
                 handoff_wait_s: float = HANDOFF_WAIT_S):
        if policy not in POLICIES:
            raise ValueError(f"unknown core-sharing policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.policy = policy
        self.handoff_wait_s = handoff_wait_s
        self.cores = cores or host_cores()
        self.pid = os.getpid()
        self._file = open(path, "r+b")  # kept open: the turn is a lock on this open file
        self._map = mmap.mmap(self._file.fileno(), 0)
        self.slots = (len(self._map) // SLOT.size - 1) // 2
        self._steps_at = self.slots + 1  # the running steps' slots follow the turn count
        self._table = struct.Struct(f"<{self.slots}q")  # one slot per worker, read at once
        if not 0 <= slot < self.slots:
            raise ValueError(f"core-share slot {slot} is outside the file's {self.slots} slots")
        self.slot = slot
        # Since when try_step has found the turn (or, split, every core) taken.
        self._waiting_since: float | None = None
        self._handoff: tuple[int, float] | None = None  # (turns taken, until when) after our turn
        self._busy = None
        self.set_busy(False)  # a restarted worker clears what its predecessor left
        self._end_step()

    def set_busy(self, busy: bool) -> None:
        if not busy:
            self._waiting_since = None
        if busy != self._busy:
            SLOT.pack_into(self._map, self.slot * SLOT.size, self.pid if busy else 0)
            self._busy = busy

    def busy_peers(self) -> int:
        return sum(1 for pid in self._peer_slots(0) if pid and _running(pid))

    def cores_in_peer_steps(self) -> int:
        """Threads the peers' running steps hold now (a dead peer's, none)."""
        return sum(value >> 32 for value in self._peer_slots(self._steps_at)
                   if value and _running(value & PID_MASK))

    def _peer_slots(self, first: int) -> list[int]:
        """The peers' values in the table of per-worker slots that starts at slot `first`."""
        table = self._table.unpack_from(self._map, first * SLOT.size)
        return [value for i, value in enumerate(table) if i != self.slot]

    def _set_stepping(self, threads: int) -> None:
        SLOT.pack_into(self._map, (self._steps_at + self.slot) * SLOT.size,
                       threads << 32 | self.pid if threads else 0)

    def _end_step(self) -> None:
        self._set_stepping(0)

    def threads(self) -> int:
        """Split policy: torch threads for this worker's next step, the host's cores split evenly
        among the workers busy now, this one included (at least one)."""
        return max(1, self.cores // (1 + self.busy_peers()))

    @property
    def turns_taken(self) -> int:
        return SLOT.unpack_from(self._map, self.slots * SLOT.size)[0]

    def try_step(self) -> StepCores | None:
        """The cores for this (busy) worker's next step, or None while a peer's turn lasts (or,
        split, while a peer's step holds every core): the caller goes on receiving and asks again
        after TURN_POLL_MS."""
        if self.policy == "split":
            free = self.cores - self.cores_in_peer_steps()
            if free <= 0 and self._keep_waiting():
                return None  # a peer's step holds every core: wait for its end, then split
            self._waiting_since = None
            threads = max(1, min(self.threads(), free))
            self._set_stepping(threads)
            return StepCores(threads, self._end_step)
        if self._handoff is not None:
            taken, until = self._handoff
            if self.turns_taken == taken and time.monotonic() < until and self.busy_peers():
                return None  # a peer that waited through our step goes first
            self._handoff = None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if self._keep_waiting():
                return None
            return StepCores(self.cores)
        self._waiting_since = None
        SLOT.pack_into(self._map, self.slots * SLOT.size, self.turns_taken + 1)
        return StepCores(self.cores, self._end_turn)

    def _keep_waiting(self) -> bool:
        """Whether to go on waiting for a peer's step (True) or, past TURN_WAIT_LIMIT_S of
        waiting, to step anyway (False, logged)."""
        now = time.monotonic()
        if self._waiting_since is None:
            self._waiting_since = now
        if now - self._waiting_since <= TURN_WAIT_LIMIT_S:
            return True
        log.warning("a peer has held this host's cores for %.0f s: stepping without waiting "
                    "for it", now - self._waiting_since)
        self._waiting_since = None
        return False

    def _end_turn(self) -> None:
        self._handoff = (self.turns_taken, time.monotonic() + self.handoff_wait_s)
        fcntl.flock(self._file, fcntl.LOCK_UN)

    def close(self) -> None:
        self.set_busy(False)
        self._end_step()
        self._map.close()
        self._file.close()


class StepCores:
    """One step's torch threads; as a context manager, around the step, it ends the turn (if
    it holds one) when the step ends."""

    def __init__(self, threads: int, end_turn: Callable[[], None] | None = None):
        self.threads = threads
        self._end_turn = end_turn

    def __enter__(self) -> int:
        return self.threads

    def __exit__(self, *exc) -> None:
        if self._end_turn is not None:
            self._end_turn()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
