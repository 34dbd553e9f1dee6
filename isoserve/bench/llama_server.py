"""llama.cpp's native `llama-server` as a peer: where bench/build_llama_server.sh put it, and
starting it on a free loopback port on the same GGUF isoserve serves.

    with llama_server(binary, gguf, log, slots=32, slot_context=512) as server:
        server.base_url  # OpenAI-compatible /v1/completions, and llama.cpp's own /completion

Flags: -np slots (parallel sequences), -cb (continuous batching), -c slots x slot_context
(llama.cpp splits the context evenly over the slots), -t/-tb threads for generation and for
prompt processing, no web UI, and no prompt caching (--no-cache-prompt --cache-ram 0): isoserve
has no prefix cache, and `isoserve bench` sends the same seeded prompts at each load setting, so
a cache would let llama.cpp skip work the other engine does.
"""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

from isoserve.bench.local_server import LocalServer, free_port

ROOT = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = "bench/build_llama_server.sh"


def binary_path() -> Path | None:
    """$ISOSERVE_LLAMA_SERVER, else what bench/build_llama_server.sh built; None when neither."""
    candidates = [os.environ.get("ISOSERVE_LLAMA_SERVER"),
                  ROOT / "bench" / "llama.cpp-build" / "build" / "bin" / "llama-server"]
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return Path(c)
    return None


def gguf_path(model: str) -> Path | None:
    """The GGUF file behind an isoserve model name; None for a Hugging Face folder."""
    from isoserve.model.registry import resolve_model
    source = resolve_model(model)
    return source.path if source.kind == "gguf" else None


def server_command(binary: Path, gguf: Path, port: int, slots: int, slot_context: int,
                   threads: int = 2) -> list[str]:
    return [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "-np", str(slots), "-cb", "-c", str(slots * slot_context),
            "-t", str(threads), "-tb", str(threads), "--no-cache-prompt", "--cache-ram", "0",
            "--no-webui"]


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, log_path: Path, slots: int, slot_context: int,
                 threads: int = 2, start_timeout: float = 300):
    port = free_port()
    cmd = server_command(binary, gguf, port, slots, slot_context, threads)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = LocalServer(proc, f"http://127.0.0.1:{port}", cmd, log_path)
    try:
        server.wait_healthy(start_timeout)  # /health answers 503 while the model loads
        yield server
    finally:
        server.stop()
