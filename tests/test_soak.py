"""Issue 7's soak tool (`isoserve bench --soak`) against a real `isoserve serve`.

One disaggregated server with a tiny random Llama (loopback, small pools) serves both live
soaks, run in this process through the CLI entry point:

- a short soak from two tenants with client aborts and no kills: every request is accounted
  for (issued == the sum of the outcomes), none lost or hung, exit status 0;
- then a soak that SIGKILLs a prefill or decode worker every 4 s, followed by the leak probe:
  still none lost or hung (the requests of a killed worker end with explicit errors), every
  killed worker comes back, and the probe finds nothing. This needs the server's worker
  supervision (restart with backoff; in-flight requests ended with 503 worker_unavailable).

The same server also takes one `isoserve bench --base-url` load run (the HTTP mode issue 6's
benchmarks use). The loopback check and the key parsing run without a server.
"""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest

from isoserve.bench.client import completion_body
from isoserve.bench.soak import SoakError, check_loopback, parse_tenant
from isoserve.cli import main as isoserve_main
from serving import add_tenant, running_server
from tiny_models import make_tiny_llama

CONTEXT, POOL = 1024, 2048
SHAPE = ("--soak-max-prompt-tokens", "200", "--soak-max-output-tokens", "48", "--concurrency", "4")


# ---- without a server ------------------------------------------------------------------------

@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://localhost:9/v1", "http://[::1]:8000",
                                 "127.0.0.1:8000", "http://127.0.0.2:80"])
def test_loopback_urls_are_accepted(url):
    check_loopback(url)


@pytest.mark.parametrize("url", ["http://10.0.0.7:8000", "http://192.168.1.2", "https://api.example.com/v1",
                                 "http://0.0.0.0:8000", "http://[2001:db8::1]:8000", "http://localhost.evil.com"])
def test_non_loopback_urls_are_refused(url):
    with pytest.raises(SoakError, match="loopback"):
        check_loopback(url)


def test_the_cli_refuses_a_non_loopback_url_before_sending_anything(capsys):
    status = isoserve_main(["bench", "--soak", "--base-url", "http://192.0.2.1:8000", "--soak-keys", "a,b",
                            "--duration", "5"])
    assert status == 2
    assert "refusing to soak" in capsys.readouterr().err


def test_tenant_keys_in_every_accepted_form():
    assert parse_tenant("isk-abc", 3).key == "isk-abc" and parse_tenant("isk-abc", 3).name == "tenant-3"
    assert parse_tenant("alice=isk-abc", 0) == parse_tenant("alice isk-abc", 0)
    added = "Added tenant 'bob' to t.toml; its API key (shown only now): isk-xyz"
    assert (parse_tenant(added, 0).name, parse_tenant(added, 0).key) == ("bob", "isk-xyz")


# ---- outcomes, against a fake transport ------------------------------------------------------

def _sse(*events) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n" for e in events)


TOKEN = {"choices": [{"index": 0, "text": "hi", "finish_reason": None}]}
LAST = {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}
ERROR = {"error": {"message": "gone", "type": "server_error", "code": "worker_unavailable"}}


class _Reset(httpx.AsyncByteStream):
    """Two events, then the connection breaks."""

    async def __aiter__(self):
        yield _sse(TOKEN, TOKEN)
        raise httpx.ReadError("connection reset by peer")


ANSWERS = {
    "ok-plain": (lambda: httpx.Response(200, json={"choices": [{"text": "x", "finish_reason": "stop"}],
                                                   "usage": {"completion_tokens": 1}}), False, "ok", ""),
    "ok-stream": (lambda: httpx.Response(200, content=_sse(TOKEN, LAST, b"[DONE]")), True, "ok", ""),
    "http-error": (lambda: httpx.Response(429, json=ERROR | {"error": ERROR["error"] | {"code": "rate_limit_exceeded"}},
                                          headers={"Retry-After": "2"}), False, "error", "rate_limit_exceeded"),
    "error-event": (lambda: httpx.Response(200, content=_sse(TOKEN, ERROR, b"[DONE]")), True, "error",
                    "worker_unavailable"),
    "error-event-no-done": (lambda: httpx.Response(200, content=_sse(TOKEN, ERROR)), True, "error",
                            "worker_unavailable"),
    "truncated": (lambda: httpx.Response(200, content=_sse(TOKEN, TOKEN)), True, "lost", "without [DONE]"),
    "done-without-finish": (lambda: httpx.Response(200, content=_sse(TOKEN, b"[DONE]")), True, "lost",
                            "finish_reason None"),
    "bad-event": (lambda: httpx.Response(200, content=_sse(TOKEN, b"{not json")), True, "lost", "not JSON"),
    "bad-body": (lambda: httpx.Response(200, content=b"<html>"), False, "lost", "not JSON"),
    "no-choices": (lambda: httpx.Response(200, json={"id": "x"}), False, "lost", "without choices"),
    "500-no-error-body": (lambda: httpx.Response(500, json={"detail": "boom"}), False, "lost",
                          "without an OpenAI error body"),
    "reset-mid-stream": (lambda: httpx.Response(200, stream=_Reset()), True, "lost", "reset"),
    "reset-before-answer": (None, False, "lost", "closed without a complete response"),
}


