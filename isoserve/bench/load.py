"""The two ways of offering load.

Closed loop: C workers, each sending its next request when its previous one finished, so
exactly C requests are in flight (the server's throughput sets the pace).
Open loop: requests arrive as a Poisson process at R per second whatever the server does
(seeded exponential gaps), so queues grow when R is above what the server sustains.
"""
from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, Sequence

from isoserve.bench.client import RequestRecord
from isoserve.bench.workload import RequestSpec

Send = Callable[[RequestSpec], Awaitable[RequestRecord]]


async def closed_loop(specs: Sequence[RequestSpec], concurrency: int, send: Send,
                      on_done: Callable[[], None]) -> list[RequestRecord]:
    pending = iter(specs)  # shared: each worker takes the next spec
    records: list[RequestRecord] = []

    async def worker() -> None:
        for spec in pending:
            records.append(await send(spec))
            on_done()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


async def open_loop(specs: Sequence[RequestSpec], rate: float, send: Send,
                    on_done: Callable[[], None], seed: int) -> list[RequestRecord]:
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    start, due = loop.time(), 0.0
    tasks = []
    for spec in specs:
        due += rng.expovariate(rate)
        delay = start + due - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
        task = asyncio.create_task(send(spec))
        task.add_done_callback(lambda _: on_done())
        tasks.append(task)
    return list(await asyncio.gather(*tasks))
