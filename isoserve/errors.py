"""Errors that end a request, each with the HTTP status and OpenAI-style code a client sees.

Every way a request can fail is one of these, so the server maps them to responses in one
place and a worker can send them over the wire as (code, message) and rebuild them.
"""
from __future__ import annotations


class IsoserveError(Exception):
    http_status = 500
    code = "internal_error"
    error_type = "server_error"
    # Seconds after which a retry may succeed (sent as Retry-After); None: retrying won't help.
    retry_after: int | None = None

    def __init__(self, message: str, *, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def to_openai(self) -> dict:
        return {"error": {"message": self.message, "type": self.error_type,
                          "param": self.param, "code": self.code}}

    def to_wire(self) -> dict:
        return {"code": self.code, "message": self.message, "param": self.param}


class InvalidRequest(IsoserveError):
    http_status = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class ModelNotFound(InvalidRequest):
    http_status = 404
    code = "model_not_found"


class AuthenticationFailed(IsoserveError):
    http_status = 401
    code = "invalid_api_key"
    error_type = "authentication_error"


class PermissionDenied(IsoserveError):
    http_status = 403
    code = "permission_denied"
    error_type = "permission_error"


class KVIsolationViolation(IsoserveError):
    code = "kv_isolation_violation"


class KVTransferIncomplete(IsoserveError):
    code = "kv_transfer_incomplete"


class WorkerUnavailable(IsoserveError):
    http_status = 503
    code = "worker_unavailable"
    retry_after = 2


class RateLimited(IsoserveError):
    """One tenant has as many requests (or queued tokens) in flight as its limit allows."""
    http_status = 429
    code = "rate_limit_exceeded"
    error_type = "rate_limit_error"
    retry_after = 1


class ServerOverloaded(RateLimited):
    """The server as a whole holds as many requests as its queues are bounded to."""
    code = "server_overloaded"


class QueueTimeout(IsoserveError):
    """The request waited longer than the queueing deadline before any work began on it."""
    http_status = 503
    code = "queue_timeout"
    retry_after = 1


class GenerationTimeout(IsoserveError):
    """The request did not finish generating within its deadline."""
    http_status = 504
    code = "generation_timeout"


class ServerShuttingDown(IsoserveError):
    http_status = 503
    code = "server_shutting_down"
    retry_after = 1


class RequestAborted(IsoserveError):
    http_status = 499
    code = "request_aborted"
    error_type = "invalid_request_error"


_BY_CODE = {cls.code: cls for cls in (
    IsoserveError, InvalidRequest, ContextLengthExceeded, ModelNotFound, AuthenticationFailed,
    PermissionDenied, KVIsolationViolation, KVTransferIncomplete, WorkerUnavailable, RequestAborted,
    RateLimited, ServerOverloaded, QueueTimeout, GenerationTimeout, ServerShuttingDown)}


def error_from_wire(data: dict) -> IsoserveError:
    """Rebuild an error a worker reported; unknown codes stay explicit server errors."""
    cls = _BY_CODE.get(data.get("code"), IsoserveError)
    err = cls(data.get("message", "unknown error"), param=data.get("param"))
    if cls is IsoserveError and data.get("code"):
        err.code = data["code"]
    return err


class RequestTimeout(InvalidRequest):
    """The client was too slow: it did not send its whole body in time (or did not read the
    response). The connection is closed after it."""
    http_status = 408
    code = "request_timeout"


_BY_CODE[RequestTimeout.code] = RequestTimeout


class HeadersTooLarge(InvalidRequest):
    """The request line and headers are over the server's bound (server/http_protocol.py)."""
    http_status = 431
    code = "request_headers_too_large"
