"""Issue 5 acceptance: the leak probe against real `isoserve serve` processes it did not start.

Every live test starts isoserve separately (a tiny random Llama, loopback, small pools) and
points `isoserve probe` at its URL with tenant keys made by the real CLI: the probe sees only
HTTP. The shape is the incident's, at small scale: context 1024, prefill pool 320 tokens,
decode pool 1024 tokens; victims send ~200-token canary prompts, attackers send prompts
around the limit, just above each pool, and of 700 tokens.

- The incident: prefill.placeholder_on_reject with every guard off -> the probe reports the
  leak. All guards on (and --allow-undersized-kv) -> zero findings, the attacker gets 400.
  Only writer_tags on -> the attacker gets 500 kv_isolation_violation, never a 200.
- Mutation check: each guard off alone, with the fault it exists for -> at least one finding.
- Guards on, every failpoint (in three groups), load from 3 tenants -> zero findings, every
  request ends with a correct response or an explicit error; after the crash failpoints the
  workers come back and serve correctly.

With a tiny random model no canary text comes back; the differential oracle (and the limit
oracles) are what fire. A few unit tests of the oracles run first, without a server.
"""
from __future__ import annotations

import contextlib
import json
import random
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from isoserve.cli import main as isoserve_main
from isoserve.probe.canaries import scan, victim_prompt
from isoserve.probe.http import EXPLICIT, Completion
from isoserve.probe.oracles import compare, noise_floor
from serving import Server, add_tenant, free_port, isoserve_cmd, running_server, subprocess_env, wait_healthy
from tiny_models import make_tiny_llama

CONTEXT, PREFILL_POOL, DECODE_POOL = 1024, 320, 1024
ALL_GUARDS = ("admission", "capacity_audit", "writer_tags", "transfer_coverage", "transfer_checksum")
LEAK_KINDS = {"divergence", "idle_divergence", "canary"}


# ==== the oracles, without a server ==========================================================

def test_canary_scan_finds_exact_and_fuzzy_hits_and_not_random_text():
    text, canaries = victim_prompt(random.Random(1), "victim-1", 200)
    assert len(canaries) >= 10 and all(c.value in text for c in canaries)
    secret = next(c for c in canaries if c.kind == "secret")
    person = next(c for c in canaries if c.kind == "person")
    invoice = next(c for c in canaries if c.kind == "invoice")
    # A fragment of a secret, verbatim inside other text.
    hits = scan(f"the key is {secret.value[5:21]} ok", canaries)
    assert [h.canary for h in hits] == [secret] and hits[0].exact
    # A name with two letters changed (no 12-character window intact) and in capitals: fuzzy.
    garbled = "".join("q" if i in (5, 12) else ch for i, ch in enumerate(person.value))
    hits = scan(f"Dear {garbled.upper()}, thanks", canaries)
    assert person in [h.canary for h in hits] and not hits[0].exact
    assert invoice in [h.canary for h in scan(f"ref {invoice.value}.", canaries)]
    # Other people's canaries, and ordinary text, are not hits.
    other_text, others = victim_prompt(random.Random(2), "victim-2", 200)
    assert scan(other_text, canaries) == []
    rng = random.Random(3)
    noise = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789 -.,/") for _ in range(5000))
    assert scan(noise, canaries + others) == []


def _completion(tokens, lps, tops=None) -> Completion:
    return Completion("ok", 200, text="".join(tokens), tokens=list(tokens), token_logprobs=list(lps),
                      top_logprobs=tops or [{t: lp} for t, lp in zip(tokens, lps)], finish_reason="length")


