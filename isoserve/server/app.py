"""The HTTP front: the OpenAI API over any Backend (see backend.py).

    Bearer key -> tenant -> parse and validate -> tokenize -> admission -> generate -> respond

Every error leaves in OpenAI's body, {"error": {"message", "type", "param", "code"}}, with the
status its IsoserveError class names. A request whose client goes away is aborted in the
backend at once: its pages are worth more to the next request than its tokens to nobody.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
import json
import logging
import time
from collections.abc import AsyncIterator

import anyio
import jinja2
import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from isoserve.engine.engine import RequestOutput
from isoserve.engine.sampling_params import SamplingParams
from isoserve.errors import (AuthenticationFailed, InvalidRequest, IsoserveError, ModelNotFound,
                             PermissionDenied, RequestAborted, ServerShuttingDown)
from isoserve.server.backend import Backend, GenerationRequest
from isoserve.server.backpressure import LoadLimiter, LoadLimits, Ticket
from isoserve.server.http_protocol import SCOPE_WRITE_FLOW
from isoserve.server.metrics import Metrics
from isoserve.server.protocol import (ChatCompletionRequest, ChatFormatter, CompletionFormatter,
                                      CompletionRequest, ResponseContext, TokenStrings,
                                      finish_reason, validation_error_param)
from isoserve.errors import RequestTimeout
from isoserve.server import limits as input_limits
from isoserve.server.limits import MAX_BODY_BYTES
from isoserve.server.openapi import install_openapi
from isoserve.server.protocol import most_specific_error
from isoserve.server.tenants import Tenant, TenantStore

log = logging.getLogger("isoserve.server")

# Where handlers leave (status, error code) for the request counter: a stream that fails after
# its 200 header, or a client that left, ends differently from what the header said.
_OUTCOME = "isoserve.outcome"
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/status", "/health", "/metrics")

Formatter = CompletionFormatter | ChatFormatter


def create_app(backend: Backend, tenants: TenantStore, metrics: Metrics, *,
               served_model_names: list[str], limits: LoadLimits | None = None) -> FastAPI:
    if not served_model_names:
        raise ValueError("served_model_names must name at least one model")
    api = _OpenAIServer(backend, tenants, metrics, list(served_model_names),
                        LoadLimiter(limits or LoadLimits(), metrics))
    # No /docs; /openapi.json is served below, to tenants only (see openapi.py).
    app = FastAPI(title="isoserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_SlowClients, body_timeout=input_limits.body_timeout_s(),
                       send_timeout=input_limits.send_timeout_s())
    app.add_middleware(_CountAndCatch, metrics=metrics)
    # Token ids are checked against the vocabulary while the body is validated.
    app.state.validation_context = {"vocab_size": len(backend.tokenizer)}
    app.add_exception_handler(IsoserveError, _isoserve_error)
    app.add_exception_handler(RequestValidationError, _fastapi_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)

    authenticated = [Depends(api.authenticate)]
    # Health and metrics are for load balancers and Prometheus, which hold no tenant key; they
    # carry no tenant's data (metrics have no tenant label for that reason).
    app.add_api_route("/health", api.health, methods=["GET"])
    app.add_api_route("/metrics", api.render_metrics, methods=["GET"])
    app.add_api_route("/v1/models", api.list_models, methods=["GET"], dependencies=authenticated)
    app.add_api_route("/v1/models/{model:path}", api.get_model, methods=["GET"],
                      dependencies=authenticated)
    app.add_api_route("/status", api.status, methods=["GET"])
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    install_openapi(app, served_model_names, len(backend.tokenizer), authenticated)
    app.state.api = api  # for serve's graceful shutdown: start_draining(), in_flight()
    return app


class _OpenAIServer:
    def __init__(self, backend: Backend, tenants: TenantStore, metrics: Metrics,
                 served_model_names: list[str], limiter: LoadLimiter):
        self.backend = backend
        self.limiter = limiter
        self.draining = False
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="isoserve-tokenize")
        self.tenants = tenants
        self.metrics = metrics
        self.served_model_names = served_model_names
        self.tokenizer = backend.tokenizer
        self.token_strings = TokenStrings(backend.tokenizer)
        self.started = int(time.time())

    # ---- auth ---------------------------------------------------------------------------
    def authenticate(self, request: Request) -> Tenant:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            raise AuthenticationFailed("You didn't provide an API key. Send it in the "
                                       "Authorization header as 'Bearer <key>'.")
        tenant = self.tenants.authenticate(key)
        if tenant is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        return tenant

    # ---- graceful shutdown --------------------------------------------------------------
    def start_draining(self) -> None:
        """Refuse new generation requests (503 server_shutting_down); those in flight go on."""
        self.draining = True

    def in_flight(self) -> int:
        return self.limiter.requests

    # ---- plain endpoints ----------------------------------------------------------------
    async def health(self) -> Response:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.backend.healthy():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    async def render_metrics(self) -> Response:
        return Response(self.metrics.render(), media_type=self.metrics.content_type)

    async def list_models(self) -> dict:
        return {"object": "list", "data": [self._model_card(name) for name in self.served_model_names]}

    async def get_model(self, model: str) -> dict:
        self._check_model(model)
        return self._model_card(model)

    async def status(self, request: Request) -> Response:
        if not self.authenticate(request).admin:
            raise PermissionDenied("This endpoint needs an admin API key.")
        return JSONResponse(self.backend.status())

    def _model_card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.started, "owned_by": "isoserve",
                "max_model_len": self.backend.max_model_len()}

    def _check_model(self, name: str) -> None:
        if name not in self.served_model_names:
            raise ModelNotFound(f"The model `{name}` does not exist or you do not have access "
                                "to it.", param="model")

    # ---- generation ---------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        started = time.perf_counter()
        tenant = self.authenticate(request)  # before reading the body: strangers get nothing parsed
        body = await _parse_body(request, CompletionRequest)
        self._check_model(body.model)
        prompt = (body.prompt if isinstance(body.prompt, list)
                  else await self._tokenize(self.tokenizer.encode, body.prompt))
        ctx = ResponseContext.new(CompletionFormatter.id_prefix, body.model, self.token_strings,
                                  logprobs=body.logprobs is not None,
                                  include_usage=body.include_usage)
        return await self._generate(request, tenant, prompt, body.to_sampling_params(),
                                    CompletionFormatter(ctx), stream=body.stream, started=started)

    async def chat_completions(self, request: Request) -> Response:
        started = time.perf_counter()
        tenant = self.authenticate(request)
        body = await _parse_body(request, ChatCompletionRequest)
        self._check_model(body.model)
        prompt = await self._tokenize(self._chat_prompt, body)
        # Without a limit, a chat reply may use whatever the context leaves (as OpenAI does).
        max_tokens = body.requested_max_tokens() or max(1, self.backend.max_model_len() - len(prompt))
        ctx = ResponseContext.new(ChatFormatter.id_prefix, body.model, self.token_strings,
                                  logprobs=body.logprobs, include_usage=body.include_usage)
        return await self._generate(request, tenant, prompt, body.to_sampling_params(max_tokens),
                                    ChatFormatter(ctx), stream=body.stream, started=started)

    async def _tokenize(self, fn, *args) -> list[int]:
        """Run tokenization (up to a million characters) off the event loop, so other streams
        keep flowing meanwhile; in one thread, as a tokenizer must not be used concurrently."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, fn, *args)

    def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        messages = [m.to_template() for m in body.messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=False)
        except (jinja2.TemplateError, ValueError) as e:  # e.g. roles that must alternate
            raise InvalidRequest(f"The messages do not fit the model's chat template: {e}",
                                 param="messages") from None
        # The template already holds the special tokens; encoding must not add a BOS again.
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _generate(self, request: Request, tenant: Tenant, prompt: list[int],
                        params: SamplingParams, formatter: Formatter, *, stream: bool,
                        started: float) -> Response:
        self.backend.check_admission(len(prompt), params.max_tokens)
        if self.draining:
            raise ServerShuttingDown("The server is shutting down and takes no new requests; "
                                     "retry on another replica or after it restarts.")
        # Bounded queues: past a bound this raises 429 before anything is queued.
        ticket = self.limiter.admit(tenant.name, tenant.limits, len(prompt) + params.max_tokens)
        record = _RequestRecord(self.metrics, formatter.ctx.id, tenant.name, len(prompt), started)
        outputs = self.backend.generate(
            GenerationRequest(formatter.ctx.id, tenant.name, prompt, params))
        if not stream:
            try:
                collected = await _unless_disconnected(request, _collect(outputs, record))
            finally:
                await _close(outputs)
                ticket.release()
            response = JSONResponse(formatter.body(collected))  # raises the final error, if any
            record.completed(collected[-1])
            return response
        try:
            # Wait for the first output before sending a 200: a request that fails before its
            # first token (no worker, transfer refused) gets its real status, not an event.
            first = await _unless_disconnected(request, _next(outputs, record))
            finish_reason(first)
        except BaseException:
            await _close(outputs)
            ticket.release()
            raise
        request.scope[_OUTCOME] = (RequestAborted.http_status, RequestAborted.code)  # until it ends
        return _EventStream(_events(request, formatter, first, outputs, record), outputs, ticket)


