"""A worker process: one engine, one KV pool, one thread, driven by messages from the router.

    loop: receive (router, and KV transfers on decode workers) -> take cores -> engine.step()
          -> send outputs; while a peer's turn on the cores lasts, or the rest of a burst of
          prompts or transfers is on its way (bursts.py), receive again

"take cores" applies only to workers sharing a host's cores with their peers (cores.py): by
split (cores / busy workers each) or turns (one steps at a time, with every core).

Roles: "prefill" computes a prompt's KV and its first token and hands both to a decode
worker; "decode" receives verified KV and generates; "aggregated" does both in one engine.
"""
from __future__ import annotations

import logging
import math
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import torch
import zmq

from isoserve import failpoints
from isoserve.admission import check_prompt_fits
from isoserve.config import EngineConfig, dtype_name
from isoserve.disagg.cores import TURN_POLL_MS, CoreShare, StepCores
from isoserve.disagg.roles import AggregatedRole, DecodeRole, PrefillRole, Role
from isoserve.disagg.wire import Signer, Unauthenticated, token_logprob_to_wire
from isoserve.engine.engine import Engine
from isoserve.errors import IsoserveError

log = logging.getLogger("isoserve.worker")

HEARTBEAT_S = 0.5
# The router's name for a worker's liveness channel: its id with this suffix.
ALIVE_SUFFIX = "/alive"
# Heartbeat counter of the steps run with N torch threads: this prefix, then N.
STEPS_WITH_THREADS = "steps_with_threads_"
STEP_US_WITH_THREADS = "step_us_with_threads_"  # the steps' summed wall time, in microseconds


@dataclass
class WorkerOptions:
    role: str                       # prefill | decode | aggregated
    router: str                     # router's worker endpoint, e.g. ipc:///tmp/x or tcp://h:p
    secret: bytes
    engine: EngineConfig
    worker_id: str = ""
    kv_endpoint: str = ""           # decode: where prefill workers send KV (bound here)
    transfer_timeout_s: float = 300.0
    disabled_guards: frozenset[str] = field(default_factory=frozenset)
    core_share: tuple[str, int] | None = None  # (share file, this worker's slot): see cores.py
    core_sharing: str = "split"     # how workers sharing a host's cores use them: split | turns
    prefill_gather_s: float = 0.0   # prefill: hold a burst of prompts this long (disagg/bursts.py)