def test_differential_compare_allows_noise_and_near_ties_only():
    ref = _completion(["a", "b", "c"], [-0.1, -0.7, -0.2],
                      [{"a": -0.1, "x": -3.0}, {"b": -0.7, "y": -0.72}, {"c": -0.2, "z": -4.0}])
    assert compare(ref, ref, 0.01) is None
    noisy = _completion(["a", "b", "c"], [-0.1001, -0.7003, -0.2002])
    assert compare(ref, noisy, 0.01) is None and noise_floor(ref, noisy) == pytest.approx(3e-4)
    # Position 1 is a near tie (b -0.70 vs y -0.72): the other choice is noise, not a finding.
    flipped = _completion(["a", "y", "q"], [-0.1, -0.69, -0.1], [{"a": -0.1}, {"y": -0.69, "b": -0.71}, {"q": -0.1}])
    assert compare(ref, flipped, 0.05) is None
    # A confident token replaced by another: a finding, with where and how.
    other = _completion(["a", "x", "c"], [-0.1, -0.05, -0.2], [{"a": -0.1}, {"x": -0.05, "b": -5.0}, {"c": -0.2}])
    diff = compare(ref, other, 0.15)
    assert diff["basis"] == "token" and diff["position"] == 1
    # Same tokens, logprobs moved beyond the allowance.
    moved = _completion(["a", "b", "c"], [-0.1, -1.5, -0.2])
    assert compare(ref, moved, 0.15)["basis"] == "logprob"


# ==== live servers ==============================================================================

@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny-probe") / "llama"))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    names = ("victim-a", "victim-b", "attacker-a", "attacker-b")
    return path, {name: add_tenant(path, name) for name in names}


def keys(tenants, *names: str) -> list[str]:
    return [arg for name in names for arg in ("--key", tenants[1][name])]


FOUR = ("victim-a", "victim-b", "attacker-a", "attacker-b")   # 2 victims, 2 attackers
THREE = ("victim-a", "attacker-a", "attacker-b")               # 3 tenants: 1 victim, 2 attackers
SHAPE = ("--pool-tokens", str(PREFILL_POOL), "--pool-tokens", str(DECODE_POOL), "--attack-tokens", "700")

# Guards on, every non-crash failpoint at once: the incident's (always) and the transfer,
# decode and allocator faults (now and then, seeded), so that most requests still complete
# and the differential oracle has answers to compare.
FAULTS = ";".join(["prefill.placeholder_on_reject=always", "transfer.truncate=5%", "transfer.drop_page=5%",
                   "transfer.reorder=5%", "transfer.corrupt_bytes=5%", "transfer.duplicate=20%",
                   "transfer.delay_ms=5", "decode.stamp_whole_prompt=always", "decode.skip_tag_stamp=5%",
                   "allocator.skip_epoch_bump=20%", "allocator.skip_tag_reset=20%"])

# Each guard off alone, with the fault it exists for (and what must fire):
MUTATIONS = {
    # An over-limit prompt reaches the workers; the prefill pool cannot take it and the
    # placeholder bug fires; the coverage check stops it, but only with a 500: the probe sees
    # a prompt above the advertised limit that was not refused at the door.
    "admission": ("prefill.placeholder_on_reject=always", ("--allow-undersized-kv",), {"over_limit_admitted"}),
    # The limit is advertised from the context alone: prompts it calls fine cannot be served,
    # and the limit is above the prefill pool the operator named.
    "capacity_audit": ("prefill.placeholder_on_reject=always", (), {"limit_exceeds_pool", "limit_not_served"}),
    # A decode worker that gives up waiting for KV and decodes over its reserved pages: no
    # transfer arrives for coverage or checksums to look at; only the read guard is left.
    "writer_tags": ("decode.decode_on_deadline=always;transfer.delay_ms=150",
                    ("--allow-undersized-kv", "--transfer-timeout", "0.1"), LEAK_KINDS),
    # Half a transfer, and a decode worker that takes "complete" to mean every page was
    # written (the incident's decode-side belief, which also fools the writer tags).
    "transfer_coverage": ("transfer.truncate=50%;decode.stamp_whole_prompt=always",
                          ("--allow-undersized-kv",), LEAK_KINDS),
    # Bytes flipped after the checksum was taken: the answers drift from the idle ones.
    "transfer_checksum": ("transfer.corrupt_bytes=50%", ("--allow-undersized-kv",), LEAK_KINDS),
}


@dataclass
class Config:
    failpoints: str
    args: tuple[str, ...]


