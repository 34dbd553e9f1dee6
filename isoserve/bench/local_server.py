"""Start `isoserve serve` on a free loopback port, wait for /health, stop it with SIGTERM.

For bench/run_benchmarks.py. The server runs in its own session, so its workers can be ended
with it if SIGTERM does not bring them all down.
"""
from __future__ import annotations

import contextlib
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


# Ports handed out by this process, never handed out twice: a port is free when picked, but the
# process that will bind it may start seconds later.
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A loopback port that nothing listens on, for a server that binds it later.

    Picked outside the kernel's ephemeral range (below it where there is room): a port from that
    range (what binding port 0 gives) can be taken meanwhile as the local end of any outgoing
    connection, a health poll included, and the server then fails to bind it.
    """
    low, high = _ephemeral_range()
    # Below the range; above it where a host starts its range too low to leave room below.
    candidates = list(range(max(1024, low - 12000), low)) or list(range(high + 1, min(65536, high + 12001)))
    random.shuffle(candidates)
    for port in candidates:
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port outside the ephemeral range ({low}-{high})")


def isoserve_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "isoserve.cli", *args]


def shown(cmd: list[str]) -> str:
    """The command as a reader would type it: `isoserve ...` instead of `python -m isoserve.cli`."""
    if cmd[:3] == [sys.executable, "-m", "isoserve.cli"]:
        cmd = ["isoserve", *cmd[3:]]
    return shlex.join(cmd)


def child_env(**extra: str) -> dict:
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **extra}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return env


def add_tenant(tenants: Path, name: str, admin: bool = False) -> str:
    """A new tenant's key: the last word of `isoserve tenants add`'s last line."""
    cmd = isoserve_cmd("tenants", "add", name, "--tenants", str(tenants)) + (["--admin"] if admin else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=child_env()).stdout
    return out.strip().splitlines()[-1].split()[-1]


@dataclass
class LocalServer:
    proc: subprocess.Popen
    base_url: str
    command: list[str]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, chars: int = 4000) -> str:
        return self.log()[-chars:]

    def metrics(self) -> str:
        return httpx.get(self.base_url + "/metrics", timeout=30).text

    def wait_healthy(self, timeout: float, poll_s: float = 0.5) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with status {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return
            time.sleep(poll_s)
        raise TimeoutError(f"server not healthy within {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # Workers the server left behind (its session is ours): SIGTERM, then SIGKILL.
        for sig, grace in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 0.0)):
            if not _signal_group(self.proc.pid, sig):
                break
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and _signal_group(self.proc.pid, 0):
                time.sleep(0.2)
        return self.proc.returncode


def _signal_group(pgid: int, sig: int) -> bool:
    """Signal a process group; False when no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except ProcessLookupError:
        return False


@contextlib.contextmanager
def local_server(serve_args: list[str], tenants: Path, log_path: Path, start_timeout: float = 900):
    port = free_port()
    cmd = isoserve_cmd("serve", "--port", str(port), "--tenants", str(tenants), *serve_args)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(),
                                start_new_session=True)
    server = LocalServer(proc, f"http://127.0.0.1:{port}", cmd, log_path)
    try:
        server.wait_healthy(start_timeout)
        yield server
    finally:
        server.stop()
