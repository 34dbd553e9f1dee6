"""How KV bytes move between workers. The roles use only these two classes, so another backend
(NIXL/UCX, RDMA) can stand in for zmq by providing the same methods.

A send hands zmq the page buffers without copying them; `done` turns true only when zmq no
longer needs them, which is when the prefill worker may free the pages behind them.
"""
from __future__ import annotations

import zmq


class ZmqKVSender:
    def __init__(self, ctx: zmq.Context):
        self._ctx = ctx
        self._peers: dict[str, zmq.Socket] = {}  # decode endpoint -> connected socket

    def send(self, endpoint: str, frames: list) -> zmq.MessageTracker:
        """Queue one message (header, signature, page buffers) to a decode worker."""
        return self._peer(endpoint).send_multipart(frames, copy=False, track=True)

    def _peer(self, endpoint: str) -> zmq.Socket:
        if endpoint not in self._peers:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._peers[endpoint] = sock
        return self._peers[endpoint]

    def drop(self, endpoint: str) -> bool:
        """Discard everything queued to a peer that is gone (zmq then releases the buffers, so
        the sends' trackers complete). False when we had no socket to it."""
        sock = self._peers.pop(endpoint, None)
        if sock is None:
            return False
        sock.close(0)
        return True

    def close(self) -> None:
        for sock in self._peers.values():
            sock.close(0)


class ZmqKVReceiver:
    def __init__(self, ctx: zmq.Context, endpoint: str, poller: zmq.Poller):
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        poller.register(self._sock, zmq.POLLIN)

    def receive(self, events: dict) -> list[list]:
        """Every message waiting (frames without the sender's routing id), without blocking."""
        if self._sock not in events:
            return []
        messages = []
        while True:
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            messages.append(frames[1:])

    def close(self) -> None:
        self._sock.close(0)
