"""Issue 7, input hardening: every request limit is a 400 naming its parameter, odd text is
served or refused but never a 5xx, and slow clients (a stalled upload, a reader that stops
reading) cannot hold a request, its KV pages or its connection beyond the timeouts.

The real app on a real engine (tiny random Llama) over real sockets, as in test_http_api."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time

import httpx
import pytest

from isoserve.server.app import create_app
from isoserve.server.limits import (MAX_BODY_BYTES, MAX_CONTENT_PARTS, MAX_HEADER_BYTES, MAX_MESSAGES,
                                    MAX_NAME_CHARS, MAX_PROMPT_CHARS, MAX_STOP_LENGTH,
                                    MAX_STOP_SEQUENCES, MAX_TOKEN_ID)
from isoserve.server.metrics import Metrics
from isoserve.server.tenants import TenantStore

from test_http_api import (CHAT, MODEL, assert_openai_error, backend, base_url, http, keys,  # noqa: F401
                           metrics, model_path, serve, stop, wait_for_abort)

VOCAB = 49152  # SmolLM2's tokenizer, which the tiny model uses
USER = [{"role": "user", "content": "hi"}]


# ---- limits: 400 with the parameter named ------------------------------------------------------

COMPLETION_LIMITS = [
    ("prompt", "x" * (MAX_PROMPT_CHARS + 1)),
    ("prompt", [1, VOCAB]),                        # just outside the vocabulary
    ("prompt", [[1, VOCAB + 1000]]),
    ("prompt[1]", [1, MAX_TOKEN_ID + 1]),
    ("prompt[1]", [1, -1]),
    ("prompt", ["one", "two"]),                    # a batch: one prompt per request
    ("prompt", [[1], [2]]),
    ("prompt", ""),
    ("prompt", []),
    ("max_tokens", 0),
    ("max_tokens", -5),
    ("n", 2),
    ("stop", ["s"] * (MAX_STOP_SEQUENCES + 1)),
    ("stop", "x" * (MAX_STOP_LENGTH + 1)),
    ("stop", [""]),
    ("stop", ""),
    ("stop_token_ids", [VOCAB]),
    ("stop_token_ids", [1] * 257),
    ("logprobs", 21),
    ("logprobs", -1),
    ("temperature", 2.5),
    ("temperature", -0.1),
    ("temperature", "0.5"),                        # strict types: a string is not a number
    ("top_p", 0),
    ("top_p", 1.01),
    ("top_k", -2),
    ("seed", 2**63),
    ("seed", -2**63 - 1),
    ("logit_bias", {"50": 5}),
    ("best_of", 3),
    ("suffix", "after"),
    ("stream", "yes"),
    ("user", "u" * (MAX_NAME_CHARS + 1)),
    ("model", "m" * (MAX_NAME_CHARS + 1)),
]


@pytest.mark.parametrize("param, value", COMPLETION_LIMITS,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(COMPLETION_LIMITS)])
def test_completion_limits_are_400_naming_the_param(http, backend, param, value):
    received = len(backend.received)
    field = param.split("[")[0]
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2} | {field: value}
    error = assert_openai_error(http.post("/v1/completions", json=body), 400, param=param)
    assert error["type"] == "invalid_request_error"
    assert len(backend.received) == received  # refused before anything was queued


CHAT_LIMITS = [
    ("messages", [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)),
    ("messages", []),
    ("messages", [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS // 2 + 1)}] * 2),
    ("messages[0].content", [{"role": "user", "content": [{"type": "text", "text": "a"}] * (MAX_CONTENT_PARTS + 1)}]),
    ("messages[0].content", [{"role": "user", "content": "x" * (MAX_PROMPT_CHARS + 1)}]),
    ("messages[0].content", [{"role": "user", "content": None}]),
    ("messages[0].role", [{"role": "tool", "content": "hi"}]),
    ("messages[0].name", [{"role": "user", "content": "hi", "name": "n" * (MAX_NAME_CHARS + 1)}]),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 21}),
    ("top_logprobs", {"top_logprobs": 3}),         # without logprobs: true
    ("max_completion_tokens", {"max_completion_tokens": 0}),
    ("response_format.type", {"response_format": {"type": "json_object"}}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("frequency_penalty", {"frequency_penalty": 0.5}),
]


@pytest.mark.parametrize("param, value", CHAT_LIMITS, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CHAT_LIMITS)])
def test_chat_limits_are_400_naming_the_param(http, param, value):
    extra = {"messages": value} if isinstance(value, list) else value
    body = {"model": MODEL, "messages": USER, "max_tokens": 2} | extra
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400, param=param)


def test_max_tokens_beyond_the_context_is_context_length_exceeded(http, backend):
    over = backend.max_model_len()
    assert_openai_error(http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": over}),
                        400, "context_length_exceeded")
    assert_openai_error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER,
                                                                "max_completion_tokens": 10**12}),
                        400, "context_length_exceeded")


def test_limits_at_the_edge_are_accepted(http):
    """The limits are limits, not off by one: the largest allowed values are served."""
    body = {"model": MODEL, "prompt": [1, VOCAB - 1], "max_tokens": 2, "logprobs": 20, "temperature": 2,
            "top_p": 1, "seed": -2**63, "stop": ["s" * MAX_STOP_LENGTH] * MAX_STOP_SEQUENCES,
            "stop_token_ids": [VOCAB - 1], "n": 1, "logit_bias": {}, "best_of": 1, "suffix": ""}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 1
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": USER, "max_tokens": 2,
                                                "logprobs": True, "top_logprobs": 20, "seed": 2**63 - 1})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 20


def test_extreme_sampling_values_are_served(http, backend):
    """Values at the edge of float range once crashed the engine step (found by schemathesis):
    logits / 1e-300 overflow, and a top_p that rounds to 0 in float32 dropped every token."""
    body = {"model": MODEL, "prompt": "Once upon", "max_tokens": 6, "ignore_eos": True}
    greedy = http.post("/v1/completions", json=body | {"temperature": 0}).json()["choices"][0]["text"]
    for t in (5e-324, 1e-300, 1e-30):
        r = http.post("/v1/completions", json=body | {"temperature": t})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy
    for top_p in (5e-324, 1e-46, 1e-9):  # only the most likely token stays: greedy again
        r = http.post("/v1/completions", json=body | {"top_p": top_p, "seed": 7})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy
    assert backend.healthy()


def test_body_over_the_size_limit_is_413(http):
    big = b'{"model": "' + MODEL.encode() + b'", "prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    assert_openai_error(http.post("/v1/completions", content=big), 413, "request_too_large")

    def chunks():  # no Content-Length: the limit holds while reading
        yield big[:1024]
        for i in range(1024, len(big), 2**20):
            yield big[i:i + 2**20]
    assert_openai_error(http.post("/v1/completions", content=chunks()), 413, "request_too_large")


# ---- odd text: served, or refused with a 400, never a 5xx -----------------------------------------

ODD_TEXT = ["nul\x00byte", "\u202eright-to-left override\u202c", "emoji 😀👍🏽👨‍👩‍👧", "\ufeffbom",
            "nonchars \ufffe\uffff\U0010ffff", "combining e\u0301\u0301\u0301", "\x1b[31mansi\x07\x08",
            "zero\u200bwidth\u200d", "\U000e0041 tag", "\r\n\t\v\f"]


@pytest.mark.parametrize("text", ODD_TEXT, ids=range(len(ODD_TEXT)))
def test_odd_unicode_is_served(http, text):
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": text, "max_tokens": 3,
                                               "stop": [text], "stream": stream, "logprobs": 2})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={
            "model": MODEL, "max_tokens": 3, "stream": stream, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "system", "content": text, "name": text},
                         {"role": "user", "content": [{"type": "text", "text": text}]}]})
        assert r.status_code == 200, r.text
        if not stream:
            r.json()
        else:
            events = [e for e in r.text.split("\n\n") if e]
            assert events[-1] == "data: [DONE]"
            assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-1])


RAW_BODIES = [  # (body, param the 400 must name; None: malformed JSON as a whole)
    (b'{"model": "tiny-llama", "prompt": "\\ud800"}', "prompt"),
    (b'{"model": "tiny-llama", "prompt": "ok \\udfff then"}', "prompt"),
    (b'{"model": "tiny-llama", "prompt": ["\\udc80"]}', "prompt[0]"),
    (b'{"model": "tiny-llama", "prompt": "hi", "stop": ["a", "\\ud83d"]}', "stop[1]"),
    (b'{"model": "tiny-llama", "prompt": "hi", "user": "\\ud800"}', "user"),
    (b'{"model": "tiny-llama", "prompt": "hi", "unknown \\ud800": 1}', "unknown \\ud800"),
    (b'{"model": "tiny-llama", "prompt": "\xff\xfe invalid utf-8"}', None),
    (b'{"model": "tiny-llama", "prompt": "\xc0\xaf overlong"}', None),
    (b'{"model": "tiny-llama", "prompt": "\xed\xa0\x80 encoded surrogate"}', "prompt"),
    (b'{"model": "tiny-llama", "prompt": "raw\x00nul"}', None),
    (b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}', "temperature"),
    (b'{"model": "tiny-llama", "prompt": "hi", "temperature": -Infinity}', "temperature"),
    (b'\xef\xbb\xbf{"model": "tiny-llama", "prompt": "bom"}', None),
    (b'[' * 100_000 + b']' * 100_000, None),
    (b'{"model": "tiny-llama", "prompt": "hi"', None),
]


@pytest.mark.parametrize("body, param", RAW_BODIES, ids=range(len(RAW_BODIES)))
def test_undecodable_text_is_400(http, body, param):
    r = http.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400, "invalid_request", param=param)
    if param is None:
        assert r.json()["error"]["param"] is None


def test_escaped_surrogate_pair_is_text(http):
    r = http.post("/v1/completions", content=b'{"model": "tiny-llama", "prompt": "\\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200, r.text


def test_lone_surrogate_in_chat_names_the_message(http):
    body = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "fine"}, ' \
           b'{"role": "user", "content": [{"type": "text", "text": "x\\udbff"}]}]}'
    r = http.post("/v1/chat/completions", content=body)
    assert_openai_error(r, 400, "invalid_request", param="messages[1].content[0].text")


# ---- slow clients ------------------------------------------------------------------------------

BODY_TIMEOUT, SEND_TIMEOUT = 1.5, 2.0


@pytest.fixture(scope="module")
def slow_url(backend, keys):
    """Its own app, with the slow-client timeouts shortened (read when the app is created)."""
    saved = {k: os.environ.get(k) for k in ("ISOSERVE_BODY_TIMEOUT_S", "ISOSERVE_SEND_TIMEOUT_S")}
    os.environ["ISOSERVE_BODY_TIMEOUT_S"] = str(BODY_TIMEOUT)
    os.environ["ISOSERVE_SEND_TIMEOUT_S"] = str(SEND_TIMEOUT)
    try:
        app = create_app(backend, TenantStore.load(keys["path"]), Metrics(), served_model_names=[MODEL])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    # A small send buffer (it also turns off autotuning): a client that stops reading blocks the
    # server's writes after kilobytes, not after the megabytes loopback would otherwise buffer.
    url, server, thread = serve(app, send_buffer=8192)
    yield url
    stop(server, thread)


def _connect(url: str, rcvbuf: int | None = None) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the advertised window is small from the start
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    return sock


def _request_head(key: str, length: int | None) -> bytes:
    size = f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    return (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\n{size}\r\n").encode()


def _read_all(sock: socket.socket, timeout: float) -> bytes:
    """Everything the server sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except socket.timeout:
        pytest.fail(f"the server kept the connection open; it sent {data[:300]!r}")
    return data


