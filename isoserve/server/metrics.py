"""Prometheus metrics for the HTTP front and the workers behind it.

Everything lives in a registry owned by one Metrics object rather than in prometheus_client's
global one, so several apps (tests, or a router restarting its front) never collide over
metric names. The router calls the update methods; `GET /metrics` calls render().
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

# Latency buckets in seconds: token gaps are milliseconds, prefills up to tens of seconds on CPU.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)

POOL_PAGE_STATES = ("total", "used", "free")


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "isoserve_requests", "HTTP requests by endpoint, final status and error code "
            "(code is empty on success; a stream that fails after its headers counts with the "
            "error's status)", ["endpoint", "status", "code"], registry=r)
        self.prompt_tokens = Counter("isoserve_prompt_tokens", "Prompt tokens prefilled", registry=r)
        self.completion_tokens = Counter("isoserve_completion_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram(
            "isoserve_time_to_first_token_seconds", "From request arrival to its first token",
            buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram(
            "isoserve_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
            buckets=_ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram(
            "isoserve_e2e_request_latency_seconds", "From request arrival to its last token, "
            "for requests that completed", buckets=_E2E_BUCKETS, registry=r)
        self.pool_pages = Gauge("isoserve_pool_pages", "KV pool pages of each worker",
                                ["worker", "role", "state"], registry=r)
        self.worker_up = Gauge("isoserve_worker_up", "1 while the worker is registered and healthy",
                               ["worker", "role"], registry=r)
        self.transfer_bytes = Counter("isoserve_kv_transfer_bytes", "KV bytes moved from prefill "
                                      "to decode workers", registry=r)
        self.transfer_latency = Histogram(
            "isoserve_kv_transfer_seconds", "Duration of one request's KV transfer, first byte "
            "sent to last page verified", buckets=_TRANSFER_BUCKETS, registry=r)
        self.rejected_transfers = Counter(
            "isoserve_kv_transfers_rejected", "KV transfers a decode worker refused, by reason "
            "(coverage, checksum, epoch, ...)", ["reason"], registry=r)
        self.guard_violations = Counter(
            "isoserve_guard_violations", "Requests stopped by a KV isolation guard",
            ["worker", "guard"], registry=r)
        self.worker_restarts = Counter(
            "isoserve_worker_restarts", "Worker processes `serve` restarted after they exited",
            ["role"], registry=r)
        self.rejected_by_limits = Counter(
            "isoserve_requests_rejected_by_limits", "Requests refused with 429 because a bounded "
            "queue was full, by limit (tenant_requests, tenant_tokens, server_requests, "
            "server_tokens)", ["limit"], registry=r)
        self.requests_in_flight = Gauge(
            "isoserve_requests_in_flight", "Requests admitted and not yet ended", registry=r)
        self.worker_steps = Counter(
            "isoserve_worker_steps", "Engine steps of each worker, by the torch threads it ran "
            "them with (workers sharing a host's cores take more while their peers are idle)",
            ["worker", "role", "threads"], registry=r)
        self.worker_step_seconds = Counter(
            "isoserve_worker_step_seconds", "Wall time of those engine steps, summed: divided by "
            "isoserve_worker_steps_total, a worker's mean step time as it serves",
            ["worker", "role", "threads"], registry=r)
        self.rejected_messages = Counter(
            "isoserve_rejected_messages", "Messages dropped because they failed authentication, "
            "by channel", ["channel"], registry=r)

    # ---- the HTTP front ---------------------------------------------------------------------
    def count_request(self, endpoint: str, status: int, code: str = "") -> None:
        self.requests.labels(endpoint, str(status), code).inc()

    def observe_first_token(self, seconds: float, prompt_tokens: int) -> None:
        self.time_to_first_token.observe(seconds)
        self.prompt_tokens.inc(prompt_tokens)

    def observe_tokens(self, count: int, seconds_since_previous: float | None) -> None:
        """`count` tokens arrived together; the gap is spread evenly over them."""
        self.completion_tokens.inc(count)
        if seconds_since_previous is not None and count > 0:
            for _ in range(count):
                self.inter_token_latency.observe(seconds_since_previous / count)

    def observe_e2e(self, seconds: float) -> None:
        self.e2e_latency.observe(seconds)

    # ---- workers (updated by the router) ------------------------------------------------------
    def set_pool_pages(self, worker: str, role: str, *, total: int, used: int, free: int) -> None:
        for state, value in zip(POOL_PAGE_STATES, (total, used, free)):
            self.pool_pages.labels(worker, role, state).set(value)

    def set_worker_up(self, worker: str, role: str, up: bool) -> None:
        self.worker_up.labels(worker, role).set(1 if up else 0)

    def forget_worker(self, worker: str, role: str) -> None:
        """Drop a departed worker's series, so dashboards do not show its last values forever."""
        for state in POOL_PAGE_STATES:
            _remove(self.pool_pages, worker, role, state)
        _remove(self.worker_up, worker, role)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.transfer_bytes.inc(nbytes)
        self.transfer_latency.observe(seconds)

    def count_rejected_transfer(self, reason: str, n: int = 1) -> None:
        self.rejected_transfers.labels(reason).inc(n)

    def count_worker_steps(self, worker: str, role: str, threads: str, n: int) -> None:
        self.worker_steps.labels(worker, role, threads).inc(n)

    def count_worker_step_seconds(self, worker: str, role: str, threads: str, seconds: float) -> None:
        self.worker_step_seconds.labels(worker, role, threads).inc(seconds)

    def count_guard_violation(self, worker: str, guard: str, n: int = 1) -> None:
        self.guard_violations.labels(worker, guard).inc(n)

    def count_rejected_message(self, channel: str, n: int = 1) -> None:
        self.rejected_messages.labels(channel).inc(n)

    def count_worker_restart(self, role: str) -> None:
        self.worker_restarts.labels(role).inc()

    def count_rejected_by_limit(self, limit: str) -> None:
        self.rejected_by_limits.labels(limit).inc()

    def set_requests_in_flight(self, count: int) -> None:
        self.requests_in_flight.set(count)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)


def _remove(metric, *labels: str) -> None:
    try:
        metric.remove(*labels)
    except KeyError:  # never set: nothing to drop
        pass
