"""Keeps the workers `serve` started running: restarts one that exits, with backoff.

    worker exits -> router.mark_down (its requests end with 503 worker_unavailable at once)
                 -> wait the backoff -> start it again with the same id
                 -> it loads the model, registers, passes the capacity audit -> back in service

The backoff doubles from RESTART_BACKOFF_S up to MAX_BACKOFF_S while a worker keeps dying soon
after it starts, and resets once one has run for STABLE_AFTER_S. Workers started by hand
(`isoserve worker`) are not ours to restart; the router's heartbeat watch marks them down.
"""
from __future__ import annotations

import asyncio
import logging
import shlex
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("isoserve.supervisor")

RESTART_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_AFTER_S = 60.0
POLL_S = 0.1


@dataclass
class SupervisedWorker:
    worker_id: str
    role: str
    command: list[str]
    process: subprocess.Popen | None = None
    started_at: float = 0.0
    backoff_s: float = RESTART_BACKOFF_S
    restart_at: float | None = None  # set while it waits to be started again
    restarts: int = 0


class Supervisor:
    def __init__(self, spawn: Callable[[list[str]], subprocess.Popen], metrics):
        self._spawn = spawn
        self.router = None  # set by watch(): `serve` starts the workers before its router
        self.metrics = metrics
        self.workers: list[SupervisedWorker] = []
        self.stopping = False
        self._task: asyncio.Task | None = None

    def start(self, worker_id: str, role: str, command: list[str]) -> SupervisedWorker:
        w = SupervisedWorker(worker_id, role, command)
        self._launch(w)
        self.workers.append(w)
        return w

    def processes(self) -> list[subprocess.Popen]:
        return [w.process for w in self.workers if w.process is not None]

    def watch(self, router) -> None:
        """Start restarting workers that exit (after the first registration is done), marking
        each down in `router` first."""
        self.router = router
        self._task = asyncio.create_task(self._watch())

    async def stop(self, grace_s: float = 10.0) -> None:
        """Stop supervising and end every worker: SIGTERM, then SIGKILL after `grace_s`."""
        self.stopping = True
        if self._task is not None:
            self._task.cancel()
        running = [p for p in self.processes() if p.poll() is None]
        for p in running:
            p.terminate()
        deadline = time.monotonic() + grace_s
        while any(p.poll() is None for p in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for p in running:
            if p.poll() is None:
                log.warning("worker pid %d did not stop within %.0f s: killing it", p.pid, grace_s)
                p.kill()
                p.wait()

    # ---- the watch ----------------------------------------------------------------------
    def _launch(self, w: SupervisedWorker) -> None:
        log.debug("starting worker %s: %s", w.worker_id, shlex.join(w.command))
        w.process = self._spawn(w.command)
        w.started_at = time.monotonic()
        w.restart_at = None

    async def _watch(self) -> None:
        while not self.stopping:
            now = time.monotonic()
            for w in self.workers:
                self._check(w, now)
            await asyncio.sleep(POLL_S)

    def _check(self, w: SupervisedWorker, now: float) -> None:
        if w.restart_at is not None:
            if now >= w.restart_at:
                w.restarts += 1
                self.metrics.count_worker_restart(w.role)
                log.warning("restarting worker %s (%s), restart #%d", w.worker_id, w.role, w.restarts)
                self._launch(w)
            return
        status = w.process.poll()
        if status is None:
            if now - w.started_at >= STABLE_AFTER_S:
                w.backoff_s = RESTART_BACKOFF_S
            return
        self.router.mark_down(w.worker_id, f"its process exited with status {status}")
        w.restart_at = now + w.backoff_s
        log.error("worker %s (%s, pid %d) exited with status %d; restarting it in %.1f s",
                  w.worker_id, w.role, w.process.pid, status, w.backoff_s)
        w.backoff_s = min(w.backoff_s * 2, MAX_BACKOFF_S)
