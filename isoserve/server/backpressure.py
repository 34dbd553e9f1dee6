"""Bounded queues: how many requests (and tokens) may be in flight, server-wide and per tenant.

A request is in flight from admission until it ends, whether it waits in a worker's queue or
runs. Past a bound, a new request is refused at once with 429 and Retry-After instead of
joining a queue that grows without limit; the per-tenant bounds keep one tenant's flood from
filling the server-wide ones, so other tenants' requests still get in.

Tokens count prompt + max_tokens: what the request may come to occupy in the KV pools.
A tenant's own [tenants.limits] (see tenants.py) override the serve-wide per-tenant defaults.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from isoserve.errors import InvalidRequest, RateLimited, ServerOverloaded


@dataclass(frozen=True)
class LoadLimits:
    max_requests: int | None = 256
    max_tokens: int | None = None
    tenant_max_requests: int | None = 64
    tenant_max_tokens: int | None = None


class Ticket:
    """One admitted request's share of the bounds; release() gives it back (once)."""

    def __init__(self, limiter: LoadLimiter, tenant: str, tokens: int):
        self._limiter, self.tenant, self.tokens = limiter, tenant, tokens
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._limiter._release(self)


class LoadLimiter:
    def __init__(self, limits: LoadLimits, metrics=None):
        self.limits = limits
        self.metrics = metrics
        self.requests = 0
        self.tokens = 0
        self.tenant_requests: Counter[str] = Counter()
        self.tenant_tokens: Counter[str] = Counter()

    def admit(self, tenant: str, tenant_limits: dict, tokens: int) -> Ticket:
        """A ticket for one more request of `tenant`, or RateLimited / ServerOverloaded (429)."""
        lim = self.limits
        max_requests = tenant_limits.get("max_concurrent_requests", lim.tenant_max_requests)
        max_tokens = tenant_limits.get("max_queued_tokens", lim.tenant_max_tokens)
        # The tenant's own bounds first: a tenant over its share is told so, even when the
        # server as a whole is also full.
        if max_requests is not None and self.tenant_requests[tenant] + 1 > max_requests:
            self._refuse("tenant_requests", RateLimited(
                f"Tenant {tenant!r} has {self.tenant_requests[tenant]} requests in flight, its "
                f"limit is {max_requests}. Retry after some of them finish."))
        if max_tokens is not None and tokens > max_tokens:  # no retry would help
            raise InvalidRequest(f"This request needs {tokens} tokens (prompt + max_tokens), more "
                                 f"than tenant {tenant!r} may have in flight ({max_tokens}); "
                                 "lower max_tokens or shorten the prompt.", param="max_tokens")
        if max_tokens is not None and self.tenant_tokens[tenant] + tokens > max_tokens:
            self._refuse("tenant_tokens", RateLimited(
                f"Tenant {tenant!r} has {self.tenant_tokens[tenant]} tokens (prompt + max_tokens) "
                f"in flight; this request's {tokens} would pass its limit of {max_tokens}."))
        if lim.max_requests is not None and self.requests + 1 > lim.max_requests:
            self._refuse("server_requests", ServerOverloaded(
                f"The server holds {self.requests} requests, as many as it queues. Retry shortly."))
        if lim.max_tokens is not None and self.tokens + tokens > lim.max_tokens and self.requests:
            # An idle server takes any one request that passed admission, whatever its size.
            self._refuse("server_tokens", ServerOverloaded(
                f"The server holds {self.tokens} tokens in flight; this request's {tokens} would "
                f"pass its bound of {lim.max_tokens}. Retry shortly."))
        self.requests += 1
        self.tokens += tokens
        self.tenant_requests[tenant] += 1
        self.tenant_tokens[tenant] += tokens
        self._publish()
        return Ticket(self, tenant, tokens)

    def _release(self, ticket: Ticket) -> None:
        self.requests -= 1
        self.tokens -= ticket.tokens
        self.tenant_requests[ticket.tenant] -= 1
        self.tenant_tokens[ticket.tenant] -= ticket.tokens
        if not self.tenant_requests[ticket.tenant]:
            del self.tenant_requests[ticket.tenant], self.tenant_tokens[ticket.tenant]
        self._publish()

    def _refuse(self, limit: str, error: RateLimited):
        if self.metrics is not None:
            self.metrics.count_rejected_by_limit(limit)
        raise error

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.set_requests_in_flight(self.requests)
