"""Issue 7 acceptance: under worker crashes, floods, deadlines and shutdown, every request ends
exactly once, with its tokens or an explicit error, and the server keeps serving.

Real `isoserve serve` processes with their real worker processes, on loopback, with a tiny
random Llama. The failpoint worker.step_delay_ms slows every engine step (as a bigger model
would), so requests are still in flight when a worker is killed under them.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import tempfile
import time

import httpx
import pytest

from isoserve.cli import main as isoserve_main
from isoserve.engine.deadlines import Deadlines
from isoserve.errors import InvalidRequest, RateLimited, ServerOverloaded
from isoserve.server.backpressure import LoadLimiter, LoadLimits
from isoserve.server.tenants import add_tenant, read_tenants
from reliability_client import StreamingRequest, admin_status, completion, wait_until, worker_pid
from serving import isoserve_cmd, running_server, subprocess_env
from tiny_models import make_tiny_llama

CONTEXT = 1024


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-reliability") / "llama"))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    path = tmp_path_factory.mktemp("reliability-tenants") / "tenants.toml"
    keys = {name: add_tenant(path, name) for name in ("alice", "bob", "carol", "flood")}
    keys["admin"] = add_tenant(path, "admin", admin=True)
    keys["single"] = add_tenant(path, "single", limits={"max_concurrent_requests": 1})
    return path, keys


def serve(tmp_path, model, tenants, *args: str, failpoints: str = "worker.step_delay_ms=30"):
    env = {**subprocess_env(), "ISOSERVE_FAILPOINTS": failpoints}
    return running_server(tmp_path, "--model", model, "--dtype", "float32", "--tenants", str(tenants[0]),
                          "--context-length", str(CONTEXT), "--threads-per-worker", "1",
                          "--enable-failpoints", *args, env=env)


def join_with_worker_stopped(server, admin_key: str, stream: StreamingRequest, role: str,
                             timeout: float):
    """Once `stream` has its first token, stops the `role` worker (SIGSTOP: silent, alive),
    joins the stream for at most `timeout` s and resumes the worker whatever happened.
    Returns (the stream's outcome, when the worker was stopped, its pid)."""
    wait_until(lambda: stream.outcome.tokens, 60, "the stream to start")
    pid = worker_pid(server.base_url, admin_key, role)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        return stream.join(timeout), stopped, pid
    finally:
        os.kill(pid, signal.SIGCONT)


def model_name(base_url: str, key: str) -> str:
    r = httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=10)
    return r.json()["data"][0]["id"]


def body(name: str, prompt: str, max_tokens: int, stream: bool = True) -> dict:
    return {"model": name, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}