@pytest.mark.parametrize("case", list(ANSWERS))
def test_each_way_a_request_can_end_is_one_outcome(case):
    from isoserve.bench.soak_report import SoakRecord
    from isoserve.bench.soak_requests import Plan, Tenant, exchange

    make, stream, outcome, detail = ANSWERS[case]

    def handler(request):
        if make is None:
            raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
        return make()

    async def run() -> SoakRecord:
        record = SoakRecord(0, "alice", "completions", stream, 10, 4)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1") as c:
            await exchange(c, Plan(record, Tenant("alice", "k"), {"model": "m", "prompt": "p", "stream": stream}))
        return record

    record = asyncio.run(run())
    assert record.outcome == outcome, (record.outcome, record.detail)
    assert detail in (record.code if outcome == "error" else record.detail)
    if case == "http-error":
        assert record.status == 429 and record.retry_after == 2.0


def test_a_request_without_an_answer_is_hung_and_an_abort_is_an_abort():
    from isoserve.bench.soak import Soak, SoakConfig
    from isoserve.bench.soak_requests import Tenant

    async def handler(request):
        await asyncio.sleep(3600)  # a server that never answers

    async def run():
        soak = Soak(SoakConfig("http://127.0.0.1:1", [Tenant("alice", "k")], hang_after=0.3, abort_fraction=0),
                    log=lambda msg: None)
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://127.0.0.1") as c:
            hung = await soak._send(c, soak._next_plan("m"))
            plan = soak._next_plan("m")
            plan.abort_before_s = 0.05
            aborted = await soak._send(c, plan)
        return hung, aborted, soak

    hung, aborted, soak = asyncio.run(run())
    assert hung.outcome == "hung" and 0.3 <= hung.end - hung.start < 2
    assert aborted.outcome == "aborted_by_client" and aborted.end - aborted.start < 0.3
    assert soak.counts.in_flight == 0 and soak.counts.outcomes == {"hung": 1, "aborted_by_client": 1}


# ---- against a server ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("soak-tenants") / "tenants.toml"
    return path, {name: add_tenant(path, name, admin=(name == "admin")) for name in ("admin", "alice", "bob")}


@pytest.fixture(scope="module")
def server(tmp_path_factory, tenants):
    tmp = tmp_path_factory.mktemp("soak")
    model = make_tiny_llama(tmp / "llama")
    with running_server(tmp, "--model", str(model), "--dtype", "float32", "--tenants", str(tenants[0]),
                        "--context-length", str(CONTEXT), "--prefill-kv-tokens", str(POOL),
                        "--decode-kv-tokens", str(POOL), "--threads-per-worker", "1") as server:
        yield server


def soak(server, tenants, tmp_path: Path, *args: str) -> tuple[int, dict]:
    report = tmp_path / "soak.json"
    keys = tenants[1]
    status = isoserve_main(["bench", "--soak", "--base-url", server.base_url,
                            "--soak-keys", f"alice={keys['alice']},bob={keys['bob']}", "--admin-key", keys["admin"],
                            "--seed", "7", "--json", str(report), *SHAPE, *args])
    return status, json.loads(report.read_text())


def assert_accounted(report: dict) -> None:
    summary = report["summary"]
    assert summary["issued"] == len(report["requests"]) == sum(summary["outcomes"].values())
    assert summary["accounting_ok"] and not summary["unclassified"]
    assert all(r["outcome"] for r in report["requests"])


