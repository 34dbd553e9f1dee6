"""Raw pyzmq throughput between two processes over ipc://, for messages shaped like KV transfers.

The receiver (a child process) binds a PULL socket; this process PUSHes one unmeasured message,
then `count` multipart messages of `frames` frames of `frame_bytes` each, zero-copy. The
receiver's clock runs from the unmeasured message's arrival to the last message's, and it
reports bytes / seconds.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import tempfile
import time


def _receive(endpoint: str, count: int, results) -> None:
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    results.put("ready")
    sock.recv_multipart(copy=False)  # unmeasured: the connection is up, the sender is sending
    started = time.perf_counter()
    nbytes = 0
    for _ in range(count):
        nbytes += sum(len(f) for f in sock.recv_multipart(copy=False))
    seconds = time.perf_counter() - started
    results.put((nbytes, seconds))
    sock.close(linger=0)
    ctx.term()


def raw_throughput(frame_bytes: int, frames: int, count: int = 50) -> dict:
    """MB/s for `count` messages of `frames` x `frame_bytes` bytes each."""
    import numpy as np
    import zmq

    folder = tempfile.mkdtemp(prefix="isoserve-zmq-")
    endpoint = f"ipc://{folder}/raw.sock"
    spawn = mp.get_context("spawn")
    results = spawn.Queue()
    receiver = spawn.Process(target=_receive, args=(endpoint, count, results), daemon=True)
    receiver.start()
    try:
        if results.get(timeout=60) != "ready":
            raise RuntimeError("zmq receiver did not start")
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(endpoint)
        payload = [np.random.default_rng(0).integers(0, 255, frame_bytes, dtype=np.uint8)
                   for _ in range(frames)]
        sock.send_multipart(payload, copy=False)
        for _ in range(count):
            sock.send_multipart(payload, copy=False)
        nbytes, seconds = results.get(timeout=600)
        sock.close(linger=0)
        ctx.term()
    finally:
        receiver.join(timeout=10)
        if receiver.is_alive():
            receiver.kill()
        with contextlib.suppress(OSError):
            os.unlink(f"{folder}/raw.sock")
            os.rmdir(folder)
    return {"frame_bytes": frame_bytes, "frames": frames, "messages": count,
            "message_bytes": frame_bytes * frames, "mb_per_s": nbytes / seconds / 1e6}
