"""Worker processes keep freed memory for reuse (isoserve/heap.py): a large allocation comes
from the heap, where a freed one stays for the next, instead of a fresh mapping that is
faulted in and unmapped every time. Checked in fresh interpreters, one with and one without,
by glibc's own count of the bytes it has mapped (mallinfo): by default a 64 MiB block is
mapped (above glibc's own 32 MiB cap for its threshold); after keep_freed_memory() it is mapped
exactly when it is not below the threshold the call reports."""
from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
import ctypes, sys
from isoserve.heap import keep_freed_memory
threshold = keep_freed_memory() if sys.argv[1] == "keep" else -1
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):  # mallinfo2 (glibc >= 2.33): size_t fields; mallinfo before: int
    _fields_ = [(name, ctypes.c_size_t if hasattr(libc, "mallinfo2") else ctypes.c_int)
                for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                             "uordblks", "fordblks", "keepcost")]
info = getattr(libc, "mallinfo2", None) or libc.mallinfo
info.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes = [ctypes.c_size_t], [ctypes.c_void_p]
before = info().hblkhd
block = libc.malloc(64 << 20)
print(threshold, info().hblkhd - before >= 64 << 20)  # the block's bytes among the mapped ones
libc.free(block)
"""


def _run(mode: str) -> tuple[int, bool]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES"))}
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], check=True, capture_output=True, text=True, env=env)
    threshold, mapped = out.stdout.split()[-2:]
    return int(threshold), mapped == "True"


def test_a_large_block_is_mapped_apart_only_above_the_threshold_workers_set():
    assert _run("default")[1]
    threshold, mapped = _run("keep")
    assert threshold > 0  # this is glibc: mallopt is there and took one of the two thresholds
    assert mapped == (64 << 20 >= threshold)
