"""The signed worker <-> router messages (disagg/wire.py): what a header carries comes back as
it was sent, and a header changed in flight is refused."""
from __future__ import annotations

import math

import pytest

from isoserve.disagg.manifest import Manifest, PageRecord
from isoserve.disagg.wire import Signer, Unauthenticated, token_logprob_from_wire, token_logprob_to_wire
from isoserve.disagg.worker import output_to_wire
from isoserve.engine.engine import RequestOutput
from isoserve.engine.sequence import TokenLogprob
from isoserve.server.router import _output_from_wire

SECRET = b"a-cluster-secret-for-tests-only"


def _through_the_wire(output: RequestOutput) -> RequestOutput:
    worker, router = Signer(SECRET, "decode-0"), Signer(SECRET, "router")
    frames = worker.pack("outputs", {"outputs": [output_to_wire(output)]})
    message = router.unpack(frames)
    assert (message.kind, message.sender) == ("outputs", "decode-0")
    return _output_from_wire(message.body["outputs"][0])


def test_an_output_arrives_as_it_was_sent():
    output = RequestOutput("r1", [17, 4_000_000], [TokenLogprob(17, -0.25, [(17, -0.25), (3, -1.5)]), None],
                           " h\u00e9llo \u4e2d\U0001f600", False, None, None, 12, 2)
    assert _through_the_wire(output) == output


def test_a_token_ruled_out_keeps_its_minus_infinity():
    # JSON has no -Infinity: the header carries null for it, and the router makes it -inf again
    # (not null, which the formatter could not turn into a number, nor a made-up finite value).
    output = RequestOutput("r2", [5], [TokenLogprob(5, -math.inf, [(9, -0.01), (5, -math.inf)])], "x",
                           True, "length", None, 3, 1)
    back = _through_the_wire(output)
    assert back.new_logprobs[0].logprob == -math.inf
    assert back.new_logprobs[0].top == [(9, -0.01), (5, -math.inf)]
    assert back == output


def test_a_kv_manifest_keeps_the_first_tokens_minus_infinity():
    # The prefill worker sends the first token's logprob to the decode worker in the manifest;
    # a null there became a TokenLogprob of None, and the decode worker died sending it on.
    first = TokenLogprob(5, -math.inf, [(7, -0.1), (5, -math.inf)])
    sent = Manifest("r5", 17, 16, [PageRecord(0, 16, 3, 1, 99), PageRecord(1, 1, 3, 1, 42)], 5,
                    token_logprob_to_wire(first), 1.5, 0, "bfloat16")
    frames = Signer(SECRET, "prefill-0").pack("kv", sent.to_wire())
    received = Manifest.from_wire(Signer(SECRET, "decode-0").unpack(frames).body)
    assert token_logprob_from_wire(received.first_token, received.first_logprob) == first
    assert (received.pages, received.first_token, received.kv_dtype) == (sent.pages, 5, "bfloat16")


def test_a_header_changed_in_flight_is_refused():
    frames = Signer(SECRET, "decode-0").pack("outputs", {"outputs": [{"request_id": "r3"}]})
    tampered = [frames[0].replace(b"r3", b"r4"), *frames[1:]]
    with pytest.raises(Unauthenticated):
        Signer(SECRET, "router").unpack(tampered)
