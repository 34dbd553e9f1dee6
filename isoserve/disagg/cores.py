"""Sharing one host's cores between the workers `serve` starts on it.

Disaggregated workers on one host split its cores (by default, cores / workers each). Under
real load they are rarely busy at once: closed-loop clients move in waves, so the prefill
worker is idle while the decode worker generates, and the other way round. A core held by an
idle worker is wasted. So each worker marks itself busy or idle in a small shared file, and
before each step a busy worker takes `cores // busy workers` torch threads: all of them when
it is alone, its even share when the others work too.

The file holds one 8-byte slot per worker: 0 when idle, the worker's pid while busy. A slot
whose pid no longer runs counts as idle, so a worker that died busy does not hold its cores.
A worker that turns busy while a peer is inside a step with all the cores oversubscribes them
for that one step; the peer takes its share at its next step.
"""
from __future__ import annotations

import mmap
import os
import struct

SLOT = struct.Struct("<q")


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def create_share_file(path: str, workers: int) -> None:
    """A share file for `workers` slots, all idle. `serve` makes one per host before starting
    its workers; each worker opens it with its own slot."""
    with open(path, "wb") as f:
        f.write(bytes(SLOT.size * workers))


class CoreShare:
    def __init__(self, path: str, slot: int, cores: int | None = None):
        self.cores = cores or host_cores()
        self.pid = os.getpid()
        with open(path, "r+b") as f:
            self._map = mmap.mmap(f.fileno(), 0)
        self.slots = len(self._map) // SLOT.size
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
        """Torch threads for this worker's next step: the host's cores split evenly among the
        workers busy now, this one included (at least one)."""
        return max(1, self.cores // (1 + self.busy_peers()))

    def close(self) -> None:
        self.set_busy(False)
        self._map.close()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
