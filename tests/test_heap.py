"""Worker processes keep freed memory for reuse (isoserve/heap.py): a large allocation comes
from the heap, where a freed one stays for the next, instead of a fresh mapping that is
faulted in and unmapped every time. Checked in fresh interpreters, one with and one without:
glibc maps a 64 MiB block by default (above its own 32 MiB cap for the mmap threshold)."""
from __future__ import annotations

import subprocess
import sys

_SCRIPT = """
import ctypes, sys
from isoserve.heap import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.free.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_void_p], [ctypes.c_ssize_t]
block = libc.malloc(64 << 20)
print(block < libc.sbrk(0))  # below the heap's end: carved from the heap, not mapped apart
libc.free(block)
"""


def _from_heap(mode: str) -> bool:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], check=True, capture_output=True, text=True)
    return out.stdout.split()[-1] == "True"


def test_a_large_block_comes_from_the_heap_only_where_freed_memory_is_kept():
    assert not _from_heap("default")
    assert _from_heap("keep")
