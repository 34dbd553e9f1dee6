"""One streamed /v1/completions request, timed as its Server-Sent Events arrive.

TTFT is from sending the request to the first event that carries text; the inter-token
latencies are the gaps between successive text-carrying events. isoserve, vLLM and llama.cpp
send one token per event, so these are per-token gaps; a server that packs several tokens into
one event shows fewer, longer gaps. A token with no text of its own (a special token such as
<|im_end|>, which `ignore_eos` lets through, or part of a multi-byte character) sends no event
on isoserve, so its gap merges into the next one. Token counts always come from `usage`.

The loop does as little as it can per event: it runs on the same cores as the server. That is
why it is aiohttp's: its C parser and line reader spent 47-65 us of CPU per streamed token here,
where httpx's pure-Python stack spent 113-148 (128 requests at 32 concurrent, the two clients
alternating against one server). It takes each read as the socket gave it and splits the lines
itself, parsing with orjson: one await per read instead of two per event (the event's line and
the blank line after it), and 48-52 us per token against 54-59 for aiohttp's line iterator
(three rounds of 256 requests against one server, alternating). Every event of one read is
stamped with that read's time, as the line iterator gave them within microseconds anyway.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import aiohttp
import orjson


@dataclass
class RequestRecord:
    index: int
    start: float
    end: float = 0.0
    outcome: str = ""                  # "ok", "HTTP 400 context_length_exceeded", "stream error ...", ...
    ttft: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None   # from usage, when the server sends it
    output_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def gaps(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def completion_body(model: str, prompt: str, max_tokens: int, *, ignore_eos: bool,
                    temperature: float, seed: int | None, top_p: float = 1.0) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if top_p < 1.0:
        body["top_p"] = top_p
    if ignore_eos:
        body["ignore_eos"] = True  # an extension (vLLM, llama.cpp, isoserve); others ignore it
    if seed is not None:
        body["seed"] = seed
    return body


async def stream_completion(session: aiohttp.ClientSession, url: str, headers: dict, body: dict,
                            index: int) -> RequestRecord:
    clock = time.perf_counter
    record = RequestRecord(index, start=clock())
    times = record.token_times
    usage = None
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                record.outcome = f"HTTP {response.status} {_error_code(await response.read())}".strip()
                return record
            pending = b""  # the start of a line whose end has not arrived yet
            async for data in response.content.iter_any():  # each read, as the socket gave it
                now = clock()  # every event of this read arrived now
                lines = (pending + data).split(b"\n") if pending else data.split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        record.outcome = "ok"
                        break
                    chunk = orjson.loads(payload)
                    choices = chunk.get("choices")
                    if choices and choices[0].get("text"):
                        times.append(now)
                    elif "error" in chunk:
                        record.outcome = f"stream error {_code_of(chunk)}".strip()
                        break
                    if chunk.get("usage"):
                        usage = chunk["usage"]
                if record.outcome:  # [DONE] or an error event ended the stream
                    break
            else:
                record.outcome = record.outcome or "stream ended without [DONE]"
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # ValueError: an event that is not JSON
        record.outcome = f"exception {type(e).__name__}"
    finally:
        record.end = clock()
    if times:
        record.ttft = times[0] - record.start
    record.output_tokens = (usage or {}).get("completion_tokens") or len(times)
    record.prompt_tokens = (usage or {}).get("prompt_tokens")
    return record


def _error_code(raw: bytes) -> str:
    try:
        return _code_of(orjson.loads(raw))
    except ValueError:
        return ""


def _code_of(body) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("code") or error.get("type") or "")
    return str(error or "")
