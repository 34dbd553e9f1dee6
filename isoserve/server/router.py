"""The router: the HTTP server's Backend over worker processes.

It registers and audits workers, applies the one admission limit, and runs each request:
reserve pages on a decode worker (which so learns the prompt from the router, not from the
sender of the KV), then hand the prompt to a prefill worker, then stream the decode worker's
outputs back. Every request ends exactly once: with its tokens or an explicit error.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from isoserve.admission import check_prompt_fits, effective_prompt_limit
from isoserve.disagg.wire import Signer, Unauthenticated, token_logprob_from_wire
from isoserve.disagg.worker import ALIVE_SUFFIX, STEP_US_WITH_THREADS, STEPS_WITH_THREADS
from isoserve.engine.deadlines import Deadlines
from isoserve.engine.engine import RequestOutput
from isoserve.errors import GenerationTimeout, IsoserveError, WorkerUnavailable, error_from_wire
from isoserve.server.audit import ROLES_BY_MODE, AuditSettings, audit_table, audit_worker
from isoserve.server.backend import GenerationRequest

log = logging.getLogger("isoserve.router")

HEARTBEAT_TIMEOUT_S = 5.0
# A worker whose process answers but whose loop has not gone round for this long is stuck, not
# busy: no step of a model we serve takes minutes.
STUCK_AFTER_S = 120.0
# Workers enforce the generation deadline; the router waits this much longer before it ends a
# request itself, so a worker that hangs while still sending heartbeats cannot hang a client.
DEADLINE_BACKSTOP_S = 5.0


@dataclass
class WorkerInfo:
    id: str
    role: str
    pid: int
    host: str
    pool_tokens: int
    pool_pages: int
    page_size: int
    context_length: int
    kv_endpoint: str
    state: str = "up"  # up | down | refused
    refusal: str = ""
    last_seen: float = field(default_factory=time.monotonic)
    stats: dict = field(default_factory=dict)
    in_flight: set = field(default_factory=set)
    counters_seen: dict = field(default_factory=dict)
    loop_age_s: float = 0.0          # from its liveness thread: since its loop last went round


@dataclass
class RouterSettings:
    model_name: str
    context_length: int
    page_size: int
    kv_dtype: str  # every worker's KV pool dtype (config.resolve_dtypes)
    mode: str = "disaggregated"
    min_kv_headroom: float = 1.0
    allow_undersized_kv: bool = False
    disabled_guards: frozenset[str] = frozenset()
    deadlines: Deadlines = Deadlines()
    heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S


class _Reserved:
    """Queue marker: the decode worker holds pages for the request."""


class Router:
    def __init__(self, settings: RouterSettings, secret: bytes, listen: str, tokenizer, metrics):
        self.settings = settings
        self.audit_settings = AuditSettings(
            settings.mode, settings.context_length, settings.page_size, settings.kv_dtype, settings.min_kv_headroom,
            settings.allow_undersized_kv, "capacity_audit" not in settings.disabled_guards)
        self.model_name = settings.model_name
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.signer = Signer(secret, "router")
        self.listen = listen
        self.workers: dict[str, WorkerInfo] = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self.registered = asyncio.Event()
        # Live workers told to register again (unknown to us, or marked down); until they do.
        self._asked_to_register: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes its id back

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self.sock.bind(self.listen)
        self._tasks = [asyncio.create_task(self._receive_loop()),
                       asyncio.create_task(self._watch_heartbeats())]
        log.info("router listening for workers on %s", self.listen)

    async def stop(self) -> None:
        for w in self.workers.values():
            if w.state == "up":
                self._send(w, "shutdown", {})
        for t in self._tasks:
            t.cancel()
        await asyncio.sleep(0.05)
        self.sock.close(0)
        self.ctx.term()

    async def wait_for_workers(self, count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.workers) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self.workers)} of {count} workers registered in {timeout:.0f} s")
            await asyncio.sleep(0.1)

    # ---- the one limit ------------------------------------------------------------------
    def _pools(self, role: str) -> list[int]:
        # Every audited worker counts, up or down: the limit must not rise while a worker with
        # a small pool is away (it may come back, and requests queued for it would not fit).
        return [w.pool_tokens for w in self.workers.values() if w.role == role and w.state != "refused"]

    def prompt_limit(self, max_tokens: int) -> int:
        if "capacity_audit" in self.settings.disabled_guards:
            return effective_prompt_limit(self.settings.context_length, [], [], max_tokens)
        if self.settings.mode == "aggregated":
            pools = self._pools("aggregated")
            return effective_prompt_limit(self.settings.context_length, pools, pools, max_tokens)
        return effective_prompt_limit(self.settings.context_length, self._pools("prefill"),
                                      self._pools("decode"), max_tokens)

    def max_model_len(self) -> int:
        return self.prompt_limit(0)

    def check_admission(self, prompt_len: int, max_tokens: int) -> None:
        if "admission" not in self.settings.disabled_guards:
            check_prompt_fits(prompt_len, self.prompt_limit(max_tokens), max_tokens)

    # ---- capacity audit -----------------------------------------------------------------
    def audit_table(self) -> str:
        rows = [(w.role, w.id, w.pool_tokens, w.refusal) for w in self.workers.values()]
        return audit_table(self.audit_settings, rows, self.max_model_len())

    # ---- health and status --------------------------------------------------------------
    def healthy(self) -> bool:
        up_roles = {w.role for w in self.workers.values() if w.state == "up"}
        return all(r in up_roles for r in ROLES_BY_MODE[self.settings.mode])

    def status(self) -> dict:
        return {"mode": self.settings.mode, "model": self.model_name,
                "max_model_len": self.max_model_len(),
                "workers": [{"id": w.id, "role": w.role, "pid": w.pid, "host": w.host,
                             "state": w.state, "pool_tokens": w.pool_tokens,
                             "pages_total": w.pool_pages,
                             "pages_used": w.stats.get("pages_used"),
                             "pages_free": w.stats.get("pages_free"),
                             "in_flight": len(w.in_flight)} for w in self.workers.values()]}

    # ---- requests -----------------------------------------------------------------------
    def _pick(self, role: str) -> WorkerInfo:
        up = [w for w in self.workers.values() if w.role == role and w.state == "up"]
        if not up:
            raise WorkerUnavailable(f"no {role} worker is available")
        return min(up, key=lambda w: (len(w.in_flight), w.stats.get("pages_used", 0)))

    def in_flight(self) -> int:
        return len(self.streams)

    def end_all(self, error: IsoserveError) -> int:
        """End every request in flight with `error` (graceful shutdown past its grace period);
        each is then aborted on its workers as any request that ends unclean. Returns how many."""
        for rid in self.streams:
            self._end_stream(rid, error)
        return len(self.streams)

    def _end_stream(self, rid: str, error: IsoserveError) -> None:
        """End a request's stream with `error`, behind the outputs already in its queue. Its
        generator then ends it, and aborts it on its workers, as any unclean finish."""
        queue = self.streams.get(rid)
        if queue is not None:  # else it has ended already
            queue.put_nowait(_error_output(rid, error))

    async def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        rid = req.request_id
        started = time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[rid] = queue
        involved: list[WorkerInfo] = []
        clean = False
        deadlines = self.settings.deadlines
        body = {"request_id": rid, "tenant": req.tenant, "prompt_token_ids": req.prompt_token_ids,
                "params": req.params.to_dict(), "deadlines": deadlines.to_wire()}

        # The generation deadline is the worker's to enforce; this is the backstop for one that
        # has gone silent. One timer per request ends the stream as end_all and mark_down do,
        # instead of a timeout around every token's wait.
        backstop = None
        if deadlines.generation_s is not None:
            backstop = asyncio.get_running_loop().call_later(
                deadlines.generation_s + DEADLINE_BACKSTOP_S, self._end_stream, rid,
                GenerationTimeout(f"request {rid} did not finish within its generation "
                                  f"deadline ({deadlines.generation_s:g} s)"))

        try:
            if self.settings.mode == "aggregated":
                worker = self._pick("aggregated")
                involved.append(worker)
                worker.in_flight.add(rid)
                self._send(worker, "generate", body)
            else:
                self._pick("prefill")  # none up: refuse now, before reserving any pages
                decode = self._pick("decode")
                involved.append(decode)
                decode.in_flight.add(rid)
                self._send(decode, "reserve", body)
                first = await queue.get()
                if not isinstance(first, _Reserved):
                    yield first  # the decode worker refused it: an explicit error
                    return
                # Picked only now: a prefill worker that went down while the pages were being
                # reserved would never get the message, and the request would wait for its
                # transfer deadline instead of failing over (found by the soak).
                prefill = self._pick("prefill")
                involved.append(prefill)
                prefill.in_flight.add(rid)
                self._send(prefill, "prefill", {**body, "decode_endpoint": decode.kv_endpoint,
                                                "deadlines": deadlines.remaining(started).to_wire()})
            while True:
                out = await queue.get()
                if isinstance(out, _Reserved):
                    continue
                clean = out.finished and out.error is None
                yield out
                if out.finished:
                    return
        except IsoserveError as e:
            yield _error_output(rid, e)
        finally:
            if backstop is not None:
                backstop.cancel()
            self.streams.pop(rid, None)
            # Anything but a clean finish (client gone, an error on either side) is aborted on
            # every worker involved, so no pages stay held and nothing more is computed.
            for w in involved:
                w.in_flight.discard(rid)
                if not clean and w.state == "up":
                    self._send(w, "abort", {"request_id": rid})

    # ---- messages -----------------------------------------------------------------------
    def _send(self, worker: WorkerInfo, kind: str, body: dict) -> None:
        self.sock.send_multipart([worker.id.encode(), *self.signer.pack(kind, body)])

    async def _receive_loop(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            identity = frames[0].bytes.decode(errors="replace")
            try:
                msg = self.signer.unpack([f.buffer for f in frames[1:]])
                if msg.sender != identity:
                    raise Unauthenticated(f"{identity!r} signed as {msg.sender!r}")
            except (Unauthenticated, ValueError, KeyError) as e:
                self.metrics.count_rejected_message("router")
                log.warning("dropped unauthenticated message from %r: %s", identity, e)
                continue
            try:
                self._handle(identity, msg)
            except Exception:
                log.exception("router failed to handle %s from %s", msg.kind, identity)

    def _handle(self, identity: str, msg) -> None:
        b = msg.body
        if identity.endswith(ALIVE_SUFFIX):
            self._on_alive(identity.removesuffix(ALIVE_SUFFIX), b)
            return
        if msg.kind == "register":
            self._register(identity, b)
            return
        worker = self.workers.get(identity)
        if worker is None:
            return  # not registered: its liveness messages get it to register (_on_alive)
        worker.last_seen = time.monotonic()
        if msg.kind == "heartbeat":
            self._on_heartbeat(worker, b)
        elif msg.kind == "outputs":
            for o in b["outputs"]:
                queue = self.streams.get(o["request_id"])
                if queue is not None:  # else the request already ended: drop the late output
                    queue.put_nowait(_output_from_wire(o))
        elif msg.kind == "reserved":
            queue = self.streams.get(b["request_id"])
            if queue is not None:
                queue.put_nowait(_Reserved())
        elif msg.kind == "transferred":
            self.metrics.observe_transfer(b["bytes"], b["seconds"])

    def _register(self, identity: str, b: dict) -> None:
        if b.get("worker_id") != identity:
            self.metrics.count_rejected_message("router")
            return
        self._asked_to_register.discard(identity)
        previous = self.workers.get(identity)
        if previous is not None and previous.state == "up":
            self.mark_down(identity, "registered again (it restarted)")
        info = WorkerInfo(id=identity, role=b["role"], pid=b["pid"], host=b["host"],
                          pool_tokens=b["pool_tokens"], pool_pages=b["pool_pages"],
                          page_size=b["page_size"], context_length=b["context_length"],
                          kv_endpoint=b["kv_endpoint"])
        if b.get("model") != self.model_name:
            info.refusal = f"serves model {b.get('model')!r}, the router serves {self.model_name!r}"
        else:
            info.refusal = audit_worker(self.audit_settings, info.role, info.pool_tokens,
                                        info.page_size, info.context_length, b.get("kv_dtype"))
        info.state = "refused" if info.refusal else "up"
        self.workers[identity] = info
        if info.refusal:
            log.error("capacity audit refused worker %s (%s): %s", identity, info.role, info.refusal)
            self._send(info, "refused", {"reason": info.refusal})
        else:
            log.info("worker %s registered: role=%s pid=%s host=%s pool=%d tokens (%d pages)",
                     identity, info.role, info.pid, info.host, info.pool_tokens, info.pool_pages)
            self._send(info, "registered", {})
        self.metrics.set_worker_up(identity, info.role, info.state == "up")

    def _on_alive(self, worker_id: str, b: dict) -> None:
        """A worker's liveness thread. A worker we do not know (this router restarted), or one
        we marked down while it was alive (a stall), is told to drop what it holds and register
        again, which puts it through the capacity audit before it serves again."""
        worker = self.workers.get(worker_id)
        if worker is None or worker.state == "down":
            if worker_id not in self._asked_to_register:  # once: a second request could arrive
                self._asked_to_register.add(worker_id)    # after it is back, and end its work
                log.warning("worker %s is alive but %s: asking it to register again", worker_id,
                            "unknown to this router" if worker is None else "out of service")
                self.sock.send_multipart([worker_id.encode(), *self.signer.pack(
                    "register_again", {"reason": "unknown" if worker is None else "marked down"})])
            return
        worker.last_seen = time.monotonic()
        worker.loop_age_s = float(b.get("loop_age_s", 0.0))

    def _on_heartbeat(self, worker: WorkerInfo, stats: dict) -> None:
        worker.stats = stats
        self.metrics.set_pool_pages(worker.id, worker.role, total=stats["pages_total"],
                                    used=stats["pages_used"], free=stats["pages_free"])
        for name, value in stats.get("counters", {}).items():
            delta = value - worker.counters_seen.get(name, 0)
            worker.counters_seen[name] = value
            if delta > 0:
                self._count_worker_events(worker, name, delta)

    def _count_worker_events(self, worker: WorkerInfo, name: str, n: int) -> None:
        """Workers report cumulative counters in heartbeats; the router exports their growth.
        Added in one step: a byte counter grows by millions per heartbeat, and counting it one
        by one took two-thirds of the router's core under load."""
        if name == "guard_violations":
            self.metrics.count_guard_violation(worker.id, "writer_tags", n)
        elif name.startswith("rejected_transfers_"):
            self.metrics.count_rejected_transfer(name.removeprefix("rejected_transfers_"), n)
        elif name.startswith("unauthenticated_messages_"):
            self.metrics.count_rejected_message(f"{worker.role}:{name.removeprefix('unauthenticated_messages_')}", n)
        elif name.startswith(STEPS_WITH_THREADS):
            self.metrics.count_worker_steps(worker.id, worker.role,
                                            name.removeprefix(STEPS_WITH_THREADS), n)
        elif name.startswith(STEP_US_WITH_THREADS):
            self.metrics.count_worker_step_seconds(worker.id, worker.role,
                                                   name.removeprefix(STEP_US_WITH_THREADS), n / 1e6)

    async def _watch_heartbeats(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.monotonic()
            for w in list(self.workers.values()):
                if w.state != "up":
                    continue
                if now - w.last_seen > self.settings.heartbeat_timeout_s:
                    self.mark_down(w.id, f"missed heartbeats for {now - w.last_seen:.1f} s")
                elif w.loop_age_s > STUCK_AFTER_S:
                    self.mark_down(w.id, f"its loop has not gone round for {w.loop_age_s:.0f} s")

    def mark_down(self, worker_id: str, why: str) -> None:
        """Take a worker out of service: no new requests go to it, and each of its requests in
        flight ends now with 503 worker_unavailable (then is aborted on its other worker). It
        comes back when it registers again and passes the capacity audit."""
        w = self.workers.get(worker_id)
        if w is None or w.state != "up":
            return
        w.state = "down"
        self.metrics.set_worker_up(w.id, w.role, False)
        log.error("worker %s (%s) marked down: %s; ending its %d request(s) in flight",
                  w.id, w.role, why, len(w.in_flight))
        self._fail_in_flight(w, why)
        if w.role == "decode":
            # KV queued to it will never be taken: prefill workers discard it and free the pages.
            for p in self.workers.values():
                if p.role == "prefill" and p.state == "up":
                    self._send(p, "peer_down", {"kv_endpoint": w.kv_endpoint})

    def _fail_in_flight(self, worker: WorkerInfo, why: str) -> None:
        for rid in worker.in_flight:
            self._end_stream(rid, WorkerUnavailable(
                f"{worker.role} worker {worker.id} failed while serving this request ({why})"))
        worker.in_flight.clear()


def _error_output(rid: str, error: IsoserveError) -> RequestOutput:
    return RequestOutput(rid, [], [], "", True, "error", error)


def _output_from_wire(o: dict) -> RequestOutput:
    logprobs = [token_logprob_from_wire(t, lp) for t, lp in zip(o["token_ids"], o["logprobs"], strict=True)]
    error = error_from_wire(o["error"]) if o["error"] else None
    return RequestOutput(o["request_id"], o["token_ids"], logprobs, o["text"], o["finished"],
                         o["finish_reason"], error, o["prompt_tokens"], o["output_tokens"])
