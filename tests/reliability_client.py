"""A small HTTP client for the reliability tests: requests in threads, each recording exactly
how it ended (status, error code, tokens, when), so a test can assert that every request ended
once, with tokens or an explicit error, and by when."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Outcome:
    status: int | None = None        # HTTP status (200 for a stream even if it failed later)
    code: str | None = None          # OpenAI error code, from the body or the stream's error event
    finish_reason: str | None = None
    tokens: int = 0                  # streamed chunks that carried text
    done: bool = False               # the stream ended with data: [DONE]
    ended_at: float | None = None    # time.monotonic() when the request ended
    retry_after: str | None = None
    failure: str | None = None       # a transport error: the server dropped us without an answer
    first_token_at: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.code is None and self.finish_reason in ("length", "stop")


@dataclass
class StreamingRequest:
    """One request running in its own thread."""
    base_url: str
    key: str
    body: dict
    timeout: float = 120.0
    outcome: Outcome = field(default_factory=Outcome)
    thread: threading.Thread | None = None

    def start(self) -> StreamingRequest:
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def join(self, timeout: float | None = None) -> Outcome:
        self.thread.join(timeout)
        return self.outcome

    def _run(self) -> None:
        o = self.outcome
        headers = {"Authorization": f"Bearer {self.key}"}
        try:
            with httpx.stream("POST", self.base_url + "/v1/completions", json=self.body,
                              headers=headers, timeout=self.timeout) as r:
                o.status = r.status_code
                o.retry_after = r.headers.get("retry-after")
                if r.status_code != 200 or not self.body.get("stream"):
                    r.read()
                    _read_body(o, r)
                    return
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line[len("data: "):]
                    if data == "[DONE]":
                        o.done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        o.code = event["error"]["code"]
                        continue
                    choice = event["choices"][0]
                    if choice.get("text"):
                        o.tokens += 1
                        o.first_token_at = o.first_token_at or time.monotonic()
                    o.finish_reason = choice.get("finish_reason") or o.finish_reason
        except httpx.HTTPError as e:
            o.failure = f"{type(e).__name__}: {e}"
        finally:
            o.ended_at = time.monotonic()


def _read_body(o: Outcome, r: httpx.Response) -> None:
    body = r.json()
    if "error" in body:
        o.code = body["error"]["code"]
    else:
        o.finish_reason = body["choices"][0]["finish_reason"]
        o.tokens = body["usage"]["completion_tokens"]


def completion(base_url: str, key: str, body: dict, timeout: float = 120.0) -> Outcome:
    return StreamingRequest(base_url, key, body, timeout).start().join()


def admin_status(base_url: str, admin_key: str) -> dict:
    r = httpx.get(base_url + "/status", headers={"Authorization": f"Bearer {admin_key}"}, timeout=10)
    r.raise_for_status()
    return r.json()


def worker_pid(base_url: str, admin_key: str, role: str) -> int:
    return next(w["pid"] for w in admin_status(base_url, admin_key)["workers"]
                if w["role"] == role and w["state"] == "up")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
