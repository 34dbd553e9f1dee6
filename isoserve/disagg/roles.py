"""What a worker does with requests, by role. The worker loop (worker.py) owns the sockets and
the engine; a role decides how messages become engine work and where outputs go."""
from __future__ import annotations

import logging
import os
import time
from abc import ABC, abstractmethod
from collections import Counter, deque
from typing import TYPE_CHECKING

from isoserve.admission import effective_prompt_limit
from isoserve import failpoints
from isoserve.disagg.bursts import PromptGather, TransferBurst
from isoserve.disagg.manifest import (Manifest, TransferRejected, apply_transfer_faults,
                                      build_manifest, verify_transfer, write_transfer)
from isoserve.disagg.transport import ZmqKVReceiver, ZmqKVSender
from isoserve.disagg.wire import token_logprob_from_wire, token_logprob_to_wire
from isoserve.engine.deadlines import Deadlines
from isoserve.engine.sampling_params import SamplingParams
from isoserve.engine.sequence import Status
from isoserve.errors import (ContextLengthExceeded, IsoserveError, KVIsolationViolation,
                             KVTransferIncomplete, WorkerUnavailable)
from isoserve.kv.allocator import OutOfPages

if TYPE_CHECKING:
    from isoserve.disagg.worker import Worker

log = logging.getLogger("isoserve.worker")


class Role(ABC):
    def __init__(self, worker: "Worker"):
        self.worker = worker
        self.engine = worker.engine

    @abstractmethod
    def prompt_limit(self, max_tokens: int) -> int:
        """This worker's part of the one limit: its context and the pool the request occupies."""

    def handle(self, msg) -> None:
        raise ValueError(f"{type(self).__name__} does not take {msg.kind!r} messages")

    def on_outputs(self, outputs) -> None:
        self.worker.send_outputs(outputs)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def busy(self) -> bool:
        return False

    def step_hold_s(self) -> float:
        """Seconds the worker should wait (receiving) before its next step; 0: step now."""
        return 0.0

    def queued_request_ids(self) -> list[str]:
        """Requests this role holds outside the engine (none, unless a role queues its own)."""
        return []

    def poll_extra(self, events) -> None:
        pass

    def housekeeping(self) -> None:
        pass

    def close(self) -> None:
        pass


class AggregatedRole(Role):
    """One engine computes the prompt and generates: no transfer."""

    def prompt_limit(self, max_tokens: int) -> int:
        cap = [self.engine.capacity_tokens]
        return effective_prompt_limit(self.engine.context_length, cap, cap, max_tokens)

    def handle(self, msg) -> None:
        if msg.kind != "generate":
            return super().handle(msg)
        b = msg.body
        params = SamplingParams(**b["params"])
        self.worker.admit(len(b["prompt_token_ids"]), params.max_tokens)
        self.engine.add_request(b["request_id"], b["prompt_token_ids"], params,
                                deadlines=Deadlines.from_wire(b.get("deadlines")))


