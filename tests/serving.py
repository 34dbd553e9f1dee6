"""Start real `isoserve serve` / `isoserve worker` processes for tests, on loopback only.

The process handling is the benchmark harness's (isoserve/bench/local_server.py); this module
adds what tests need on top: not waiting for health (for servers that must refuse to start).
"""
from __future__ import annotations

import contextlib
from pathlib import Path

from isoserve.bench.local_server import LocalServer, add_tenant, child_env, free_port, isoserve_cmd

__all__ = ["Server", "add_tenant", "free_port", "isoserve_cmd", "running_server", "subprocess_env",
           "wait_healthy"]

Server = LocalServer
subprocess_env = child_env


def wait_healthy(server: LocalServer, timeout: float = 180) -> None:
    server.wait_healthy(timeout)


@contextlib.contextmanager
def running_server(tmp_path: Path, *serve_args: str, wait: bool = True, env: dict | None = None):
    import subprocess

    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    cmd = isoserve_cmd("serve", "--port", str(port), *serve_args)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or child_env(),
                                start_new_session=True)
    server = LocalServer(proc, f"http://127.0.0.1:{port}", cmd, log_path)
    try:
        if wait:
            server.wait_healthy(180)
        yield server
    finally:
        server.stop()
