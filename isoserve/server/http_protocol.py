"""The HTTP/1.1 protocol the server runs: uvicorn's httptools protocol, with a bound on the
request head.

Why httptools and not h11: every streamed token is one write through this layer, and on the
project's 2-core machines the router shares the cores with the workers. h11 is pure Python;
httptools (llhttp, in C) took the router from 2.4 to 1.9 CPU-s per 128 streamed requests, and
a 32-concurrent run from 884 / 906 / 930 to 877 / 947 / 1,000 tok/s (alternating fresh servers;
docs/benchmarks.md).

Why the write flow in the scope: the app bounds how long each response write may wait for the
client (app.py's _SlowClients), and uvicorn's send waits only while the connection's writing is
paused. Under SCOPE_WRITE_FLOW the app finds the connection's FlowControl and sets a timer only
then, not once per streamed token.

Why the bound: h11 bounded the request line plus headers (its max_incomplete_event_size);
llhttp has no such limit, and a client could grow a header for as long as the body timeout
allows. Here a request whose line and headers exceed MAX_HEADER_BYTES gets 431
request_headers_too_large in OpenAI's error body, and the connection is closed:
  - a head that completes is measured field by field, and over the bound it is answered by a
    small ASGI app instead of ours, through uvicorn's own response cycle;
  - a head still incomplete is measured by the bytes received since the request began (per
    read, so within one read of the exact figure), and is refused before it ends.
"""
from __future__ import annotations

import json

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from isoserve.errors import HeadersTooLarge
from isoserve.server.limits import MAX_HEADER_BYTES

LINGER_S = 2.0  # how long a refused client's remaining bytes are read and dropped
SCOPE_WRITE_FLOW = "isoserve.write_flow"  # the connection's uvicorn FlowControl (write_paused)

_ERROR = HeadersTooLarge(f"The request line and headers exceed {MAX_HEADER_BYTES} bytes.")
_BODY = json.dumps(_ERROR.to_openai()).encode()
_HEAD = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(_BODY)),
         (b"connection", b"close")]
# The same response as bytes, for a head refused before it ends (no response cycle exists yet).
_RAW = (b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        + b"".join(b"%s: %s\r\n" % h for h in _HEAD) + b"\r\n" + _BODY)


async def _refuse(scope, receive, send) -> None:
    await send({"type": "http.response.start", "status": _ERROR.http_status, "headers": _HEAD})
    await send({"type": "http.response.body", "body": _BODY})


class BoundedHeadProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that refuses a request head over MAX_HEADER_BYTES (module doc)."""

    _in_head = True     # from a request's first byte to the end of its headers
    _received = 0       # bytes received while in the head
    _fields = 0         # bytes of its request line and headers, as parsed
    _discarding = False  # refused: what the client still sends is read and dropped

    def data_received(self, data: bytes) -> None:
        if self._discarding:
            return
        if self._in_head:
            self._received += len(data)
        super().data_received(data)
        if self._in_head and self._received > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._refuse_incomplete_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[SCOPE_WRITE_FLOW] = self.flow
        self._fields = 16  # the request line's method, version, spaces and CRLF, about

    def on_url(self, url: bytes) -> None:
        self._fields += len(url)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._fields += len(name) + len(value) + 4  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        over = self._fields > MAX_HEADER_BYTES
        self._in_head, self._received = False, 0  # _fields starts again at the next message
        if not over:
            super().on_headers_complete()
            return
        self._log_refusal()
        app, self.app = self.app, _refuse  # this request only: uvicorn reads self.app here
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True  # the next request on this connection

    def _refuse_incomplete_head(self) -> None:
        self._log_refusal()
        if self.cycle is not None and not self.cycle.response_complete:
            # A response is still going out on this connection: closing ends it, and its
            # request is aborted as for any client that disconnects.
            self.transport.close()
            return
        self.transport.write(_RAW)
        # A lingering close: the client is likely still sending its head. Closing now, with its
        # bytes unread, would reset the connection and could destroy the 431 before the client
        # reads it. So the write side ends here, and what still arrives is dropped unparsed
        # until the client closes, or for LINGER_S at most.
        self._discarding = True
        self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    def _log_refusal(self) -> None:
        self.logger.warning("refused a request head of over %d bytes from %s", MAX_HEADER_BYTES,
                            "%s:%d" % tuple(self.client) if self.client else "an unknown client")