class PrefillRole(Role):
    """Computes the prompt's KV and first token, then sends both to the decode worker the router
    chose. Pages are freed only once zmq reports the send done with their buffers."""

    def __init__(self, worker):
        super().__init__(worker)
        self.decode_endpoints: dict[str, str] = {}     # request -> decode worker's KV endpoint
        self.sender = ZmqKVSender(worker.ctx)
        self.in_flight: dict[str, list] = {}  # request -> its sends still using our pages
        # Decode workers the router reported down, until it names them again (after they
        # re-registered): KV for them is never sent, or it would wait in zmq holding our pages.
        self.down_endpoints: set[str] = set()
        cfg = self.engine.config
        self.gather = PromptGather(worker.opts.prefill_gather_s, cfg.max_batched_tokens, cfg.max_num_seqs)

    def prompt_limit(self, max_tokens: int) -> int:
        return effective_prompt_limit(self.engine.context_length, [self.engine.capacity_tokens], [],
                                      max_tokens)

    def handle(self, msg) -> None:
        if msg.kind == "peer_down":
            return self._drop_peer(msg.body["kv_endpoint"])
        if msg.kind != "prefill":
            return super().handle(msg)
        b = msg.body
        rid, prompt = b["request_id"], b["prompt_token_ids"]
        params = SamplingParams(**b["params"])
        deadlines = Deadlines.from_wire(b.get("deadlines"))
        # The prefill engine samples only the first token; decode generates the rest.
        first_only = SamplingParams(**{**params.to_dict(), "max_tokens": 1, "stop": [],
                                       "ignore_eos": True})
        try:
            self.worker.admit(len(prompt), params.max_tokens)
            self.engine.add_request(rid, prompt, first_only, keep_kv_on_finish=True,
                                    deadlines=deadlines)
        except ContextLengthExceeded:
            if not failpoints.fire("prefill.placeholder_on_reject"):
                raise
            # The incident's bug, reproduced on purpose: the rejection mutates the request.
            log.error("failpoint prefill.placeholder_on_reject fired: %s replaced by a 1-token prompt", rid)
            self.engine.add_request(rid, prompt[:1], first_only, keep_kv_on_finish=True)
        self.decode_endpoints[rid] = b["decode_endpoint"]
        self.down_endpoints.discard(b["decode_endpoint"])
        self.gather.arrived(time.monotonic())

    def step_hold_s(self) -> float:
        if not self.gather.holding:
            return 0.0
        scheduler = self.engine.scheduler
        return self.gather.hold_s(time.monotonic(), idle=not scheduler.running,
                                  waiting_tokens=sum(s.num_tokens for s in scheduler.waiting),
                                  waiting_seqs=len(scheduler.waiting))

    def _drop_peer(self, endpoint: str) -> None:
        """The router saw that decode worker go down: transfers queued to it will never be taken.
        Closing our socket to it discards them, which hands their page buffers back (their
        trackers complete) so housekeeping frees the pages; a restarted worker gets a new one."""
        self.down_endpoints.add(endpoint)
        if self.sender.drop(endpoint):
            log.warning("decode worker at %s is down: discarded the KV transfers queued to it", endpoint)

    def on_outputs(self, outputs) -> None:
        ends = [(out, self.decode_endpoints.pop(out.request_id, None)) for out in outputs]
        # This step's transfers to each decode worker, so that each can say how many follow it.
        to_send = Counter(endpoint for out, endpoint in ends
                          if out.error is None and out.finish_reason != "abort" and endpoint is not None
                          and endpoint not in self.down_endpoints)
        for out, endpoint in ends:
            if out.error is not None:
                self.worker.send_outputs([out])
            elif out.finish_reason != "abort" and endpoint in self.down_endpoints:
                self.engine.release(out.request_id)
                self.worker.send_error(out.request_id, WorkerUnavailable(
                    f"the decode worker for request {out.request_id} went down"))
            elif out.finish_reason != "abort" and endpoint is not None:
                to_send[endpoint] -= 1
                self._send_kv(out.request_id, endpoint, following=to_send[endpoint])
            elif out.finished:
                self.engine.release(out.request_id)  # nobody to send to: never hold the pages

    def _send_kv(self, rid: str, endpoint: str, following: int) -> None:
        seq = self.engine.requests[rid]
        # Sending KV reads it: the same read guard as a forward step, over the whole prompt.
        violation = self.engine.check_owned(seq, seq.num_computed)
        if violation is not None:
            self.engine.release(rid)
            self.worker.send_error(rid, KVIsolationViolation(
                f"request {rid} would send KV it does not own ({violation.describe()})"))
            return
        lp = seq.logprobs[0]
        first_lp = token_logprob_to_wire(lp)
        delay_ms = failpoints.FAILPOINTS.value("transfer.delay_ms")
        if delay_ms:
            time.sleep(delay_ms / 1000)
        manifest, frames = build_manifest(self.engine.pool, seq, first_lp, time.time(), following)
        if failpoints.fire("prefill.crash_mid_transfer"):
            log.error("FAILPOINT prefill.crash_mid_transfer: exiting while sending %s", rid)
            os._exit(70)
        self.in_flight[rid] = [self.sender.send(endpoint, self.worker.signer.pack("kv", m.to_wire(), f))
                               for m, f in apply_transfer_faults(manifest, frames)]
        self.worker.count("transfers_sent")
        self.worker.count("transfer_bytes_sent", sum(len(f) for f in frames))

    def abort(self, request_id: str) -> None:
        self.decode_endpoints.pop(request_id, None)
        self.engine.abort(request_id)  # a send already handed to zmq still completes first

    def busy(self) -> bool:
        return bool(self.in_flight)

    def housekeeping(self) -> None:
        for rid in [r for r, ts in self.in_flight.items() if all(t.done for t in ts)]:
            del self.in_flight[rid]
            self.engine.release(rid)

    def close(self) -> None:
        self.sender.close()


