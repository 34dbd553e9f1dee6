"""The two ends of a streamed token on loopback sockets: the router's writes, held until the event
loop's next pass (server/http_protocol.py), and the bench client's reads, parsed whatever way the
socket cut them (bench/client.py)."""
from __future__ import annotations

import asyncio
import socket

import aiohttp
import orjson

from isoserve.bench.client import stream_completion
from isoserve.server.http_protocol import _PassWrites


class _Collect(asyncio.Protocol):
    def __init__(self):
        self.data = bytearray()
        self.reads = 0
        self.closed = asyncio.get_running_loop().create_future()

    def data_received(self, data: bytes) -> None:
        self.data += data
        self.reads += 1

    def connection_lost(self, exc) -> None:
        self.closed.set_result(None)


async def _connected_pair():
    """A real loopback connection: (the server, the writer's transport, the reader's protocol)."""
    loop = asyncio.get_running_loop()
    accepted = loop.create_future()

    def reader_protocol() -> _Collect:
        protocol = _Collect()
        accepted.set_result(protocol)
        return protocol

    server = await loop.create_server(reader_protocol, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
    transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return server, transport, await accepted


def test_writes_of_one_pass_leave_together_at_the_next():
    async def main():
        server, transport, reader = await _connected_pair()
        writes = _PassWrites(transport, asyncio.get_running_loop())
        writes.write(b"data: one\n\n")
        writes.write(b"data: two\n\n")
        assert writes.get_write_buffer_size() == 22  # held, and counted as buffered
        await asyncio.sleep(0.05)  # the loop's next pass sends them; then they travel
        assert bytes(reader.data) == b"data: one\n\ndata: two\n\n"
        assert reader.reads == 1  # one send, not two
        writes.write(b"data: last\n\n")
        writes.close()  # what is held goes out before the connection closes
        await asyncio.wait_for(reader.closed, 5)
        assert bytes(reader.data).endswith(b"data: last\n\n")
        server.close()
    asyncio.run(main())


def test_a_write_after_the_peer_left_is_dropped_not_raised():
    async def main():
        server, transport, reader = await _connected_pair()
        writes = _PassWrites(transport, asyncio.get_running_loop())
        writes.write(b"data: late\n\n")
        transport.abort()  # the connection is gone before the loop's next pass
        await asyncio.sleep(0.05)  # the flush finds it closing and writes nothing
        assert transport.is_closing()
        server.close()
    asyncio.run(main())


def _chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"choices": [{"index": 0, "text": text}]}) + b"\n\n"


def test_the_bench_client_parses_events_however_the_reads_cut_them():
    """Events split mid-line across reads, and several in one read, count as the tokens sent."""
    usage = b"data: " + orjson.dumps({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}) + b"\n\n"
    body = _chunk("a") + _chunk("b") + _chunk("c") + usage + b"data: [DONE]\n\n"
    cuts = [3, 40, 41, len(body) - 5]  # inside "data:", inside a JSON body, between events

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # the request head
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        await writer.drain()
        start = 0
        for cut in cuts + [len(body)]:
            writer.write(body[start:cut])
            await writer.drain()
            await asyncio.sleep(0.02)  # separate reads on the client
            start = cut
        writer.close()

    async def main():
        server = await asyncio.start_server(respond, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with aiohttp.ClientSession() as session:
            record = await stream_completion(session, f"http://127.0.0.1:{port}/v1/completions", {},
                                             {"prompt": "x"}, 0)
        server.close()
        return record

    record = asyncio.run(main())
    assert record.outcome == "ok"
    assert len(record.token_times) == 3
    assert record.output_tokens == 3 and record.prompt_tokens == 7
    assert record.ttft is not None and record.ttft > 0