class _RequestRecord:
    """Times one request's tokens into the metrics and logs how it ended."""

    def __init__(self, metrics: Metrics, request_id: str, tenant: str, prompt_tokens: int,
                 started: float):
        self.metrics, self.request_id, self.tenant = metrics, request_id, tenant
        self.prompt_tokens = prompt_tokens
        self.started = started
        self.last_token_at: float | None = None

    def on_output(self, output: RequestOutput) -> None:
        if not output.new_token_ids:
            return
        now = time.perf_counter()
        if self.last_token_at is None:
            self.metrics.observe_first_token(now - self.started, self.prompt_tokens)
            self.metrics.observe_tokens(len(output.new_token_ids), None)
        else:
            self.metrics.observe_tokens(len(output.new_token_ids), now - self.last_token_at)
        self.last_token_at = now

    def completed(self, final: RequestOutput) -> None:
        seconds = time.perf_counter() - self.started
        self.metrics.observe_e2e(seconds)
        log.info("request %s tenant=%s prompt_tokens=%d output_tokens=%d finish=%s seconds=%.3f",
                 self.request_id, self.tenant, self.prompt_tokens, final.num_output_tokens,
                 final.finish_reason, seconds)


# ---- the backend stream -----------------------------------------------------------------------

async def _next(outputs: AsyncIterator[RequestOutput], record: _RequestRecord) -> RequestOutput:
    try:
        output = await anext(outputs)
    except StopAsyncIteration:
        # A request ends exactly once, with tokens or an error; silence is neither.
        raise IsoserveError("the backend ended the request without a final output") from None
    record.on_output(output)
    return output


