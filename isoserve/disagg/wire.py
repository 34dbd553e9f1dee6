"""Authenticated messages between router and workers (DESIGN invariant 8).

Every message is [header, mac, *payload]: the header is JSON (kind, sender, time, body), the
mac an HMAC-SHA256 of the header under the cluster secret. A peer without the secret cannot
register, submit a request or inject a transfer. KV payload bytes are covered by per-page
checksums that travel inside the signed header (see manifest.py), so they are not hashed twice.
"""
from __future__ import annotations

import hashlib
import hmac
import math
import os
import secrets
import time
from dataclasses import dataclass, field

import orjson

from isoserve.engine.sequence import TokenLogprob

MAX_CLOCK_SKEW_S = 300.0  # older (or future) messages are replays or a broken clock: dropped


def token_logprob_to_wire(lp: TokenLogprob | None) -> dict | None:
    """A token's logprob and its top list as a header carries them (the outputs message, and the
    first token's in a KV manifest). The token itself is not repeated: it is the one at the same
    place in the message's token ids (a manifest's first_token). JSON has no -Infinity, and
    orjson writes null for it and for NaN without a word: a value that is not finite travels as
    null on purpose, and token_logprob_from_wire makes it -inf again."""
    if lp is None:
        return None
    return {"logprob": _finite_or_null(lp.logprob), "top": [(t, _finite_or_null(v)) for t, v in lp.top]}


def token_logprob_from_wire(token_id: int, d: dict | None) -> TokenLogprob | None:
    if d is None:
        return None
    return TokenLogprob(token_id, _minus_inf_if_null(d["logprob"]), [(t, _minus_inf_if_null(v)) for t, v in d["top"]])


def _finite_or_null(value: float) -> float | None:
    return value if math.isfinite(value) else None


def _minus_inf_if_null(value: float | None) -> float:
    return -math.inf if value is None else value


class Unauthenticated(Exception):
    """A message without a valid signature, or too old to be fresh."""


@dataclass
class Message:
    kind: str
    sender: str
    body: dict
    payload: list = field(default_factory=list)  # zmq frames (bytes-like)


class Signer:
    def __init__(self, secret: bytes, sender: str):
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 bytes")
        self._secret = secret
        self.sender = sender

    def pack(self, kind: str, body: dict, payload: list | None = None) -> list:
        # orjson: a decode step's outputs message (one entry per running request) is packed on
        # the worker's main thread between steps, and unpacked on the router's one core. It
        # writes a non-finite float as null: a body carrying one encodes it explicitly (as
        # token_logprob_to_wire does), since the receiver cannot tell that null from a None.
        # Every body is string-keyed; a key that is not raises here rather than turning into a
        # string the receiver does not expect (OPT_NON_STR_KEYS would, at twice the cost: 7.1
        # against 3.9 us for a 32-output message).
        header = orjson.dumps({"kind": kind, "sender": self.sender, "time": time.time(),
                               "nonce": secrets.token_hex(8), "body": body})
        return [header, hmac.new(self._secret, header, hashlib.sha256).digest(), *(payload or [])]

    def unpack(self, frames: list) -> Message:
        if len(frames) < 2:
            raise Unauthenticated("message has no signature")
        header, mac = bytes(frames[0]), bytes(frames[1])
        expected = hmac.new(self._secret, header, hashlib.sha256).digest()
        if not hmac.compare_digest(mac, expected):
            raise Unauthenticated("bad signature")
        data = orjson.loads(header)
        if abs(time.time() - data["time"]) > MAX_CLOCK_SKEW_S:
            raise Unauthenticated("stale message")
        return Message(data["kind"], data["sender"], data["body"], list(frames[2:]))


def load_cluster_secret(path: str | None = None) -> bytes:
    """The secret comes from a file (multi-host) or ISOSERVE_CLUSTER_SECRET (set by `serve`
    for the workers it starts); never from the command line, where `ps` would show it."""
    if path:
        with open(path, "rb") as f:
            return f.read().strip()
    value = os.environ.get("ISOSERVE_CLUSTER_SECRET")
    if not value:
        raise ValueError("no cluster secret: pass --cluster-secret-file or set ISOSERVE_CLUSTER_SECRET")
    return value.encode()


def new_cluster_secret() -> str:
    return secrets.token_urlsafe(32)
