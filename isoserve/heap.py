"""Keep a worker's freed memory for reuse instead of handing it back to the OS at every free.

glibc serves an allocation above its mmap threshold (128 KiB at start, raised after each such
free up to 32 MiB) with a fresh mmap and returns it with munmap when freed; the next one of the
same size then faults in and zeroes every page again. A float32 prefill step of 32 x 100 tokens
makes [3200, 3072] gate-up outputs of 39 MB in every layer: above 32 MiB, so each was mapped,
faulted in and unmapped anew: 360,000 page faults and 6.8-7.1 s a step on a Zen 3; with this,
none from the second step on and 4.9-5.6 s, the peak resident size the same (2.4 GB). Worker
processes (server/launcher.py) fix the threshold at 1 GiB and keep up to 1 GiB of freed heap
untrimmed: their working set is the same from one step to the next, so the memory is reused,
never leaked. Some glibc releases refuse a threshold above 32 MiB; there the workers keep 32 MiB
and say so. The offline API leaves the user's process as it is (README: the same through
glibc's MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("isoserve.heap")

M_TRIM_THRESHOLD = -1   # mallopt's parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
OLD_GLIBC_MAX_THRESHOLD = 32 << 20  # what glibc releases that cap the threshold accept at most
TRIM_THRESHOLD = 1 << 30            # both fit mallopt's C int


def _mallopt():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        return None


def keep_freed_memory() -> int:
    """Set this process's glibc thresholds; returns the mmap threshold now in force (bytes), or
    0 where glibc's mallopt is not there or refused it (with a log line either way)."""
    mallopt = _mallopt()
    if mallopt is None:
        log.info("heap thresholds left as they are: no glibc mallopt in this process")
        return 0
    threshold = next((t for t in (MMAP_THRESHOLD, OLD_GLIBC_MAX_THRESHOLD) if mallopt(M_MMAP_THRESHOLD, t)), 0)
    if threshold < MMAP_THRESHOLD:
        log.warning("glibc accepted an mmap threshold of %d MiB only (asked for %d): allocations above "
                    "it are still mapped and faulted in anew at every step", threshold >> 20, MMAP_THRESHOLD >> 20)
    if not mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        log.warning("glibc refused a heap trim threshold of %d MiB", TRIM_THRESHOLD >> 20)
    return threshold
