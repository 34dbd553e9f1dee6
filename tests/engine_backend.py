"""A Backend over one in-process Engine, for testing the HTTP layer against a real model.

The engine is stepped on its own thread (one engine, one driving thread); requests and aborts
reach it through a queue, and its outputs go back to each request's asyncio queue on the
server's event loop. The production backend is the multi-process router; this one exists so
the API tests exercise real tokens, real logprobs and real aborts without zmq.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator, Callable

from isoserve.admission import check_prompt_fits
from isoserve.engine.engine import Engine, RequestOutput
from isoserve.errors import IsoserveError
from isoserve.server.backend import GenerationRequest

log = logging.getLogger("tests.engine_backend")

Deliver = Callable[[RequestOutput], None]


class EngineBackend:
    def __init__(self, engine: Engine):
        self.engine = engine
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.aborted: list[str] = []       # request ids whose abort reached the engine
        self.received: list[GenerationRequest] = []
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict[str, Deliver] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-backend", daemon=True)
        self._thread.start()

    # ---- the Backend contract -----------------------------------------------------------
    def max_model_len(self) -> int:
        return min(self.engine.context_length, self.engine.capacity_tokens)

    def check_admission(self, prompt_len: int, max_tokens: int) -> None:
        check_prompt_fits(prompt_len, self.engine.prompt_limit(max_tokens), max_tokens)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def deliver(output: RequestOutput) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, output)
            except RuntimeError:  # the server's loop is gone: nobody is listening any more
                pass

        self.received.append(request)
        self._commands.put(("add", request, deliver))
        finished = False
        try:
            while not finished:
                output = await outputs.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._commands.put(("abort", request.request_id, None))

    def healthy(self) -> bool:
        return self._thread.is_alive()

    def status(self) -> dict:
        alloc = self.engine.allocator
        return {"workers": [{
            "name": "engine-0", "role": "aggregated", "pid": os.getpid(), "host": "127.0.0.1",
            "state": "up" if self.healthy() else "down",
            "pool_pages": {"total": self.engine.pool.num_pages, "used": alloc.num_used,
                           "free": alloc.num_free}}]}

    def close(self) -> None:
        self._stop.set()
        self._commands.put(("stop", None, None))
        self._thread.join(timeout=10)

    # ---- the engine thread --------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            # Block while idle; otherwise take what arrived and step.
            block = not self.engine.has_work()
            try:
                self._handle(*self._commands.get(block=block, timeout=0.5 if block else None))
                while True:
                    self._handle(*self._commands.get_nowait())
            except queue.Empty:
                pass
            if self.engine.has_work():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # end every request with an error; healthy() turns False
                    log.exception("engine step failed")
                    for request_id, deliver in self._sinks.items():
                        deliver(RequestOutput(request_id, [], [], "", True, "error",
                                              IsoserveError(f"engine step failed: {e!r}")))
                    self._sinks.clear()
                    raise
                for output in outputs:
                    sink = self._sinks.get(output.request_id)
                    if output.finished:
                        self._sinks.pop(output.request_id, None)
                    if sink is not None:
                        sink(output)

    def _handle(self, command: str, arg, deliver: Deliver | None) -> None:
        if command == "add":
            try:
                self.engine.add_request(arg.request_id, arg.prompt_token_ids, arg.params)
            except IsoserveError as e:  # a refused request ends with its error, like any other
                deliver(RequestOutput(arg.request_id, [], [], "", True, "error", e,
                                      len(arg.prompt_token_ids), 0))
                return
            self._sinks[arg.request_id] = deliver
        elif command == "abort":
            if self.engine.abort(arg):
                self.aborted.append(arg)
