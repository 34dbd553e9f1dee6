"""The probe's only contact with the server: OpenAI-compatible HTTP, one request at a time.

Every request ends as one `Completion` with an outcome a person can read:

    ok            200 and a complete body (or a stream that ended with [DONE] and a finish_reason)
    error         an HTTP error status with an OpenAI error body {"error": {...}}
    stream_error  a 200 stream that ended with an error event
    aborted       we closed the connection on purpose (mid-prefill or mid-stream)
    timeout       no complete answer within the request timeout (a hung request)
    lost          the connection closed, or the stream ended, without an answer or an error
    malformed     an answer we cannot read: a non-JSON body, an error status without an
                  OpenAI error body, a 200 without choices
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

EXPLICIT = ("ok", "error", "stream_error", "aborted")  # outcomes that are a proper end


@dataclass
class Completion:
    outcome: str
    status: int | None = None
    error_code: str | None = None
    error_message: str | None = None
    text: str = ""
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    elapsed: float = 0.0
    ttft: float | None = None     # streams: seconds to the first event with text
    events: int = 0               # streams: events with text received
    detail: str = ""              # what went wrong, for lost / malformed / timeout

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    @property
    def has_logprobs(self) -> bool:
        return bool(self.token_logprobs) and all(lp is not None for lp in self.token_logprobs)

    def to_json(self) -> dict:
        out = {"outcome": self.outcome, "status": self.status, "error_code": self.error_code,
               "error_message": (self.error_message or "")[:500] or None, "text": self.text,
               "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
               "completion_tokens": self.completion_tokens, "elapsed_s": round(self.elapsed, 4)}
        if self.tokens:
            out["tokens"] = self.tokens
            out["token_logprobs"] = [None if lp is None else round(lp, 5) for lp in self.token_logprobs]
        if self.ttft is not None:
            out["ttft_s"] = round(self.ttft, 4)
        if self.detail:
            out["detail"] = self.detail
        return out


class ProbeError(Exception):
    """The probe cannot run against this server (exit status 2)."""


def normalize_base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class Endpoint:
    def __init__(self, base_url: str, model: str | None, *, timeout: float, top_logprobs: int):
        self.base_url = normalize_base_url(base_url)
        self.model = model
        self.timeout = timeout
        self.top_logprobs = top_logprobs
        self.client = httpx.AsyncClient(base_url=self.base_url,
                                        timeout=httpx.Timeout(timeout, connect=min(timeout, 10.0)),
                                        limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))

    async def close(self) -> None:
        await self.client.aclose()

    @staticmethod
    def headers(key: str) -> dict:
        return {"Authorization": f"Bearer {key}"}

    async def get_json(self, path: str, key: str | None) -> tuple[int, dict | None]:
        try:
            r = await self.client.get(path, headers=self.headers(key) if key else None)
        except httpx.HTTPError as e:
            raise ProbeError(f"GET {self.base_url}{path} failed: {type(e).__name__}: {e}") from None
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, None

    def body(self, prompt: list[int] | str, max_tokens: int, *, stream: bool) -> dict:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        if self.top_logprobs:
            body["logprobs"] = self.top_logprobs
        if stream:
            body["stream_options"] = {"include_usage": True}
        return body

    async def complete(self, key: str, prompt: list[int] | str, max_tokens: int, *,
                       stream: bool = False, abort: str | None = None,
                       abort_after_s: float = 0.0, abort_after_events: int = 2) -> Completion:
        """One /v1/completions request.

        abort="prefill": close the connection `abort_after_s` seconds in, while the server is
        still computing the prompt (if the first token comes earlier, close right after it).
        abort="stream": close it after `abort_after_events` events with text."""
        started = time.perf_counter()
        streamed = stream or abort is not None
        body = self.body(prompt, max_tokens, stream=streamed)
        stop_after = {"prefill": 1, "stream": abort_after_events}.get(abort or "")
        try:
            async with asyncio.timeout(self.timeout):
                if not streamed:
                    result = await self._plain(key, body)
                elif abort != "prefill":
                    result = await self._stream(key, body, started, stop_after)
                else:
                    task = asyncio.ensure_future(self._stream(key, body, started, stop_after))
                    await asyncio.wait({task}, timeout=abort_after_s)
                    if task.done():
                        result = task.result()
                    else:  # cancelling it closes the connection: the server sees a disconnect
                        task.cancel()
                        await asyncio.gather(task, return_exceptions=True)
                        result = Completion("aborted", detail=f"closed by the probe {abort_after_s:.3f} s "
                                                              "in, before any response (mid-prefill)")
        except TimeoutError:
            result = Completion("timeout", detail=f"no complete answer within {self.timeout:.0f} s")
        except httpx.TimeoutException as e:
            result = Completion("timeout", detail=f"{type(e).__name__} after {self.timeout:.0f} s")
        except httpx.HTTPError as e:
            result = Completion("lost", detail=f"{type(e).__name__}: {e}")
        result.elapsed = time.perf_counter() - started
        return result

    async def _plain(self, key: str, body: dict) -> Completion:
        r = await self.client.post("/v1/completions", json=body, headers=self.headers(key))
        try:
            data = r.json()
        except ValueError:
            return Completion("malformed", r.status_code, detail=f"body is not JSON: {r.text[:200]!r}")
        if r.status_code != 200:
            return _error_completion(r.status_code, data)
        choices = data.get("choices") if isinstance(data, dict) else None
        if not choices:
            return Completion("malformed", 200, detail=f"200 without choices: {str(data)[:200]}")
        c = Completion("ok", 200)
        _add_choice(c, choices[0])
        _add_usage(c, data.get("usage"))
        if c.finish_reason is None:
            return Completion("malformed", 200, text=c.text, detail="200 without a finish_reason")
        return c

    async def _stream(self, key: str, body: dict, started: float, stop_after: int | None) -> Completion:
        async with self.client.stream("POST", "/v1/completions", json=body,
                                      headers=self.headers(key)) as r:
            if r.status_code != 200:
                raw = await r.aread()
                try:
                    return _error_completion(r.status_code, json.loads(raw))
                except ValueError:
                    return Completion("malformed", r.status_code, detail=f"body is not JSON: {raw[:200]!r}")
            c = Completion("lost", 200, detail="the stream ended without [DONE] and without an error event")
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    if c.outcome == "stream_error":
                        return c
                    if c.finish_reason is None:
                        return Completion("malformed", 200, text=c.text, detail="stream ended without a finish_reason")
                    c.outcome, c.detail = "ok", ""
                    return c
                try:
                    chunk = json.loads(data)
                except ValueError:
                    return Completion("malformed", 200, text=c.text, detail=f"event is not JSON: {data[:200]!r}")
                if isinstance(chunk, dict) and ("error" in chunk or chunk.get("object") == "error"):
                    err = _error_completion(200, chunk)
                    c.outcome, c.error_code, c.error_message = "stream_error", err.error_code, err.error_message
                    c.detail = ""
                    continue  # [DONE] may follow; an error event is itself a proper end
                choices = chunk.get("choices") or []
                if choices:
                    before = len(c.tokens) + len(c.text)
                    _add_choice(c, choices[0])
                    if len(c.tokens) + len(c.text) > before:
                        c.events += 1
                        if c.ttft is None:
                            c.ttft = time.perf_counter() - started
                _add_usage(c, chunk.get("usage"))
                if stop_after is not None and c.events >= stop_after and c.finish_reason is None:
                    c.outcome = "aborted"
                    c.detail = f"closed by the probe after {c.events} event(s) (mid-stream)"
                    return c
            return c


def _error_completion(status: int, data) -> Completion:
    """An OpenAI error body: {"error": {"message", "type", "param", "code"}}, or the flat
    {"object": "error", "message", "type", "code"} of older vLLM and of SGLang."""
    error = data.get("error") if isinstance(data, dict) else None
    if error is None and isinstance(data, dict) and data.get("object") == "error":
        error = data
    if isinstance(error, dict) and ("message" in error or "code" in error):
        code = error.get("code") or error.get("type")
        return Completion("error", status, error_code=None if code is None else str(code),
                          error_message=str(error.get("message", "")))
    if isinstance(error, str):  # some servers send {"error": "text"}
        return Completion("error", status, error_message=error)
    if isinstance(data, dict) and "detail" in data:  # FastAPI default bodies
        return Completion("malformed", status, error_message=str(data["detail"]),
                          detail="error status without an OpenAI error body")
    return Completion("malformed", status, detail=f"error status without an OpenAI error body: {str(data)[:200]}")


def _add_choice(c: Completion, choice: dict) -> None:
    c.text += choice.get("text") or ""
    if choice.get("finish_reason"):
        c.finish_reason = choice["finish_reason"]
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and lp.get("tokens") is not None:
        c.tokens += list(lp["tokens"])
        c.token_logprobs += list(lp.get("token_logprobs") or [None] * len(lp["tokens"]))
        tops = lp.get("top_logprobs") or [{}] * len(lp["tokens"])
        c.top_logprobs += [dict(t or {}) for t in tops]


def _add_usage(c: Completion, usage) -> None:
    if isinstance(usage, dict):
        c.prompt_tokens = usage.get("prompt_tokens", c.prompt_tokens)
        c.completion_tokens = usage.get("completion_tokens", c.completion_tokens)