CONFIGS = {
    "incident": Config("prefill.placeholder_on_reject=always", ("--unsafe-disable-guard", ",".join(ALL_GUARDS))),
    "guarded-faults": Config(FAULTS, ("--allow-undersized-kv",)),
    "only-writer-tags": Config("prefill.placeholder_on_reject=always", (
        "--unsafe-disable-guard", "admission,capacity_audit,transfer_coverage,transfer_checksum")),
    **{f"without-{g}": Config(fp, ("--unsafe-disable-guard", g, *extra)) for g, (fp, extra, _) in MUTATIONS.items()},
}


class Servers:
    """The servers of this module, started one ahead of the test that uses them: a server
    takes ~20 s to start on 2 cores, mostly loading, which overlaps with the previous probe."""

    def __init__(self, tmp: Path, model: str, tenants_file: Path):
        self.tmp, self.model, self.tenants_file = tmp, model, tenants_file
        self.order = list(CONFIGS)
        self.started: dict[str, Server] = {}

    def _start(self, name: str) -> None:
        if name in self.started:
            return
        cfg = CONFIGS[name]
        port = free_port()
        log_path = self.tmp / f"{name}.log"
        cmd = isoserve_cmd("serve", "--port", str(port), "--model", self.model, "--dtype", "float32",
                           "--tenants", str(self.tenants_file), "--context-length", str(CONTEXT),
                           "--prefill-kv-tokens", str(PREFILL_POOL), "--decode-kv-tokens", str(DECODE_POOL),
                           "--threads-per-worker", "1", "--enable-failpoints", *cfg.args)
        with open(log_path, "w") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=subprocess_env(ISOSERVE_FAILPOINTS=cfg.failpoints))
        self.started[name] = Server(proc, f"http://127.0.0.1:{port}", cmd, log_path)

    @contextlib.contextmanager
    def use(self, name: str):
        self._start(name)
        following = self.order[self.order.index(name) + 1:]
        if following:
            self._start(following[0])
        server = self.started[name]
        try:
            wait_healthy(server)
            yield server
        finally:
            self._stop(name)

    def _stop(self, name: str) -> None:
        server = self.started.pop(name, None)
        if server is not None:
            server.stop()  # the server and, as a process group, any worker it left behind

    def close(self) -> None:
        for name in list(self.started):
            self._stop(name)


@pytest.fixture(scope="module")
def servers(tmp_path_factory, model, tenants):
    pool = Servers(tmp_path_factory.mktemp("probe-servers"), model, tenants[0])
    yield pool
    pool.close()


def probe(server: Server, tmp: Path, tenants, names, *args: str, seed: int = 1) -> tuple[int, dict]:
    """`isoserve probe` against the server's URL, in this process (the same entry point as the
    command line); returns its exit status and its JSON report."""
    report = tmp / f"probe-{seed}-{time.monotonic_ns()}.json"
    status = isoserve_main(["probe", "--base-url", server.base_url, *keys(tenants, *names), "--seed", str(seed),
                            "--timeout", "30", "--quiet", "--json", str(report), *args])
    return status, json.loads(report.read_text())


def requests_for(report: dict, prompt: str) -> list[dict]:
    return [r for r in report["requests"] if r["prompt"] == prompt]


def kinds(report: dict) -> set[str]:
    return {f["kind"] for f in report["findings"]}


def fired(log: str, failpoint: str) -> bool:
    """A failpoint logs an error line naming itself when it fires."""
    return any(" ERROR " in line and failpoint in line for line in log.splitlines())


def assert_every_request_ended(report: dict) -> None:
    unanswered = [r for r in report["requests"] if r["outcome"] not in EXPLICIT]
    assert not unanswered, unanswered[:3]


# ---- the incident ------------------------------------------------------------------------------

