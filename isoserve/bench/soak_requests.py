"""One soak request: send it, and classify how it ended (the outcomes of soak_report.py).

Streams are read event by event: text events are counted (for aborts after N events), an
error event is the answer even when [DONE] follows it, and a stream that stops without [DONE]
or an error event is lost. The connection is closed on purpose by leaving the response early
(mid-stream aborts) or by cancelling the request (aborts before the answer, in soak.py).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import httpx

from isoserve.bench.soak_report import SoakRecord


@dataclass(frozen=True)
class Tenant:
    name: str
    key: str


@dataclass
class Plan:
    record: SoakRecord
    tenant: Tenant
    body: dict
    abort_before_s: float | None = None     # close the connection this long after sending
    abort_after_events: int | None = None   # streams: close it after this many text events

    @property
    def path(self) -> str:
        return "/v1/completions" if self.record.api == "completions" else "/v1/chat/completions"


def _error_of(data) -> str | None:
    """The code of an OpenAI error body {"error": {"code", "type", ...}} ("" if it has none);
    None when `data` is not one."""
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or "")
    return None


def _choice_text(choice: dict) -> str:
    text = choice.get("text")
    if text is None:
        text = (choice.get("delta") or choice.get("message") or {}).get("content")
    return text if isinstance(text, str) else ""


def _transport_detail(e: httpx.HTTPError) -> str:
    if isinstance(e, httpx.ConnectError):
        return "could not connect"
    if isinstance(e, httpx.ConnectTimeout):
        return "connect timed out"
    if isinstance(e, httpx.RemoteProtocolError):
        return "connection closed without a complete response"
    if isinstance(e, httpx.ReadError):
        return "connection reset while reading"
    if isinstance(e, httpx.WriteError):
        return "connection reset while sending"
    return f"transport error {type(e).__name__}"


async def exchange(client: httpx.AsyncClient, plan: Plan) -> None:
    """Send one request and set its record's outcome (except aborted-before-answer and hung,
    which the caller decides)."""
    rec = plan.record
    headers = {"Authorization": f"Bearer {plan.tenant.key}"}
    try:
        if rec.stream:
            await _streamed(client, plan, headers)
        else:
            await _plain(client, plan, headers)
    except httpx.HTTPError as e:
        rec.finish("lost", detail=_transport_detail(e))


async def _plain(client: httpx.AsyncClient, plan: Plan, headers: dict) -> None:
    rec = plan.record
    r = await client.post(plan.path, json=plan.body, headers=headers)
    rec.status = r.status_code
    rec.retry_after = _retry_after(r)
    try:
        data = r.json()
    except ValueError:
        rec.finish("lost", detail=f"HTTP {r.status_code} body is not JSON")
        return
    code = _error_of(data)
    if code is not None:
        rec.finish("error", code=code)
        return
    if r.status_code != 200:
        rec.finish("lost", detail=f"HTTP {r.status_code} without an OpenAI error body")
        return
    choices = data.get("choices") if isinstance(data, dict) else None
    if not choices or not isinstance(choices[0], dict):
        rec.finish("lost", detail="200 without choices")
        return
    _usage(rec, data.get("usage"))
    rec.finish_reason = choices[0].get("finish_reason")
    if rec.finish_reason in ("stop", "length"):
        rec.finish("ok")
    else:
        rec.finish("lost", detail=f"200 with finish_reason {rec.finish_reason!r}")


async def _streamed(client: httpx.AsyncClient, plan: Plan, headers: dict) -> None:
    rec = plan.record
    async with client.stream("POST", plan.path, json=plan.body, headers=headers) as r:
        rec.status = r.status_code
        rec.retry_after = _retry_after(r)
        if r.status_code != 200:
            raw = await r.aread()
            try:
                code = _error_of(json.loads(raw))
            except ValueError:
                code = None
            if code is None:
                rec.finish("lost", detail=f"HTTP {r.status_code} without an OpenAI error body")
            else:
                rec.finish("error", code=code)
            return
        events, error_code, done = 0, None, False
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            try:
                chunk = json.loads(data)
            except ValueError:
                rec.finish("lost", detail="stream event is not JSON")
                return
            if not isinstance(chunk, dict):
                rec.finish("lost", detail="stream event is not a JSON object")
                return
            if (code := _error_of(chunk)) is not None:
                error_code = code  # [DONE] may follow; the error event is the answer
                continue
            choices = chunk.get("choices") or []
            if choices and isinstance(choices[0], dict):
                if _choice_text(choices[0]):
                    events += 1
                if choices[0].get("finish_reason"):
                    rec.finish_reason = choices[0]["finish_reason"]
            _usage(rec, chunk.get("usage"))
            if (plan.abort_after_events is not None and events >= plan.abort_after_events
                    and rec.finish_reason is None):
                rec.finish("aborted_by_client", detail=f"closed after {events} events")
                return  # leaving the block closes the connection
    if not rec.output_tokens:
        rec.output_tokens = events
    if error_code is not None:
        rec.finish("error", code=error_code)
    elif not done:
        rec.finish("lost", detail="stream ended without [DONE] or an error event")
    elif rec.finish_reason in ("stop", "length"):
        rec.finish("ok")
    else:
        rec.finish("lost", detail=f"stream ended with finish_reason {rec.finish_reason!r}")


def _retry_after(r: httpx.Response) -> float | None:
    value = r.headers.get("retry-after")
    try:
        return None if value is None else max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: not worth parsing for a loopback soak


def _usage(rec: SoakRecord, usage) -> None:
    if isinstance(usage, dict):
        rec.output_tokens = usage.get("completion_tokens") or rec.output_tokens
        rec.usage_prompt_tokens = usage.get("prompt_tokens", rec.usage_prompt_tokens)
