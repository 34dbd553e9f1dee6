"""The bench client's end of a streamed token on a loopback socket: events parsed whatever way the
socket cut them (bench/client.py)."""
from __future__ import annotations

import asyncio

import aiohttp
import orjson

from isoserve.bench.client import stream_completion


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