class Worker:
    def __init__(self, opts: WorkerOptions):
        self.opts = opts
        self.id = opts.worker_id or f"{opts.role}-{socket.gethostname()}-{os.getpid()}"
        self.signer = Signer(opts.secret, self.id)
        self.engine = Engine(opts.engine)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.DEALER)
        self.router.setsockopt(zmq.IDENTITY, self.id.encode())
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.connect(opts.router)
        self.poller = zmq.Poller()
        self.poller.register(self.router, zmq.POLLIN)
        self.role: Role = {"prefill": PrefillRole, "decode": DecodeRole,
                           "aggregated": AggregatedRole}[opts.role](self)
        self.counters: dict[str, int] = {}
        self.cores = CoreShare(*opts.core_share, policy=opts.core_sharing) if opts.core_share else None
        self.registered = False
        self.stopping = False
        self.loop_at = time.monotonic()  # when the main loop last went round
        self._alive = threading.Thread(target=self._send_alive, name="isoserve-alive", daemon=True)
        self._loop_ended = threading.Event()  # wakes the liveness thread at once to end it

    # ---- sending ------------------------------------------------------------------------
    def send_router(self, kind: str, body: dict) -> None:
        self.router.send_multipart(self.signer.pack(kind, body))

    def send_outputs(self, outputs) -> None:
        if outputs:
            self.send_router("outputs", {"outputs": [output_to_wire(o) for o in outputs]})

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # ---- admission on receipt -----------------------------------------------------------
    def admit(self, prompt_len: int, max_tokens: int) -> None:
        """The worker's own check of the one limit (its context and pool), unless switched off."""
        if "admission" not in self.opts.disabled_guards:
            check_prompt_fits(prompt_len, self.role.prompt_limit(max_tokens), max_tokens)

    # ---- main loop ----------------------------------------------------------------------
    def describe(self) -> dict:
        e = self.engine
        return {"worker_id": self.id, "role": self.opts.role, "pid": os.getpid(),
                "host": socket.gethostname(), "model": e.model_name, "dtype": e.config.dtype,
                "kv_dtype": dtype_name(e.pool.kv.dtype),
                "page_size": e.pool.page_size, "pool_tokens": e.capacity_tokens,
                "pool_pages": e.pool.num_pages, "context_length": e.context_length,
                "kv_endpoint": self.opts.kv_endpoint}

    def stats(self) -> dict:
        a = self.engine.allocator
        return {"pages_total": self.engine.pool.num_pages, "pages_used": a.num_used,
                "pages_free": a.num_free, "running": len(self.engine.scheduler.running),
                "waiting": len(self.engine.scheduler.waiting),
                "counters": {**self.counters, **self.engine.stats.counters}}

    def _send_alive(self) -> None:
        """Liveness from its own thread and socket: a step can run longer than the router's
        heartbeat timeout (a long prompt's prefill chunk on one core), and the main loop sends
        its heartbeats only between steps. It reports how long ago the loop last went round,
        so the router can still tell a stuck loop from a long step."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, (self.id + ALIVE_SUFFIX).encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.opts.router)
        signer = Signer(self.opts.secret, self.id + ALIVE_SUFFIX)
        try:
            while not self.stopping:
                sock.send_multipart(signer.pack("alive", {"loop_age_s": time.monotonic() - self.loop_at}))
                self._loop_ended.wait(HEARTBEAT_S)
        finally:
            sock.close(0)

    def run(self) -> int:
        self.send_router("register", self.describe())
        log.info("worker %s (%s) registering with %s", self.id, self.opts.role, self.opts.router)
        last_beat = 0.0
        awaiting_turn = False
        if self.cores:
            self._between_steps_on_one_thread()
        while not self.stopping:
            self.loop_at = time.monotonic()
            busy = self.engine.has_work() or self.role.busy()
            hold_s = self.role.step_hold_s()  # the rest of a burst is on its way (bursts.py)
            if awaiting_turn:
                wait_ms = TURN_POLL_MS
            elif hold_s:
                wait_ms = math.ceil(hold_s * 1000)
            else:
                wait_ms = 0 if busy else 20
            events = dict(self.poller.poll(wait_ms))
            if self.router in events:
                self._drain(self.router, self._on_router_message)
            self.role.poll_extra(events)
            stepping = self.registered and self.engine.has_work() and not self.role.step_hold_s()
            if self.cores:
                self.cores.set_busy(stepping)
            cores = self._cores_for_step() if stepping else None
            awaiting_turn = stepping and cores is None  # a peer's turn: receive meanwhile
            if cores is not None:
                with cores as threads:
                    if threads != torch.get_num_threads():
                        torch.set_num_threads(threads)
                    self.count(STEPS_WITH_THREADS + str(threads))
                    started = time.perf_counter()
                    outputs = self.engine.step()
                    self.count(STEP_US_WITH_THREADS + str(threads), round((time.perf_counter() - started) * 1e6))
                    if self.cores and not self.engine.has_work():
                        # Idle before the outputs go out: a peer can start on them (a prompt's
                        # KV) at once, and should find our cores free.
                        self.cores.set_busy(False)
                if self.cores:
                    self._between_steps_on_one_thread()
                self.role.on_outputs(outputs)
                delay_ms = failpoints.FAILPOINTS.value("worker.step_delay_ms")
                if delay_ms:
                    time.sleep(delay_ms / 1000)
            self.role.housekeeping()
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_S:
                self.send_router("heartbeat", self.stats())
                last_beat = now
        self._loop_ended.set()
        if self._alive.is_alive():
            self._alive.join()
        self.router.close(0)
        self.role.close()
        if self.cores:
            self.cores.close()
        self.ctx.term()
        return 0

    def _between_steps_on_one_thread(self) -> None:
        """What a worker sharing the host's cores does between steps (building and accepting KV
        transfers, sending outputs) is no step the share accounts for, so it runs on one torch
        thread. Spread over two OpenMP threads while the peer stepped on both cores, those copies
        put three threads on two cores: the 32 transfers of one prefill step took 0.2-1.2 s
        to build instead of 0.03-0.06 (docs/benchmarks.md). Each step sets its own count again."""
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)

    def _cores_for_step(self) -> StepCores | None:
        """The cores this (busy) worker's next step may use, as torch threads, or None while it
        waits for its turn on a host whose cores the workers share (cores.py)."""
        return self.cores.try_step() if self.cores else StepCores(torch.get_num_threads())

    def _drain(self, sock, handler) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            msg = self.authenticate(frames, "router")
            if msg is not None:
                handler(msg)

    def authenticate(self, frames, channel: str):
        """The message, or None (counted and logged) when it is not signed with our secret."""
        try:
            return self.signer.unpack([f.buffer for f in frames])
        except (Unauthenticated, ValueError, KeyError) as e:
            self.count(f"unauthenticated_messages_{channel}")
            log.warning("dropped unauthenticated message on the %s channel: %s", channel, e)
            return None

    def _on_router_message(self, msg) -> None:
        body = msg.body
        if msg.kind == "registered":
            self.registered = True
            if not self._alive.is_alive():  # only once admitted: before, it would look unknown
                self._alive.start()
            log.info("worker %s admitted by the router", self.id)
        elif msg.kind == "refused":
            log.error("router refused worker %s: %s", self.id, body.get("reason"))
            self.stopping = True
        elif msg.kind == "abort":
            self.role.abort(body["request_id"])
        elif msg.kind == "register_again":
            self._register_again(body.get("reason", ""))
        elif msg.kind == "shutdown":
            self.stopping = True
        else:
            try:
                self.role.handle(msg)
            except IsoserveError as e:
                rid = body.get("request_id", "")
                log.info("request %s rejected by worker %s: %s", rid, self.id, e.message)
                self.send_error(rid, e)
            except Exception as e:  # a malformed message ends its request, not the worker
                rid = body.get("request_id", "")
                log.exception("worker %s could not handle %s for request %r", self.id, msg.kind, rid)
                if rid:
                    self.send_error(rid, IsoserveError(f"worker error: {type(e).__name__}"))

    def _register_again(self, reason: str) -> None:
        """The router took us out of service (or never knew us: it restarted). Whatever we hold
        belongs to requests it has already ended: abort them all, then register afresh and be
        audited like a new worker."""
        held = list(self.engine.requests) + self.role.queued_request_ids()
        log.warning("router asks worker %s to register again (%s): aborting %d request(s)",
                    self.id, reason, len(held))
        for rid in held:
            self.role.abort(rid)
        self.registered = False
        self.send_router("register", self.describe())

    def send_error(self, request_id: str, error: IsoserveError) -> None:
        self.send_router("outputs", {"outputs": [error_to_wire(request_id, error)]})


def output_to_wire(o) -> dict:
    return {"request_id": o.request_id, "token_ids": o.new_token_ids,
            "logprobs": [token_logprob_to_wire(lp) for lp in o.new_logprobs], "text": o.new_text,
            "finished": o.finished, "finish_reason": o.finish_reason,
            "error": o.error.to_wire() if o.error else None,
            "prompt_tokens": o.num_prompt_tokens, "output_tokens": o.num_output_tokens}


def error_to_wire(request_id: str, error: IsoserveError) -> dict:
    return {"request_id": request_id, "token_ids": [], "logprobs": [], "text": "", "finished": True,
            "finish_reason": "error", "error": error.to_wire(), "prompt_tokens": 0, "output_tokens": 0}
