"""Every bound on what a client may send, and how slowly, in one place (README: "Limits").

Each one is checked before any work is queued: over a limit is a 400 naming the parameter
(413 for the body, 408 for a client too slow to send it), never a 500 and never a silently
shortened request.
"""
from __future__ import annotations

import os
from typing import Any

from isoserve.engine.sampling_params import MIN_TEMPERATURE as ENGINE_MIN_TEMPERATURE

# A prompt of a full 128k context as token ids in JSON is about 1 MiB; anything far bigger is
# not a request we could serve, and reading it would only cost memory.
MAX_BODY_BYTES = 8 * 2**20
# A string prompt, or all of a chat's message contents together. Tokenizing runs in the
# server's tokenizer thread; a million characters take well under a second and are far beyond
# any context we serve.
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKEN_IDS = 1_048_576      # the longest context any model we load advertises
MAX_TOKEN_ID = 2**31 - 1              # beyond any vocabulary; the served one is checked as well
MAX_MESSAGES = 2048
MAX_CONTENT_PARTS = 256               # text parts of one message
MAX_NAME_CHARS = 256                  # `user`, a message's `name`, the model name
MAX_STOP_SEQUENCES = 16               # OpenAI allows 4; vLLM clients often send more
MAX_STOP_LENGTH = 256                 # each one is searched for after every token
MAX_STOP_TOKEN_IDS = 256
# A positive temperature below this is sampled greedily (the engine's rule, restated here).
MIN_TEMPERATURE = ENGINE_MIN_TEMPERATURE

# Slow clients. A client may take this long, from its request line on, to send the whole body;
# then it gets 408 request_timeout and the connection is closed.
BODY_TIMEOUT_S = 30.0
# A single write of the response (an SSE event, a JSON body) may wait this long for the client
# to read; then the request is aborted, its KV pages freed, and the connection closed.
SEND_TIMEOUT_S = 60.0
# Idle keep-alive connections are closed after this; above the 60 s idle timeout of common load
# balancers, so they never reuse a connection the server is closing.
KEEP_ALIVE_TIMEOUT_S = 65
# Request line plus headers (server/http_protocol.py; over it: 431). Common defaults are 8-16 KiB,
# which long bearer keys and tracing headers can exceed.
MAX_HEADER_BYTES = 64 * 1024


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return seconds


def body_timeout_s() -> float:
    return _env_seconds("ISOSERVE_BODY_TIMEOUT_S", BODY_TIMEOUT_S)


def send_timeout_s() -> float:
    return _env_seconds("ISOSERVE_SEND_TIMEOUT_S", SEND_TIMEOUT_S)


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """Where in a parsed JSON value a string (or key) holds a lone UTF-16 surrogate ("\\ud800"),
    as a parameter path like `messages[0].content`; None when there is none. Such strings are
    valid JSON escapes but not text: they cannot be encoded, tokenized or sent back (so a key
    that holds one appears in the path escaped, as `\\ud800`)."""
    if isinstance(value, str):
        return (path or "body") if _printable(value) != value else None
    if isinstance(value, dict):
        for key, item in value.items():
            name = _printable(key)
            here = f"{path}.{name}" if path else name
            found = here if name != key else lone_surrogate_at(item, here)
            if found:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = lone_surrogate_at(item, f"{path}[{i}]")
            if found:
                return found
    return None


def _printable(text: str) -> str:
    """`text` with each lone surrogate (the only code points UTF-8 cannot encode) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