def probe_finds_nothing(base_url: str, keys: dict, tmp_path, scenarios: tuple[str, ...] = ()) -> None:
    """scenarios: the probe's own names; none: all of them."""
    report_path = tmp_path / f"probe-{time.monotonic_ns()}.json"
    status = isoserve_main(["probe", "--base-url", base_url, "--key", keys["alice"], "--key", keys["bob"],
                            "--key", keys["carol"], "--seed", "7", "--timeout", "60", "--requests", "8",
                            *[a for name in scenarios for a in ("--scenario", name)],
                            "--quiet", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert status == 0 and not report["findings"], report["findings"]


def back_in_service(server, keys: dict, role: str, old_pid: int) -> None:
    """The killed worker was restarted, registered again and passed the audit."""
    def restarted():
        workers = [w for w in admin_status(server.base_url, keys["admin"])["workers"] if w["role"] == role]
        return workers and all(w["state"] == "up" and w["pid"] != old_pid for w in workers)
    wait_until(restarted, 180, f"the {role} worker to come back")
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    assert f'isoserve_worker_restarts_total{{role="{role}"}} 1.0' in server.metrics()


# ==== worker crashes ============================================================================

def test_kill_decode_worker_mid_stream_under_load(tmp_path, model, tenants):
    """Each worker process slows only its first 200 steps (6 s): enough to kill the decode
    worker under six streams of 600 tokens. The count is per process, so the restarted decode
    worker slows its first 200 steps too, those of the completions and probe after it."""
    keys = tenants[1]
    with serve(tmp_path, model, tenants, failpoints="worker.step_delay_ms=30x200") as server:
        name = model_name(server.base_url, keys["alice"])
        streams = [StreamingRequest(server.base_url, keys[("alice", "bob")[i % 2]],
                                    body(name, f"Tell story number {i}.", 600)).start() for i in range(6)]
        wait_until(lambda: all(s.outcome.tokens >= 2 for s in streams), 120, "every stream to be mid-way")
        pid = worker_pid(server.base_url, keys["admin"], "decode")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for s in streams:
            o = s.join(30)
            assert o.ended_at is not None, "a request hung after the decode worker died"
            assert o.ended_at - killed < 5.0, f"ended {o.ended_at - killed:.1f} s after the kill"
            # The 200 header was out: the error arrives as an event, then [DONE].
            assert (o.status, o.code, o.done, o.failure) == (200, "worker_unavailable", True, None), o
        back_in_service(server, keys, "decode", pid)
        for i in range(3):
            assert completion(server.base_url, keys["carol"], body(name, f"after {i}", 8, stream=i % 2 == 0)).ok
        probe_finds_nothing(server.base_url, keys, tmp_path)


def test_kill_prefill_worker_mid_transfer(tmp_path, model, tenants):
    """transfer.delay_ms holds a transfer open in the prefill worker (its KV computed, about
    to be sent) for a second: the kill lands inside the first, with more prompts queued behind.
    Only the first 4 transfers of each prefill process wait, so the probe after the restart
    does not wait a second for each of its own."""
    keys = tenants[1]
    with serve(tmp_path, model, tenants, failpoints="transfer.delay_ms=1000x4") as server:
        name = model_name(server.base_url, keys["alice"])
        requests = [StreamingRequest(server.base_url, keys["alice"], body(name, f"prompt {i}", 16, stream=i % 2 == 0))
                    for i in range(4)]
        for r in requests:
            r.start()
        time.sleep(0.6)
        pid = worker_pid(server.base_url, keys["admin"], "prefill")
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        for r in requests:
            o = r.join(30)
            assert o.ended_at is not None and o.ended_at - killed < 5.0, o
            # No token had been sent yet: the client gets the real status, not a 200.
            assert (o.status, o.code, o.failure) == (503, "worker_unavailable", None), o
            assert o.retry_after is not None
        back_in_service(server, keys, "prefill", pid)
        # The decode worker holds no pages for the requests that died with the prefill worker.
        decode = next(w for w in admin_status(server.base_url, keys["admin"])["workers"] if w["role"] == "decode")
        assert decode["pages_used"] == 0
        assert completion(server.base_url, keys["bob"], body(name, "after the crash", 8, stream=False)).ok
        # What a crash mid-transfer could leave behind is KV in pages that later requests get.
        probe_finds_nothing(server.base_url, keys, tmp_path)


def test_a_long_step_is_not_a_dead_worker_and_a_stalled_worker_comes_back(tmp_path, model, tenants):
    """Steps longer than the heartbeat timeout (a long prompt on one core) keep the worker in
    service: its liveness thread answers. A worker that stops altogether (SIGSTOP) is marked
    down and its requests end; when it answers again it drops what it held, registers again and
    serves, without a restart. Each worker's first two steps are the long ones: the first
    request's, and the one during which the decode worker is stopped; the request after the
    stall runs at speed."""
    keys = tenants[1]
    with serve(tmp_path, model, tenants, "--heartbeat-timeout", "1.5",
               failpoints="worker.step_delay_ms=2500x2") as server:
        name = model_name(server.base_url, keys["alice"])
        assert completion(server.base_url, keys["alice"], body(name, "slow steps", 2, stream=False)).ok
        assert "marked down" not in server.log()
        stream = StreamingRequest(server.base_url, keys["bob"], body(name, "to be stalled", 40)).start()
        o, stopped, pid = join_with_worker_stopped(server, keys["admin"], stream, "decode", 30)
        assert (o.code, o.done) == ("worker_unavailable", True) and o.ended_at - stopped < 5.0, o
        wait_until(lambda: any(w["pid"] == pid and w["state"] == "up"
                               for w in admin_status(server.base_url, keys["admin"])["workers"]), 60,
                   "the same decode process back in service", interval=0.5)
        assert completion(server.base_url, keys["carol"], body(name, "after the stall", 2, stream=False)).ok
        assert "asking it to register again" in server.log()


# ==== backpressure ==============================================================================

def test_429_when_queues_are_full_and_a_flood_does_not_starve_other_tenants(tmp_path, model, tenants):
    keys = tenants[1]
    with serve(tmp_path, model, tenants, "--mode", "aggregated", "--max-requests-in-flight", "8",
               "--tenant-max-concurrent-requests", "4") as server:
        name = model_name(server.base_url, keys["flood"])
        flood = [StreamingRequest(server.base_url, keys["flood"], body(name, f"flood {i}", 120)).start()
                 for i in range(16)]
        time.sleep(0.5)
        others = [StreamingRequest(server.base_url, keys[t], body(name, f"{t} asks", 20, stream=False)).start()
                  for t in ("bob", "carol")]
        for o in [r.join(120) for r in others]:
            assert o.ok, o
        flooded = [r.join(120) for r in flood]
        refused = [o for o in flooded if o.status == 429]
        assert len(refused) >= 12 and sum(o.ok for o in flooded) == len(flooded) - len(refused)
        assert {o.code for o in refused} == {"rate_limit_exceeded"} and all(o.retry_after for o in refused)
        # The server-wide bound: two tenants at their limit fill it; the next request is refused.
        held = [StreamingRequest(server.base_url, keys[t], body(name, f"{t} {i}", 120)).start()
                for t in ("alice", "bob") for i in range(4)]
        wait_until(lambda: all(s.outcome.tokens for s in held), 60, "eight streams to be running")
        over = completion(server.base_url, keys["carol"], body(name, "one too many", 4, stream=False))
        assert (over.status, over.code) == (429, "server_overloaded") and over.retry_after
        for s in held:
            assert s.join(120).ok
        # A tenant's own limit from the tenants file.
        first = StreamingRequest(server.base_url, keys["single"], body(name, "mine", 120)).start()
        wait_until(lambda: first.outcome.tokens, 60, "the single tenant's first stream")
        second = completion(server.base_url, keys["single"], body(name, "and another", 4, stream=False))
        assert (second.status, second.code) == (429, "rate_limit_exceeded")
        assert first.join(120).ok
        # It clears: the flooding tenant is served again once its requests are done.
        assert completion(server.base_url, keys["flood"], body(name, "again", 8, stream=False)).ok
        assert completion(server.base_url, keys["single"], body(name, "again", 8, stream=False)).ok
        assert 'isoserve_requests_rejected_by_limits_total{limit="tenant_requests"}' in server.metrics()


# ==== deadlines =================================================================================

def test_queue_and_generation_deadlines_have_their_own_codes(tmp_path, model, tenants):
    """The worker ends a request past its queue or generation deadline. A worker that cannot
    (stopped: silent, but within its heartbeat timeout) leaves the generation deadline to the
    router, which ends the stream DEADLINE_BACKSTOP_S after it and aborts it on the worker."""
    from isoserve.server.router import DEADLINE_BACKSTOP_S
    keys = tenants[1]
    generation_s = 3
    with serve(tmp_path, model, tenants, "--mode", "aggregated", "--max-num-seqs", "1",
               "--queue-timeout", "1", "--generation-timeout", str(generation_s),
               "--heartbeat-timeout", "120") as server:
        name = model_name(server.base_url, keys["alice"])
        long = StreamingRequest(server.base_url, keys["alice"], body(name, "a long one", 900)).start()
        wait_until(lambda: long.outcome.tokens, 60, "the long stream to start")
        queued = completion(server.base_url, keys["bob"], body(name, "behind it", 4, stream=False))
        assert (queued.status, queued.code) == (503, "queue_timeout") and queued.retry_after
        o = long.join(30)
        assert (o.status, o.code, o.done) == (200, "generation_timeout", True) and o.tokens > 0
        # The worker is free again and serves the next request normally.
        assert completion(server.base_url, keys["bob"], body(name, "now", 4, stream=False)).ok

        # The router's backstop: the same deadline with the worker stopped mid-stream.
        hung = StreamingRequest(server.base_url, keys["alice"], body(name, "a hung one", 900)).start()
        o, stopped, _ = join_with_worker_stopped(server, keys["admin"], hung, "aggregated",
                                                 generation_s + DEADLINE_BACKSTOP_S + 30)
        assert (o.status, o.code, o.done) == (200, "generation_timeout", True) and o.tokens > 0, o
        assert o.ended_at - stopped < generation_s + DEADLINE_BACKSTOP_S + 5
        # Running again, the worker took the abort: its pages are free and it serves the next one.
        assert completion(server.base_url, keys["bob"], body(name, "again", 4, stream=False)).ok
        wait_until(lambda: admin_status(server.base_url, keys["admin"])["workers"][0]["pages_used"] == 0,
                   30, "the aborted request's pages to be freed")


# ==== graceful shutdown =========================================================================

def test_sigterm_lets_requests_in_flight_finish_and_exits_0(tmp_path, model, tenants):
    keys = tenants[1]
    with serve(tmp_path, model, tenants, "--shutdown-grace", "60") as server:
        name = model_name(server.base_url, keys["alice"])
        streams = [StreamingRequest(server.base_url, keys["alice"], body(name, f"drain {i}", 60, stream=i < 3)).start()
                   for i in range(4)]
        wait_until(lambda: all(s.outcome.tokens for s in streams[:3]), 60, "the streams to start")
        server.proc.send_signal(signal.SIGTERM)
        for s in streams:
            o = s.join(60)
            assert o.ok and o.tokens == 60, o
        assert server.proc.wait(60) == 0
        log = server.log()
        assert "every request in flight finished" in log and "Traceback" not in log
        # Its sockets and core-share file went with it.
        runtime_dir = re.search(r"listening for workers on ipc://(\S+)/router\.sock", log).group(1)
        assert runtime_dir.startswith(tempfile.gettempdir()) and not os.path.exists(runtime_dir)


def test_sigterm_past_the_grace_period_ends_requests_with_an_explicit_error(tmp_path, model, tenants):
    keys = tenants[1]
    with serve(tmp_path, model, tenants, "--mode", "aggregated", "--shutdown-grace", "1") as server:
        name = model_name(server.base_url, keys["alice"])
        streams = [StreamingRequest(server.base_url, keys["bob"], body(name, f"endless {i}", 900, stream=i == 0)).start()
                   for i in range(2)]
        time.sleep(1.0)
        server.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        stream, plain = (s.join(30) for s in streams)
        assert (stream.status, stream.code, stream.done) == (200, "server_shutting_down", True), stream
        assert (plain.status, plain.code) == (503, "server_shutting_down"), plain
        assert server.proc.wait(30) == 0 and time.monotonic() - started < 15
        with pytest.raises(httpx.ConnectError):
            httpx.get(server.base_url + "/health", timeout=2)


# ==== the pieces, without a server ===============================================================

def test_load_limiter_bounds_per_tenant_and_server_wide_and_releases_once():
    limiter = LoadLimiter(LoadLimits(max_requests=4, max_tokens=1000, tenant_max_requests=2,
                                     tenant_max_tokens=600))
    a1, _ = limiter.admit("a", {}, 100), limiter.admit("a", {}, 100)
    with pytest.raises(RateLimited) as e:  # a's third request
        limiter.admit("a", {}, 100)
    assert (e.value.code, e.value.http_status) == ("rate_limit_exceeded", 429) and e.value.retry_after
    limiter.admit("b", {}, 450)
    with pytest.raises(RateLimited):  # b's tokens: 450 + 200 > 600
        limiter.admit("b", {}, 200)
    with pytest.raises(ServerOverloaded) as e:  # server tokens: 650 + 400 > 1000
        limiter.admit("c", {}, 400)
    assert (e.value.code, e.value.http_status) == ("server_overloaded", 429)
    limiter.admit("c", {}, 10)
    with pytest.raises(ServerOverloaded):  # four requests in flight: the server is full
        limiter.admit("d", {}, 10)
    a1.release()
    a1.release()  # once only
    assert (limiter.requests, limiter.tokens) == (3, 560)
    with pytest.raises(InvalidRequest):  # more than the tenant may ever hold: retrying won't help
        limiter.admit("c", {"max_queued_tokens": 50}, 51)
    with pytest.raises(RateLimited):  # c's own limit from the tenants file
        limiter.admit("c", {"max_concurrent_requests": 1}, 10)
    assert limiter.admit("d", {}, 10)


def test_tenant_limits_are_validated_and_written(tmp_path):
    path = tmp_path / "t.toml"
    add_tenant(path, "x", limits={"max_concurrent_requests": 3, "max_queued_tokens": None})
    assert read_tenants(path)[0].limits == {"max_concurrent_requests": 3}
    for bad in ({"max_concurrent_requests": 0}, {"max_concurrent_requests": True}, {"bogus": 1}):
        with pytest.raises(ValueError):
            add_tenant(path, "y", limits=bad)
    done = subprocess.run(isoserve_cmd("tenants", "add", "z", "--tenants", str(path), "--max-queued-tokens", "-4"),
                          capture_output=True, text=True, env=subprocess_env())
    assert done.returncode != 0 and "positive integer" in done.stderr


def test_counted_failpoint_values_fire_for_the_first_hits_only():
    from isoserve.failpoints import Failpoints
    points = Failpoints("transfer.delay_ms=1000x2;worker.step_delay_ms=30", enabled=True)
    assert [points.value("transfer.delay_ms") for _ in range(4)] == [1000, 1000, 0, 0]
    assert [points.value("worker.step_delay_ms") for _ in range(3)] == [30, 30, 30]
    assert Failpoints("transfer.delay_ms=1000x2").value("transfer.delay_ms") == 0  # not enabled


def test_deadlines_travel_as_seconds_left():
    d = Deadlines(queue_s=5, generation_s=60)
    assert Deadlines.from_wire(d.to_wire()) == d
    assert Deadlines.from_wire(None) == Deadlines()
    left = d.remaining(time.monotonic() - 2)
    assert 2.9 < left.queue_s <= 3.0 and 57.9 < left.generation_s <= 58
    assert Deadlines(queue_s=1).remaining(time.monotonic() - 5).queue_s == 0
    with pytest.raises(ValueError):
        Deadlines.from_wire({"queue_s": float("nan")})