class DecodeRole(Role):
    """Reserves pages for a prompt the router describes, accepts only a transfer that matches
    it exactly, writes the KV itself and generates."""

    def __init__(self, worker):
        super().__init__(worker)
        self.receiver = ZmqKVReceiver(worker.ctx, worker.opts.kv_endpoint, worker.poller)
        self.waiting_for_pages: deque[tuple[str, list[int], SamplingParams, Deadlines]] = deque()
        self.deadlines: dict[str, float] = {}
        guards = worker.opts.disabled_guards
        self.check_coverage = "transfer_coverage" not in guards
        self.check_checksums = "transfer_checksum" not in guards
        self.burst = TransferBurst()

    def prompt_limit(self, max_tokens: int) -> int:
        return effective_prompt_limit(self.engine.context_length, [], [self.engine.capacity_tokens],
                                      max_tokens)

    def on_outputs(self, outputs) -> None:
        self.worker.send_outputs(outputs)
        if any(o.num_output_tokens >= 2 and not o.finished for o in outputs) \
                and failpoints.fire("decode.crash_mid_stream"):
            log.error("FAILPOINT decode.crash_mid_stream: exiting mid-stream")
            os._exit(71)

    def handle(self, msg) -> None:
        if msg.kind != "reserve":
            return super().handle(msg)
        b = msg.body
        params = SamplingParams(**b["params"])  # validated before anything is held
        deadlines = Deadlines.from_wire(b.get("deadlines"))
        self.worker.admit(len(b["prompt_token_ids"]), params.max_tokens)
        # Counted from the reservation: it covers the prompt's wait at a prefill worker and its
        # prefill there, so it is set above the queueing deadline (see --transfer-timeout).
        self.deadlines[b["request_id"]] = time.monotonic() + self.worker.opts.transfer_timeout_s
        self.waiting_for_pages.append((b["request_id"], b["prompt_token_ids"], params, deadlines))
        self._reserve_waiting()

    def _reserve_waiting(self) -> None:
        while self.waiting_for_pages:
            rid, prompt, params, deadlines = self.waiting_for_pages[0]
            try:
                self.engine.reserve(rid, prompt, params, deadlines)
            except OutOfPages:
                return  # first come, first served: wait for pages to come back
            except IsoserveError as e:
                # The engine's own checks (vocabulary, "cannot fit") end the request here; left
                # at the head of the queue it would be retried, and raise, at every loop.
                self.waiting_for_pages.popleft()
                self.deadlines.pop(rid, None)
                log.info("request %s rejected by worker %s: %s", rid, self.worker.id, e.message)
                self.worker.send_error(rid, e)
                continue
            self.waiting_for_pages.popleft()
            self.worker.send_router("reserved", {"request_id": rid})

    def poll_extra(self, events) -> None:
        for frames in self.receiver.receive(events):
            self._on_transfer_frames(frames)

    def _on_transfer_frames(self, frames) -> None:
        msg = self.worker.authenticate(frames, "kv")
        if msg is None:
            return
        if msg.kind != "kv":
            self.worker.count("rejected_transfers_kind")
            return
        manifest = Manifest.from_wire(msg.body)
        self.burst.received(manifest.following, time.monotonic())
        self._accept(manifest, msg.payload)

    def step_hold_s(self) -> float:
        return self.burst.hold_s(time.monotonic())

    def _accept(self, manifest: Manifest, frames) -> None:
        rid = manifest.request_id
        seq = self.engine.requests.get(rid)
        if seq is None or seq.status is not Status.AWAITING_KV:
            reason = "unknown_or_late" if seq is None else "duplicate"
            self.worker.count(f"rejected_transfers_{reason}")
            log.warning("dropped KV transfer for %s: %s", rid, reason)
            return
        try:
            verify_transfer(manifest, frames, seq, self.engine.pool,
                            check_coverage=self.check_coverage, check_checksums=self.check_checksums)
        except TransferRejected as e:
            self.worker.count(f"rejected_transfers_{e.reason}")
            log.error("rejected KV transfer for %s from its prefill worker: %s", rid, e)
            self.deadlines.pop(rid, None)
            self.engine.fail(rid, KVTransferIncomplete(f"KV transfer rejected: {e}"))
            return
        nbytes = write_transfer(manifest, frames, seq, self.engine.pool)
        self.deadlines.pop(rid, None)
        self.worker.send_router("transferred", {"request_id": rid, "bytes": nbytes,
                                                "seconds": max(0.0, time.time() - manifest.sent_at)})
        # The guard looks at the prompt's pages now, before the first token is released.
        violation = self.engine.check_owned(seq, len(seq.prompt_token_ids))
        if violation is not None:
            self.engine.fail(rid, KVIsolationViolation(
                f"request {rid} would decode over KV it does not own ({violation.describe()})"))
            return
        first = manifest.first_token
        self.engine.start_decoding(seq, first, token_logprob_from_wire(first, manifest.first_logprob))

    def abort(self, request_id: str) -> None:
        self.deadlines.pop(request_id, None)
        self._drop_waiting(request_id)
        self.engine.abort(request_id)  # pages back at once: epochs fence a late transfer

    def housekeeping(self) -> None:
        self._reserve_waiting()
        self.engine.end_expired()  # reserved requests wait outside the steps
        now = time.monotonic()
        for rid in [r for r, d in self.deadlines.items() if d < now]:
            del self.deadlines[rid]
            self._drop_waiting(rid)
            self.worker.count("transfer_deadlines_missed")
            error = KVTransferIncomplete(f"no complete and valid KV transfer for {rid} within "
                                         f"{self.worker.opts.transfer_timeout_s:g} s")
            if rid in self.engine.requests:
                if failpoints.fire("decode.decode_on_deadline") and self._decode_anyway(rid):
                    continue
                self.engine.fail(rid, error)
            else:  # still waiting for pages: the engine never saw it
                self.worker.send_error(rid, error)

    def _decode_anyway(self, rid: str) -> bool:
        """FAILPOINT decode.decode_on_deadline: stop waiting for the KV and decode over the
        reserved pages (the last prompt token is computed here, over whatever they hold)."""
        seq = self.engine.requests[rid]
        if seq.status is not Status.AWAITING_KV:
            return False
        log.error("FAILPOINT decode.decode_on_deadline: decoding %s over pages no transfer filled", rid)
        seq.num_computed = len(seq.prompt_token_ids) - 1
        self.engine.scheduler.add_running(seq)
        return True

    def queued_request_ids(self) -> list[str]:
        return [rid for rid, *_ in self.waiting_for_pages]

    def _drop_waiting(self, request_id: str) -> None:
        self.waiting_for_pages = deque(w for w in self.waiting_for_pages if w[0] != request_id)

    def close(self) -> None:
        self.receiver.close()
