"""Sharing one host's cores between the workers `serve` starts on it.

Disaggregated workers on one host would otherwise split its cores (cores / workers each). Under
real load they are rarely busy at once: closed-loop clients move in waves, so the prefill
worker is idle while the decode worker generates, and the other way round. A core held by an
idle worker is wasted. So each worker marks itself busy or idle in a small shared file, and
the busy ones share the cores by one of two policies:

  turns (the default): one busy worker steps at a time, with every core, and the busy ones
      take turns step by step. A prompt's prefill runs on all the cores, so its tokens reach
      the decode worker sooner and decode steps start with fuller batches; and no step runs
      on a core that another worker's step also wants. On the project's 2-core VMs the split
      policy ran each worker on one core most of the time while prompts arrived, decode took
      ~40% more steps for the same tokens, and an OpenMP thread preempted by the other
      process stalled its whole step at the next barrier.
  split: before each step a busy worker takes `cores // busy workers` torch threads, all of
      them when it is alone. Steps overlap; better where cores are many and one step cannot
      use them all.

The file holds one 8-byte slot per worker (0 when idle, the worker's pid while busy), then one
8-byte count of turns taken. A slot whose pid no longer runs counts as idle, so a worker that
died busy holds no cores. The turn itself is an advisory lock on the file (flock): the kernel
releases it when its holder exits, however it exits.
"""
from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import time
from contextlib import contextmanager
from typing import Iterator

SLOT = struct.Struct("<q")
POLICIES = ("turns", "split")

log = logging.getLogger("isoserve.cores")

# A worker waiting for its turn checks the lock this often: the wait costs it a syscall per
# check and the step at most this much latency (a decode step is tens of ms).
TURN_POLL_S = 0.0002
# After its step a worker waits (at most this long) for a waiting peer to take the turn, so
# that it cannot take it straight back.
HANDOFF_WAIT_S = 0.005
# No step of a model we serve holds the turn this long; past it, the waiting worker steps
# anyway (oversubscribing the cores) rather than stall behind a stuck peer.
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
        f.write(bytes(SLOT.size * (workers + 1)))


class CoreShare:
    def __init__(self, path: str, slot: int, cores: int | None = None, policy: str = "turns"):
        if policy not in POLICIES:
            raise ValueError(f"unknown core-sharing policy {policy!r}; use one of {', '.join(POLICIES)}")
        self.policy = policy
        self.cores = cores or host_cores()
        self.pid = os.getpid()
        self._file = open(path, "r+b")  # kept open: the turn is a lock on this open file
        self._map = mmap.mmap(self._file.fileno(), 0)
        self.slots = len(self._map) // SLOT.size - 1
        if not 0 <= slot < self.slots:
            raise ValueError(f"core-share slot {slot} is outside the file's {self.slots} slots")
        self.slot = slot
        self._busy = None
        self.set_busy(False)  # a restarted worker clears what its predecessor left

    def set_busy(self, busy: bool) -> None:
        if busy != self._busy:
            SLOT.pack_into(self._map, self.slot * SLOT.size, self.pid if busy else 0)
            self._busy = busy

    def busy_peers(self) -> int:
        count = 0
        for i in range(self.slots):
            if i == self.slot:
                continue
            (pid,) = SLOT.unpack_from(self._map, i * SLOT.size)
            if pid and _running(pid):
                count += 1
        return count

    def threads(self) -> int:
        """Split policy: torch threads for this worker's next step, the host's cores split evenly
        among the workers busy now, this one included (at least one)."""
        return max(1, self.cores // (1 + self.busy_peers()))

    @property
    def turns_taken(self) -> int:
        return SLOT.unpack_from(self._map, self.slots * SLOT.size)[0]

    @contextmanager
    def step(self) -> Iterator[int]:
        """Around one step of this (busy) worker: yields the torch threads the step may use. By
        turns, it holds the turn for the step and hands it to a waiting peer afterwards."""
        if self.policy == "split":
            yield self.threads()
            return
        held = self._take_turn()
        try:
            yield self.cores
        finally:
            if held:
                self._end_turn()

    def _take_turn(self) -> bool:
        waited_since = time.monotonic()
        while True:
            try:
                fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() - waited_since > TURN_WAIT_LIMIT_S:
                    log.warning("a peer has held this host's cores for %.0f s: stepping without "
                                "waiting for it", TURN_WAIT_LIMIT_S)
                    return False
                time.sleep(TURN_POLL_S)
        SLOT.pack_into(self._map, self.slots * SLOT.size, self.turns_taken + 1)
        return True

    def _end_turn(self) -> None:
        taken = self.turns_taken
        fcntl.flock(self._file, fcntl.LOCK_UN)
        handoff_by = time.monotonic() + HANDOFF_WAIT_S
        while self.busy_peers() and self.turns_taken == taken and time.monotonic() < handoff_by:
            time.sleep(TURN_POLL_S)

    def close(self) -> None:
        self.set_busy(False)
        self._map.close()
        self._file.close()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