async def _collect(outputs: AsyncIterator[RequestOutput], record: _RequestRecord) -> list[RequestOutput]:
    collected = [await _next(outputs, record)]
    while not collected[-1].finished:
        collected.append(await _next(outputs, record))
    return collected


async def _close(outputs: AsyncIterator[RequestOutput]) -> None:
    """Close the backend stream (which aborts the request if it has not finished). Shielded:
    it runs while the surrounding task is being cancelled, and the abort must still go out."""
    aclose = getattr(outputs, "aclose", None)
    if aclose is None:
        return
    with anyio.CancelScope(shield=True):
        try:
            await aclose()
        except Exception:
            log.exception("closing a backend stream failed")


async def _unless_disconnected(request: Request, work):
    """Await `work`, unless the client disconnects first: then cancel it (which aborts the
    request in the backend) and raise RequestAborted."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise RequestAborted("The client disconnected before the response was ready.")
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next message the server delivers is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _events(request: Request, formatter: Formatter, first: RequestOutput,
                  outputs: AsyncIterator[RequestOutput], record: _RequestRecord) -> AsyncIterator[bytes]:
    """The SSE body: chunks as outputs arrive; an error as one error event; then [DONE]."""
    error = None
    try:
        for chunk in formatter.start_chunks():
            yield _sse(chunk)
        output = first
        while True:
            for chunk in formatter.chunks(output):
                yield _sse(chunk)
            if output.finished:
                break
            output = await _next(outputs, record)
        if formatter.ctx.include_usage:
            yield _sse(formatter.usage_chunk(output))
        record.completed(output)
        request.scope[_OUTCOME] = (200, "")
    except IsoserveError as e:
        if e.http_status >= 500:
            log.error("request %s failed mid-stream: %s: %s", formatter.ctx.id, e.code, e.message)
        error = e
    except Exception as e:  # the headers are out: the error can only travel as an event
        log.exception("request %s failed mid-stream", formatter.ctx.id)
        error = IsoserveError(f"internal error: {type(e).__name__}")
    finally:
        await _close(outputs)
    if error is not None:
        request.scope[_OUTCOME] = (error.http_status, error.code)
        yield _sse(error.to_openai())
    yield b"data: [DONE]\n\n"


def _sse(data: dict) -> bytes:
    # orjson: compact UTF-8 as json.dumps(ensure_ascii=False, separators=(",", ":")) gives, in
    # ~0.4 us where that took ~6; it runs once per streamed token on the router's one core.
    return b"data: " + orjson.dumps(data) + b"\n\n"


class _EventStream(StreamingResponse):
    """An SSE response that always closes its body and the backend stream. When the client
    goes away, Starlette cancels the task sending the body but leaves the generator for the
    garbage collector to close; the backend would go on generating until then."""

    def __init__(self, events: AsyncIterator[str], outputs: AsyncIterator[RequestOutput],
                 ticket: Ticket):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._outputs = outputs
        self._ticket = ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()
            await _close(self._outputs)
            self._ticket.release()


# ---- request bodies and errors ----------------------------------------------------------------

async def _parse_body(request: Request, model: type[BaseModel]):
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    try:
        return model.model_validate_json(
            bytes(body), context=getattr(request.app.state, "validation_context", None))
    except ValidationError as e:
        raise _invalid_request(e.errors(), bytes(body)) from None


def _too_large() -> InvalidRequest:
    err = InvalidRequest(f"The request body is larger than {MAX_BODY_BYTES} bytes.")
    err.http_status, err.code = 413, "request_too_large"
    return err


def _invalid_request(errors: list[dict], body: bytes = b"") -> InvalidRequest:
    bad_json = next((e for e in errors if e["type"] == "json_invalid"), None)
    if bad_json is not None:
        param = _lone_surrogate_param(body)
        if param:
            return InvalidRequest(f"Invalid value for `{param}`: it holds a lone UTF-16 surrogate "
                                  "(an unpaired \\ud800-\\udfff escape), which is not text.",
                                  param=param)
        detail = (bad_json.get("ctx") or {}).get("error") or bad_json["msg"]
        return InvalidRequest(f"We could not parse the JSON body of your request: {detail}")
    error = most_specific_error(errors)
    param = validation_error_param(tuple(error["loc"]))
    message = f"Invalid value for `{param}`: {error['msg']}" if param else error["msg"]
    return InvalidRequest(message, param=param)


def _lone_surrogate_param(body: bytes) -> str | None:
    """pydantic's JSON parser refuses a lone surrogate escape ("\\ud800") as bad JSON; Python's
    json module reads it into a string, which lets us name the field that holds it."""
    try:
        return input_limits.lone_surrogate_at(json.loads(body)) if body else None
    except (ValueError, RecursionError):
        return None


def _error_response(request: Request, err: IsoserveError) -> JSONResponse:
    request.scope[_OUTCOME] = (err.http_status, err.code)
    headers = {}
    if isinstance(err, AuthenticationFailed):
        headers["WWW-Authenticate"] = "Bearer"
    if err.retry_after is not None:
        headers["Retry-After"] = str(err.retry_after)
    return JSONResponse(err.to_openai(), status_code=err.http_status, headers=headers)


async def _isoserve_error(request: Request, exc: IsoserveError) -> JSONResponse:
    if exc.http_status >= 500:
        log.error("request to %s failed: %s: %s", request.url.path, exc.code, exc.message)
    return _error_response(request, exc)


async def _fastapi_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return _error_response(request, _invalid_request(list(exc.errors())))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = InvalidRequest(f"Invalid URL ({request.method} {request.url.path})"
                         if exc.status_code in (404, 405) else str(exc.detail))
    err.http_status = exc.status_code
    err.code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return _error_response(request, err)


class _CountAndCatch:
    """Counts every request by endpoint, final status and error code, and is the last resort
    for an exception nothing else handled: it logs the traceback once and answers 500 in
    OpenAI's body, so no client gets a bare text page or a dropped connection."""

    def __init__(self, app, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, response_started = 500, False

        async def watch_status(message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
            await send(message)

        try:
            await self.app(scope, receive, watch_status)
        except ClientDisconnect:  # gone while we read its body or wrote the response: no one to tell
            scope[_OUTCOME] = (RequestAborted.http_status, RequestAborted.code)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            err = IsoserveError("The server had an error while processing your request.")
            scope[_OUTCOME] = (err.http_status, err.code)
            if not response_started:
                await JSONResponse(err.to_openai(), status_code=err.http_status)(scope, receive, send)
        finally:
            final_status, code = scope.get(_OUTCOME, (status, ""))
            self.metrics.count_request(_endpoint_label(scope["path"]), final_status, code)


def _endpoint_label(path: str) -> str:
    """Known routes only: a label per probed URL would let anyone grow the metrics without bound."""
    if path in _ENDPOINTS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"


class _SlowClientTimeout(Exception):
    """Raised from receive or send when the client took longer than the server waits."""


class _SlowClients:
    """Bounds how long a client may hold a request without moving: the whole body must arrive
    within `body_timeout` of the request's start (else 408 request_timeout, and the connection
    is closed), and each write of the response may wait `send_timeout` for the client to read
    (else the request ends: its backend stream is closed, which aborts it and frees its KV pages,
    and the server closes the connection). Waiting is on the event loop: no thread, no polling."""

    def __init__(self, app, body_timeout: float, send_timeout: float):
        self.app = app
        self.body_timeout = body_timeout
        self.send_timeout = send_timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body_deadline = anyio.current_time() + self.body_timeout
        body_done = False
        response_started = False

        async def receive_in_time():
            nonlocal body_done
            if body_done:  # after the body, only the disconnect is left to wait for
                return await receive()
            with anyio.move_on_after(body_deadline - anyio.current_time()) as scope_:
                message = await receive()
            if scope_.cancelled_caught:
                raise _SlowClientTimeout("body")
            body_done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        # uvicorn's send waits only while the connection's writing is paused (its buffer is full:
        # the client is behind); otherwise it writes and returns, as do the middlewares below
        # this one. So a write is timed only then: a timer set and cancelled per streamed token
        # was ~12% of the router's CPU at 32 concurrent streams. Without the flow (another
        # server), every write is timed.
        flow = scope.get(SCOPE_WRITE_FLOW)

        async def send_in_time(message) -> None:
            nonlocal response_started
            if flow is not None and not flow.write_paused:
                await send(message)
            else:
                try:
                    async with asyncio.timeout(self.send_timeout):
                        await send(message)
                except TimeoutError:
                    raise _SlowClientTimeout("send") from None
            response_started = response_started or message["type"] == "http.response.start"

        try:
            await self.app(scope, receive_in_time, send_in_time)
        except _SlowClientTimeout as e:
            what = ("send its request body within %g s" % self.body_timeout if str(e) == "body"
                    else "read the response for %g s" % self.send_timeout)
            log.warning("client %s did not %s: ending %s %s", (scope.get("client") or ("?",))[0],
                        what, scope.get("method"), scope.get("path"))
            err = RequestTimeout(f"The client did not {what}.")
            scope[_OUTCOME] = (err.http_status, err.code)
            if not response_started and str(e) == "body":
                # Connection: close, so the rest of a body that may still come is never read.
                response = JSONResponse(err.to_openai(), status_code=err.http_status,
                                        headers={"Connection": "close"})
                with anyio.move_on_after(self.send_timeout):
                    await response(scope, receive, send)
            # Otherwise the response cannot be completed; the server closes the connection.