def test_short_soak_with_client_aborts_loses_nothing(server, tenants, tmp_path):
    status, report = soak(server, tenants, tmp_path, "--duration", "8", "--abort-fraction", "0.2",
                          "--hang-after", "20")
    summary, outcomes = report["summary"], report["summary"]["outcomes"]
    assert_accounted(report)
    assert outcomes["lost"] == 0 and outcomes["hung"] == 0, summary
    assert status == 0 and report["exit_status"] == 0
    assert outcomes["ok"] >= 8 and outcomes["aborted_by_client"] >= 1, summary
    requests = report["requests"]
    # The mix: both tenants, both APIs, streamed and not; aborts before the answer and mid-stream.
    assert {r["tenant"] for r in requests} == {"alice", "bob"}
    assert {(r["api"], r["stream"]) for r in requests if r["outcome"] == "ok"} == {
        ("completions", False), ("completions", True), ("chat", False), ("chat", True)}
    aborted = [r["detail"] for r in requests if r["outcome"] == "aborted_by_client"]
    assert any("before the answer" in d for d in aborted) or any("events" in d for d in aborted)
    assert summary["latency_ok_s"]["p50"] > 0 and summary["output_tok_per_s"] > 0
    assert not report["kills"] and report["probe"] is None
    # The server is still fine, and it saw the aborts as disconnects rather than errors of its own.
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_soak_with_worker_kills_then_the_probe(server, tenants, tmp_path):
    """kill -9 of a prefill or decode worker every 4 s: requests on it end with explicit errors,
    the worker comes back, and the leak probe afterwards finds nothing. Needs supervision."""
    status, report = soak(server, tenants, tmp_path, "--duration", "10", "--abort-fraction", "0.05",
                          "--kill-worker-every", "4", "--kill-roles", "prefill,decode", "--hang-after", "20",
                          "--probe-after")
    summary, outcomes = report["summary"], report["summary"]["outcomes"]
    assert_accounted(report)
    assert len(report["kills"]) == 2, (report["kills"], report["kill_skips"])
    assert {k["role"] for k in report["kills"]} <= {"prefill", "decode"}
    assert all(k["back_up_after_s"] is not None for k in report["kills"]), report["kills"]
    assert outcomes["lost"] == 0 and outcomes["hung"] == 0, (summary, summary["lost_details"])
    assert outcomes["error"] >= 1, "the kills were invisible: no request failed"
    assert report["probe"] == {**report["probe"], "findings": 0}, report["probe"]
    assert status == 0 and report["exit_status"] == 0
    # After the restarts the server serves again.
    r = httpx.post(server.base_url + "/v1/completions", timeout=30,
                   headers={"Authorization": f"Bearer {tenants[1]['alice']}"},
                   json={"model": report["soak"]["model"], "prompt": "Hello there", "max_tokens": 4})
    assert r.status_code == 200, r.text


def test_bench_http_mode_times_every_streamed_request(server, tenants, tmp_path):
    """`isoserve bench --base-url` (issue 6's load generator, on aiohttp) against the same server:
    every request of each closed-loop setting ends ok with its usage counts, and the report has
    TTFT, inter-token and TPOT percentiles from the streamed events."""
    report = tmp_path / "bench.json"
    status = isoserve_main(["bench", "--base-url", server.base_url + "/v1", "--key", tenants[1]["alice"],
                            "--concurrency", "1,3", "--num-requests", "6", "--prompt-tokens", "40",
                            "--output-tokens", "8", "--ignore-eos", "--warmup", "1", "--json", str(report)])
    assert status == 0
    data = json.loads(report.read_text())
    assert data["calibration"]["measured"]
    assert [s["concurrency"] for s in data["summaries"]] == [1, 3]
    for summary in data["summaries"]:
        assert (summary["ok"], summary["failed"], summary["failures"]) == (6, 0, {}), summary
        assert summary["total_output_tokens"] == 6 * 8
        assert abs(summary["mean_prompt_tokens"] - 40) <= 3   # the words were calibrated to tokens
        assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
        assert summary["itl_ms"]["p50"] > 0 and summary["tpot_ms"]["p50"] > 0
        assert summary["output_tokens_per_s"] > 0
    for summary, records in zip(data["summaries"], data["requests"]):
        assert [r["outcome"] for r in records] == ["ok"] * 6
        assert all(r["output_tokens"] == 8 and r["ttft_ms"] > 0 for r in records)
        # Each request on the setting's timeline: sent after it started, done before it ended.
        # (Each value is rounded to the microsecond; hence the 0.01 ms.)
        assert all(0 <= r["sent_ms"] and r["sent_ms"] + r["e2e_ms"] <= summary["duration_s"] * 1000 + 0.01
                   for r in records)
    # Closed loop at 1: each request is sent once the one before it is done.
    serial = sorted(data["requests"][0], key=lambda r: r["sent_ms"])
    assert all(b["sent_ms"] >= a["sent_ms"] + a["e2e_ms"] - 0.01 for a, b in zip(serial, serial[1:]))


def test_bench_http_mode_loads_the_server_with_sampled_requests(server, tenants, tmp_path):
    """--temperature and --top-p reach the server in every request body (seeded, so a run can be
    repeated), and the sampled requests are timed like greedy ones."""
    body = completion_body("m", "hi", 8, ignore_eos=True, temperature=0.8, seed=5, top_p=0.9)
    assert (body["temperature"], body["top_p"], body["seed"]) == (0.8, 0.9, 5)
    assert "top_p" not in completion_body("m", "hi", 8, ignore_eos=True, temperature=0.8, seed=5)
    report = tmp_path / "bench.json"
    status = isoserve_main(["bench", "--base-url", server.base_url, "--key", tenants[1]["alice"],
                            "--concurrency", "3", "--num-requests", "6", "--prompt-tokens", "40",
                            "--output-tokens", "8", "--ignore-eos", "--temperature", "1", "--top-p", "0.9",
                            "--warmup", "0", "--json", str(report)])
    assert status == 0
    data = json.loads(report.read_text())
    assert (data["workload"]["temperature"], data["workload"]["top_p"]) == (1.0, 0.9)
    (summary,) = data["summaries"]
    assert (summary["ok"], summary["failed"], summary["total_output_tokens"]) == (6, 0, 48), summary
    with pytest.raises(SystemExit, match="--top-p"):
        isoserve_main(["bench", "--base-url", server.base_url, "--top-p", "0"])