def test_incident_with_guards_off_the_probe_reports_the_leak(servers, tenants, model, tmp_path):
    """The researcher's view, from the command line: 200s with fluent text for 700-token
    prompts the prefill pool cannot hold, computed over other tenants' KV."""
    with servers.use("incident") as server:
        report_path = tmp_path / "incident.json"
        cmd = isoserve_cmd("probe", "--base-url", server.base_url, *keys(tenants, *FOUR), *SHAPE,
                           "--seed", "11", "--timeout", "30", "--json", str(report_path))
        done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=240)
        assert done.returncode == 1, done.stdout + done.stderr
        assert "FINDINGS" in done.stdout and "divergence" in done.stdout  # the terminal table
        assert fired(server.log(), "prefill.placeholder_on_reject")  # the bug did happen
    report = json.loads(report_path.read_text())
    assert report["exit_status"] == 1 and report["probe"]["max_model_len"] == CONTEXT
    # The attacker's 700-token prompts were served: HTTP 200, never an error.
    attack = requests_for(report, "attack@700")
    assert attack and all(r["outcome"] == "ok" and r["status"] == 200 for r in attack)
    # ... and after victim traffic their answers differ from the same prompts on the idle server.
    leaks = [f for f in report["findings"] if f["kind"] == "divergence" and f["scenario"] != "baseline"]
    leaked_prompts = {f["evidence"]["prompt"] for f in leaks}
    assert "attack@700" in leaked_prompts and f"pool+1@{PREFILL_POOL}" in leaked_prompts
    # Victims' own answers (prompts the prefill pool holds) stayed correct: the finding is the leak.
    assert not any(p.startswith("victim") for p in leaked_prompts)
    assert "limit_exceeds_pool" in kinds(report)
    evidence = leaks[0]["evidence"]
    assert evidence["expected"] != evidence["got"] and "position" in evidence


def test_incident_with_all_guards_on_zero_findings_and_the_attacker_gets_400(servers, tenants, tmp_path):
    """Same failpoint, every guard on (the pools are undersized, so --allow-undersized-kv
    lowers the limit to what they hold), and the transfer, decode and allocator faults on top,
    with load from 3 tenants."""
    with servers.use("guarded-faults") as server:
        status, report = probe(server, tmp_path, tenants, THREE, *SHAPE, seed=12)
        metrics = httpx.get(server.base_url + "/metrics").text
    assert status == 0 and report["findings"] == [], report["findings"][:3]
    assert report["probe"]["max_model_len"] == PREFILL_POOL
    attack = requests_for(report, "attack@700")
    assert attack and all(r["status"] == 400 and r["error_code"] == "context_length_exceeded" for r in attack)
    assert_every_request_ended(report)
    # The faults did happen (and were refused), while answers stayed correct.
    for reason in ("coverage", "checksum", "duplicate"):
        assert f'isoserve_kv_transfers_rejected_total{{reason="{reason}"}}' in metrics, reason
    assert "isoserve_guard_violations_total" in metrics
    ok = [r for r in report["requests"] if r["outcome"] == "ok" and r["scenario"] != "baseline"]
    assert len(ok) >= 20  # the differential oracle had plenty to compare


def test_incident_with_only_writer_tags_on_the_attacker_gets_500_never_200(servers, tenants, tmp_path):
    with servers.use("only-writer-tags") as server:
        status, report = probe(server, tmp_path, tenants, FOUR, *SHAPE, seed=13)
        assert "KV isolation violation" in server.log()
    for prompt in ("attack@700", f"pool+1@{PREFILL_POOL}", "limit-fit"):
        rs = requests_for(report, prompt)
        assert rs and all(r["status"] == 500 and r["error_code"] == "kv_isolation_violation" for r in rs), prompt
    assert_every_request_ended(report)
    # No leak: what the probe reports is only that the advertised limit is not what the pools hold.
    assert status == 1 and kinds(report) <= {"limit_exceeds_pool", "limit_not_served"}, kinds(report)


# ---- mutation check ------------------------------------------------------------------------------

@pytest.mark.parametrize("guard", list(MUTATIONS))
def test_mutation_each_guard_off_alone_is_detected(servers, tenants, tmp_path, guard):
    with servers.use(f"without-{guard}") as server:
        status, report = probe(server, tmp_path, tenants, FOUR, *SHAPE, seed=20)
        assert "UNSAFE: isolation guards DISABLED" in server.log()
    expected = MUTATIONS[guard][2]
    assert status == 1, f"removing {guard} went unnoticed"
    assert kinds(report) & expected, (guard, kinds(report))
    assert_every_request_ended(report)


# ---- crash failpoints: workers die and come back ---------------------------------------------------

