"""The event loop isoserve's asyncio programs run on: uvloop where it is installed.

The router (`isoserve serve`) and the benchmark client stream one Server-Sent Event per token,
so at 32 concurrent requests the loop's own work per event is a real share of the CPU the
workers compete for on a small host. uvloop (libuv, as uvicorn's `standard` extra installs it)
is that loop at less cost: over three pairs of fresh disaggregated servers at 32 concurrent on
this project's 2-core VMs, the router used 2.6-2.7 CPU-s per 128 requests against 2.7-3.5 on
asyncio's own loop, and the benchmark client 4.2 against 4.7-5.7 (docs/benchmarks.md).
A platform uvloop does not support (Windows) runs on asyncio's loop.
"""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main), on uvloop's loop where uvloop is installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)
