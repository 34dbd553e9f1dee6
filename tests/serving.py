"""Start real `isoserve serve` / `isoserve worker` processes for tests, on loopback only."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def isoserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "isoserve.cli", *args]


def add_tenant(tenants: Path, name: str, admin: bool = False) -> str:
    """Adds a tenant with the real CLI; its key is the last word of the output's last line."""
    cmd = isoserve_cmd("tenants", "add", name, "--tenants", str(tenants)) + (["--admin"] if admin else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=subprocess_env()).stdout
    return out.strip().splitlines()[-1].split()[-1]


def subprocess_env(**extra: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class Server:
    def __init__(self, proc: subprocess.Popen, base_url: str, log_path: Path):
        self.proc = proc
        self.base_url = base_url
        self.log_path = log_path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def wait_healthy(server: Server, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited with {server.proc.returncode}:\n{server.log()[-5000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise TimeoutError(f"server not healthy in {timeout} s:\n{server.log()[-5000:]}")


@contextlib.contextmanager
def running_server(tmp_path: Path, *serve_args: str, wait: bool = True, env: dict | None = None):
    port = free_port()
    log_path = tmp_path / f"serve-{port}.log"
    cmd = isoserve_cmd("serve", "--port", str(port), *serve_args)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or subprocess_env(),
                                start_new_session=True)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        if wait:
            wait_healthy(server)
        yield server
    finally:
        server.stop()
        with contextlib.suppress(ProcessLookupError):  # leftover workers of a killed server
            os.killpg(proc.pid, signal.SIGKILL)