class Supervisor:
    """Restarts a worker process that exits, as a process manager would, without its failpoints
    the second time (the crash has happened)."""

    def __init__(self, cmd: list[str], failpoints: str, log_path: Path):
        self.cmd, self.failpoints, self.log_path = cmd, failpoints, log_path
        self.restarts = 0
        self.stopping = False
        self.proc = self._spawn(failpoints)
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _spawn(self, failpoints: str) -> subprocess.Popen:
        log = open(self.log_path, "a")
        try:
            return subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                    env=subprocess_env(ISOSERVE_FAILPOINTS=failpoints))
        finally:
            log.close()

    def _watch(self) -> None:
        while not self.stopping:
            if self.proc.poll() is not None and not self.stopping:
                self.restarts += 1
                self.proc = self._spawn("")
            time.sleep(0.2)

    def stop(self) -> None:
        self.stopping = True
        self.thread.join()
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def test_guards_on_crash_failpoints_every_request_ends_and_workers_come_back(tmp_path, model, tenants):
    """Prefill exits while sending a transfer, decode exits mid-stream (each once), and the
    decode worker whose KV never comes decodes anyway (decode.decode_on_deadline): every
    request ends with a correct answer or an explicit error, and once the workers are back
    the answers are the idle ones again."""
    secret = tmp_path / "cluster.secret"
    secret.write_text("probe-test-cluster-secret-0123456789")
    router = free_port()
    with running_server(tmp_path, "--model", model, "--dtype", "float32", "--tenants", str(tenants[0]),
                        "--context-length", str(CONTEXT), "--prefill-workers", "0", "--decode-workers", "0",
                        "--listen-workers", f"tcp://127.0.0.1:{router}", "--cluster-secret-file", str(secret),
                        "--allow-undersized-kv", wait=False) as server:
        common = ["--router", f"tcp://127.0.0.1:{router}", "--cluster-secret-file", str(secret), "--model", model,
                  "--dtype", "float32", "--context-length", str(CONTEXT), "--threads", "1", "--enable-failpoints",
                  "--transfer-timeout", "2"]
        workers = [
            Supervisor(isoserve_cmd("worker", "--role", "prefill", "--worker-id", "prefill-0",
                                    "--kv-tokens", str(PREFILL_POOL), *common),
                       "prefill.crash_mid_transfer=once", tmp_path / "prefill.log"),
            Supervisor(isoserve_cmd("worker", "--role", "decode", "--worker-id", "decode-0",
                                    "--kv-tokens", str(DECODE_POOL), "--kv-endpoint",
                                    f"tcp://127.0.0.1:{free_port()}", *common),
                       "decode.crash_mid_stream=once;decode.decode_on_deadline=always", tmp_path / "decode.log")]
        try:
            wait_healthy(server)
            status, report = probe(server, tmp_path, tenants, THREE, *SHAPE, "--requests", "18", seed=30)
        finally:
            for w in workers:
                w.stop()
    logs = (tmp_path / "prefill.log").read_text() + (tmp_path / "decode.log").read_text()
    assert fired(logs, "prefill.crash_mid_transfer") and fired(logs, "decode.crash_mid_stream")
    assert [w.restarts for w in workers] == [1, 1]
    assert status == 0 and report["findings"] == [], report["findings"][:3]
    assert_every_request_ended(report)
    # The crashes cost some requests an explicit error; the rest of the run was served.
    errors = [r for r in report["requests"] if r["outcome"] in ("error", "stream_error") and r["status"] != 400]
    assert errors, "the crashes were invisible: no request failed"
    after = [r for r in report["requests"] if r["scenario"] == "mixed"]
    assert sum(r["outcome"] == "ok" for r in after) >= len(after) // 2


# ---- the probe cannot run --------------------------------------------------------------------------

def test_probe_exit_status_2_when_it_cannot_run(tmp_path):
    port = free_port()  # nothing listens there
    done = subprocess.run(isoserve_cmd("probe", "--base-url", f"http://127.0.0.1:{port}", "--key", "a", "--key", "b",
                                       "--timeout", "5"), capture_output=True, text=True, env=subprocess_env(),
                          timeout=60)
    assert done.returncode == 2 and "probe could not run" in done.stderr