@pytest.mark.parametrize("chunked", [False, True])
def test_stalled_upload_gets_408_and_the_connection_closed(slow_url, keys, chunked):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with _connect(slow_url) as sock:
        started = time.monotonic()
        if chunked:
            sock.sendall(_request_head(keys["alice"], None) + b"%x\r\n" % 10 + body[:10] + b"\r\n")
        else:
            sock.sendall(_request_head(keys["alice"], len(body)) + body[:10])
        response = _read_all(sock, BODY_TIMEOUT + 10)
        waited = time.monotonic() - started
    head, _, payload = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), response
    assert b"connection: close" in head.lower()
    assert json.loads(payload)["error"]["code"] == "request_timeout"
    assert BODY_TIMEOUT - 0.1 <= waited < BODY_TIMEOUT + 5
    # The server goes on serving, and a client that sends its body in time is not affected.
    r = httpx.post(slow_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {keys['alice']}"})
    assert r.status_code == 200


def test_slow_but_moving_upload_within_the_timeout_is_served(slow_url, keys):
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2}).encode()
    with _connect(slow_url) as sock:
        sock.sendall(_request_head(keys["alice"], len(body)))
        for i in range(0, len(body), 16):
            sock.sendall(body[i:i + 16])
            time.sleep(BODY_TIMEOUT / 2 / (len(body) / 16))
        sock.settimeout(30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")


def test_client_that_stops_reading_a_stream_gets_its_request_aborted(slow_url, keys, backend):
    used_before = backend.engine.allocator.num_used
    # A long stream with fat events (top-20 logprobs per token), to a client that never reads:
    # the kernel buffers fill, then the server's writes block.
    body = json.dumps({"model": MODEL, "prompt": "Once", "max_tokens": 1900, "ignore_eos": True,
                       "logprobs": 20, "stream": True}).encode()
    received = len(backend.received)
    with _connect(slow_url, rcvbuf=4096) as sock:
        sock.sendall(_request_head(keys["alice"], len(body)) + body)
        deadline = time.monotonic() + 60
        while len(backend.received) == received:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        request_id = backend.received[-1].request_id
        started = time.monotonic()
        wait_for_abort(backend, request_id)  # aborted, and gone from the engine
        aborted_after = time.monotonic() - started
        # Once the client does read, it finds the stream cut short and the connection closed.
        tail = _read_all(sock, 30)
        assert tail.startswith(b"HTTP/1.1 200 ") and not tail.endswith(b"data: [DONE]\n\n")
    assert aborted_after < SEND_TIMEOUT + 5
    deadline = time.monotonic() + 5
    while backend.engine.allocator.num_used != used_before:  # its pages are free again
        assert time.monotonic() < deadline, (backend.engine.allocator.num_used, used_before)
        time.sleep(0.02)
    r = httpx.post(slow_url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
                   headers={"Authorization": f"Bearer {keys['alice']}"})
    assert r.status_code == 200


def test_a_client_that_keeps_up_has_no_write_timed(slow_url, keys, monkeypatch):
    """The send timeout arms a timer only while the connection's writing is paused (the test
    above takes that path): a stream read as it comes sets none, where it used to set one per
    token. Counted by wrapping asyncio.timeout for the send timeout's delay."""
    timed = []
    real_timeout = asyncio.timeout

    def counting_timeout(delay):
        if delay == SEND_TIMEOUT:
            timed.append(delay)
        return real_timeout(delay)

    monkeypatch.setattr(asyncio, "timeout", counting_timeout)
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", slow_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {keys['alice']}"}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "data: [DONE]" and len(events) >= 2
    assert timed == []


# ---- the request head: line and headers within MAX_HEADER_BYTES -------------------------------

def _head(key: str, padding: int, end: bool = True) -> bytes:
    head = (f"GET /v1/models HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer {key}\r\n"
            f"X-Trace: {'t' * padding}\r\n")
    return (head + ("\r\n" if end else "")).encode()


def test_headers_within_the_bound_are_served_and_over_it_get_431(base_url, keys):
    with _connect(base_url) as sock:  # a long tracing header, just inside: served, kept alive
        sock.sendall(_head(keys["alice"], MAX_HEADER_BYTES - 1024))
        sock.settimeout(10)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    for padding, end in ((MAX_HEADER_BYTES, True), (4 * MAX_HEADER_BYTES, False)):
        # Over the bound, whole (one write, answered through the app's response cycle) or
        # still growing (refused before it ends, as a client streaming an endless header is).
        with _connect(base_url) as sock:
            sock.sendall(_head(keys["alice"], padding, end))
            response = _read_all(sock, 10)
        head, _, payload = response.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head.lower(), response[:300]
        assert_openai_error(httpx.Response(431, content=payload), 431, "request_headers_too_large")
    assert httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {keys['alice']}"}).status_code == 200
