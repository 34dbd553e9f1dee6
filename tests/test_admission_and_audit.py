"""Issue 4 acceptance, the one limit and the capacity audit, on real processes.

- The router answers a prompt of limit+1 tokens with 400 `context_length_exceeded` and serves
  one of exactly the limit; `/v1/models` advertises the limit.
- Sent straight to a worker (the test plays the router over zmq), the same prompt is rejected
  by the worker itself: no engine step runs, no page is held, no KV is sent.
- A prefill pool below the context: `serve` exits 2 after printing the audit table,
  `check-config` exits 2 (0 for a good sizing), and with `--allow-undersized-kv` the advertised
  limit drops to what the pool holds, and the limit the router states is the one every worker
  honours: a prompt at it is served whole, one over it gets 400.
- A prompt the engine itself refuses (ids outside the vocabulary) ends that request and leaves
  the worker serving.
"""
from __future__ import annotations

import random
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
import zmq

from isoserve import LLM, SamplingParams
from isoserve.disagg.wire import Signer
from serving import add_tenant, free_port, isoserve_cmd, running_server, subprocess_env
from tiny_models import HAS_AMX, HAS_AVX512_VNNI

CONTEXT = 512   # --context-length of every process here: small, so long prompts stay cheap
DEFAULT_POOL = 2 * CONTEXT  # what a worker allocates when no pool size is given
SECRET = "test-cluster-secret-0123456789abcdef"


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    """n ordinary (non-special) token ids of SmolLM2's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> tuple[Path, str]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    return path, add_tenant(path, "alice")


@pytest.fixture(scope="module")
def reference(model) -> LLM:
    return LLM(model=model, dtype="float32", context_length=CONTEXT, kv_tokens=DEFAULT_POOL)


@pytest.fixture(scope="module")
def server(tmp_path_factory, model, tenants):
    tmp = tmp_path_factory.mktemp("serve")
    with running_server(tmp, "--model", model, "--dtype", "float32", "--context-length", str(CONTEXT),
                        "--tenants", str(tenants[0])) as s:
        yield s


def complete(base_url: str, key: str, model: str, prompt: list[int], max_tokens: int,
             stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {key}"})


def solo_text(reference: LLM, prompt: list[int], max_tokens: int) -> str:
    result = reference.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                         ignore_eos=True))[0]
    assert result.finish_reason == "length"
    return result.text


def assert_context_length_exceeded(r: httpx.Response, prompt_len: int, limit: int) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["type"] == "invalid_request_error"
    # The message states both numbers: the prompt's length and the limit it is over.
    numbers = {int(n) for n in re.findall(r"\d+", error["message"])}
    assert {prompt_len, limit} <= numbers, error["message"]


def max_model_len(base_url: str, key: str) -> int:
    r = httpx.get(base_url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 200, r.text
    (card,) = r.json()["data"]
    return card["max_model_len"]


# ---- the router -----------------------------------------------------------------------------

def test_router_rejects_limit_plus_one_and_serves_the_limit(server, tenants, model, reference):
    key = tenants[1]
    assert max_model_len(server.base_url, key) == CONTEXT
    for max_tokens in (1, 6):
        limit = CONTEXT - max_tokens  # pools hold 2 x context: the context is what binds
        over = prompt_ids(limit + 1, seed=max_tokens)
        assert_context_length_exceeded(complete(server.base_url, key, model, over, max_tokens),
                                       limit + 1, limit)
        # Streamed, it is the same 400 before any event, not a 200 stream with an error in it.
        assert_context_length_exceeded(complete(server.base_url, key, model, over, max_tokens, stream=True),
                                       limit + 1, limit)
        at_limit = over[:limit]
        r = complete(server.base_url, key, model, at_limit, max_tokens)
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {"prompt_tokens": limit, "completion_tokens": max_tokens,
                                     "total_tokens": CONTEXT}
        assert r.json()["choices"][0]["text"] == solo_text(reference, at_limit, max_tokens)


# ---- a worker on its own: the test is the router --------------------------------------------

class FakeRouter:
    """A ROUTER socket on tcp loopback that speaks the router's signed protocol."""

    def __init__(self, secret: bytes):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.signer = Signer(secret, "router")
        self.heartbeats: dict[str, dict] = {}   # worker -> its latest heartbeat body
        self.received: list[tuple[str, object]] = []  # every non-heartbeat message, in order
        self._unmatched: list = []  # received, not yet returned by wait_for

    def send(self, worker: str, kind: str, body: dict) -> None:
        self.sock.send_multipart([worker.encode(), *self.signer.pack(kind, body)])

    def _receive(self, timeout: float):
        if not self.sock.poll(int(timeout * 1000)):
            return None
        identity, *frames = self.sock.recv_multipart()
        msg = self.signer.unpack(frames)
        assert msg.sender == identity.decode()
        if msg.kind == "heartbeat":
            self.heartbeats[msg.sender] = msg.body
        else:
            self.received.append((msg.sender, msg))
            self._unmatched.append(msg)
        return msg

    def wait_for(self, what: str, predicate, timeout: float = 60):
        """The first message, received earlier or now, that matches (heartbeats: only new ones)."""
        for msg in self._unmatched:
            if predicate(msg):
                self._unmatched.remove(msg)
                return msg
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._receive(deadline - time.monotonic())
            if msg is not None and predicate(msg):
                if msg in self._unmatched:
                    self._unmatched.remove(msg)
                return msg
        raise TimeoutError(f"no {what} within {timeout} s; got {[(s, m.kind, m.body) for s, m in self.received]}")

    def next_heartbeat(self, worker: str, timeout: float = 10) -> dict:
        """A heartbeat sent after everything the worker sent before it (zmq keeps order)."""
        msg = self.wait_for(f"heartbeat from {worker}",
                            lambda m: m.kind == "heartbeat" and m.sender == worker, timeout)
        return msg.body

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _outputs_for(rid: str):
    return lambda m: m.kind == "outputs" and any(o["request_id"] == rid for o in m.body["outputs"])


def test_worker_rejects_over_limit_prompt_on_receipt_without_computing_or_sending_kv(
        tmp_path, model, reference):
    secret_file = tmp_path / "cluster.secret"
    secret_file.write_text(SECRET)
    router = FakeRouter(SECRET.encode())
    kv_endpoint = f"tcp://127.0.0.1:{free_port()}"
    procs, logs = {}, []
    try:
        for role, extra in (("prefill", []), ("decode", ["--kv-endpoint", kv_endpoint])):
            log = open(tmp_path / f"{role}.log", "w")
            logs.append(log)
            procs[role] = subprocess.Popen(
                isoserve_cmd("worker", "--role", role, "--router", router.endpoint,
                             "--cluster-secret-file", str(secret_file), "--worker-id", f"{role}-direct",
                             "--model", model, "--dtype", "float32", "--context-length", str(CONTEXT),
                             "--threads", "1", *extra),
                stdout=log, stderr=subprocess.STDOUT, env=subprocess_env())
        for role in procs:
            reg = router.wait_for(f"register from {role}", lambda m, r=role: m.kind == "register"
                                  and m.body["worker_id"] == f"{r}-direct")
            assert reg.body["pool_tokens"] == DEFAULT_POOL and reg.body["context_length"] == CONTEXT
            router.send(f"{role}-direct", "registered", {})
        prefill, decode = "prefill-direct", "decode-direct"
        before = {w: router.next_heartbeat(w) for w in (prefill, decode)}

        max_tokens = 4
        limit = CONTEXT - max_tokens
        over = prompt_ids(limit + 1, seed=7)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True).to_dict()

        # Decode first, as the router would: it must refuse to reserve pages for it.
        router.send(decode, "reserve", {"request_id": "over-d", "tenant": "t", "prompt_token_ids": over,
                                        "params": params})
        reply = router.wait_for("decode's answer", _outputs_for("over-d"))
        # Prefill, as a router that skipped its own check would: it must refuse to compute it.
        router.send(prefill, "prefill", {"request_id": "over-p", "tenant": "t", "prompt_token_ids": over,
                                         "params": params, "decode_endpoint": kv_endpoint})
        reply_p = router.wait_for("prefill's answer", _outputs_for("over-p"))
        for msg, rid in ((reply, "over-d"), (reply_p, "over-p")):
            (out,) = msg.body["outputs"]
            assert out["request_id"] == rid and out["finished"] and out["finish_reason"] == "error"
            assert out["token_ids"] == [] and out["output_tokens"] == 0
            assert out["error"]["code"] == "context_length_exceeded"
            assert {limit + 1, limit} <= {int(n) for n in re.findall(r"\d+", out["error"]["message"])}
        after = {w: router.next_heartbeat(w) for w in (prefill, decode)}
        assert not any(m.kind == "reserved" for _, m in router.received)
        for w in (prefill, decode):
            counters = after[w]["counters"]
            assert counters.get("steps", 0) == before[w]["counters"].get("steps", 0), counters
            assert "transfers_sent" not in counters, counters
            assert after[w]["pages_used"] == 0 and after[w]["running"] == after[w]["waiting"] == 0

        # A prompt the engine itself refuses (ids outside the vocabulary) also ends at once, and
        # the worker lives on.
        router.send(decode, "reserve", {"request_id": "bad-ids", "tenant": "t", "params": params,
                                        "prompt_token_ids": [5, 10**6, 7]})
        (out,) = router.wait_for("decode's answer", _outputs_for("bad-ids")).body["outputs"]
        assert out["finish_reason"] == "error" and out["error"]["code"] == "invalid_request"

        # The same route with a prompt of exactly the limit IS computed, sent and decoded.
        ok = over[:limit]
        router.send(decode, "reserve", {"request_id": "ok", "tenant": "t", "prompt_token_ids": ok,
                                        "params": params})
        router.wait_for("reserved", lambda m: m.kind == "reserved" and m.body["request_id"] == "ok")
        router.send(prefill, "prefill", {"request_id": "ok", "tenant": "t", "prompt_token_ids": ok,
                                         "params": params, "decode_endpoint": kv_endpoint})
        tokens, finished = [], False
        while not finished:
            msg = router.wait_for("decode's tokens", _outputs_for("ok"))
            assert msg.sender == decode
            for out in (o for o in msg.body["outputs"] if o["request_id"] == "ok"):
                assert out["error"] is None and not finished, out
                tokens += out["token_ids"]
                finished = out["finished"]
        assert out["finish_reason"] == "length"
        want = reference.generate([ok], SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True))[0].token_ids
        assert tokens == want
        counters = router.next_heartbeat(prefill)["counters"]
        assert counters.get("steps", 0) > before[prefill]["counters"].get("steps", 0)
        assert counters["transfers_sent"] == 1
        assert router.next_heartbeat(decode)["counters"].get("steps", 0) > 0
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for log in logs:
            log.close()
        router.close()


# ---- the capacity audit ---------------------------------------------------------------------

UNDERSIZED = ["--context-length", str(CONTEXT), "--prefill-kv-tokens", str(CONTEXT // 2)]


def test_serve_exits_2_with_the_audit_table_when_a_pool_is_below_the_context(tmp_path, model, tenants):
    with running_server(tmp_path, "--model", model, "--dtype", "float32", "--tenants", str(tenants[0]),
                        *UNDERSIZED, wait=False) as s:
        assert s.proc.wait(timeout=120) == 2, s.log()[-3000:]
        log = s.log()
    lines = log.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["group", "worker"])
    assert re.match(r"group\s+worker\s+pool tokens\s+context\s+ratio", lines[header])
    rows = {line.split()[0]: line.split() for line in lines[header + 1:header + 3]}
    assert rows["prefill"][1:5] == ["prefill-0", str(CONTEXT // 2), str(CONTEXT), "0.50"]
    assert "REFUSED" in rows["prefill"][5]
    assert rows["decode"][1:6] == ["decode-0", str(DEFAULT_POOL), str(CONTEXT), "2.00", "ok"]
    assert "capacity audit FAILED" in log
    assert "Call it:" not in log  # it never started the HTTP server


@pytest.mark.parametrize("command", ["serve", "check-config", "worker"])
def test_an_unknown_model_exits_1_with_one_line_before_any_worker_starts(tmp_path, command):
    missing = tmp_path / "missing"
    args = {"serve": ["--port", str(free_port()), "--tenants", str(tmp_path / "tenants.toml")], "check-config": [],
            "worker": ["--role", "prefill", "--router", f"tcp://127.0.0.1:{free_port()}"]}[command]
    done = subprocess.run(isoserve_cmd(command, "--model", str(missing), *args), env=subprocess_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"{command}: cannot load model '{missing}': unknown model '{missing}': expected 'smollm2-135m-instruct', "
        "a .gguf file, or a Hugging Face checkpoint folder with config.json and *.safetensors"]
    assert "worker(s)" not in done.stdout + done.stderr and "registering" not in done.stdout + done.stderr
    assert not (tmp_path / "tenants.toml").exists()  # serve stopped before anything else


CHECKS = {  # sizing -> expected exit status of check-config
    "prefill-tokens-below-context": (UNDERSIZED, 2),
    # A memory budget too small for the context: 0.0001 GiB is 13 pages of 512 B/token here.
    "decode-memory-below-context": (["--context-length", str(CONTEXT), "--decode-kv-memory-gb", "0.0001"], 2),
    "fits": (["--context-length", str(CONTEXT), "--prefill-kv-tokens", str(CONTEXT),
              "--decode-kv-tokens", str(2 * CONTEXT), "--min-kv-headroom", "1.0"], 0),
}


def test_check_config_exits_0_or_2_without_serving(model):
    procs = {name: subprocess.Popen(isoserve_cmd("check-config", "--model", model, "--dtype", "float32",
                                                 *sizing), env=subprocess_env(), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, (sizing, _) in CHECKS.items()}  # at once: each mostly waits on imports
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        status = CHECKS[name][1]
        assert proc.returncode == status, (name, out, err)
        assert re.search(r"group\s+worker\s+pool tokens\s+context\s+ratio", out), (name, out)
        assert ("REFUSED" in out) == (status == 2), (name, out)


def test_allow_undersized_kv_lowers_and_enforces_the_advertised_limit(tmp_path, model, tenants, reference):
    key = tenants[1]
    with running_server(tmp_path, "--model", model, "--dtype", "float32", "--tenants", str(tenants[0]),
                        *UNDERSIZED, "--allow-undersized-kv") as s:
        pool = CONTEXT // 2
        assert max_model_len(s.base_url, key) == pool
        max_tokens = 4
        over = prompt_ids(pool + 1, seed=11)  # fits the context (512 - 4), not the prefill pool
        r = complete(s.base_url, key, model, over, max_tokens)
        assert r.status_code == 400, r.text
        limit = int(re.search(r"allows a prompt of (\d+) tokens", r.json()["error"]["message"])[1])
        assert pool - max_tokens <= limit <= pool
        assert_context_length_exceeded(r, pool + 1, limit)
        # The limit the router states is the one every worker honours: a prompt of exactly that
        # length is computed and decoded whole, one more token is refused by the router.
        r = complete(s.base_url, key, model, over[:limit], max_tokens)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == limit
        assert r.json()["choices"][0]["text"] == solo_text(reference, over[:limit], max_tokens)
        assert_context_length_exceeded(complete(s.base_url, key, model, over[:limit + 1], max_tokens),
                                       limit + 1, limit)


def test_router_exports_worker_counters_by_their_growth():
    """Heartbeats carry cumulative counters, some of them bytes: the router adds each one's growth
    in one step (it once counted byte counters one by one, two-thirds of its core under load)."""
    from isoserve.server.metrics import Metrics
    from isoserve.server.router import Router, RouterSettings, WorkerInfo

    metrics = Metrics()
    router = Router(RouterSettings("m", 8192, 16, "float32"), b"s" * 32, "ipc:///nonexistent", None, metrics)
    try:
        worker = WorkerInfo("decode-0", "decode", 1, "vm", 1024, 64, 16, 8192, "ipc:///kv")
        pages = {"pages_total": 64, "pages_used": 0, "pages_free": 64}
        for counters in ({"rejected_transfers_checksum": 2, "transfer_bytes_sent": 3 * 10**9},
                         {"rejected_transfers_checksum": 5, "transfer_bytes_sent": 9 * 10**9,
                          "guard_violations": 1}):
            router._on_heartbeat(worker, {**pages, "counters": counters})
        sample = metrics.registry.get_sample_value
        assert sample("isoserve_kv_transfers_rejected_total", {"reason": "checksum"}) == 5
        assert sample("isoserve_guard_violations_total", {"worker": "decode-0", "guard": "writer_tags"}) == 1
    finally:
        router.sock.close(0)
        router.ctx.term()


def test_router_refuses_a_worker_whose_kv_cache_has_another_dtype():
    """A worker started by hand with another --kv-dtype would have every transfer refused one by
    one: the router refuses it once, at registration, and it never gets traffic."""
    from isoserve.server.metrics import Metrics
    from isoserve.server.router import Router, RouterSettings

    router = Router(RouterSettings("m", 8192, 16, "bfloat16"), b"s" * 32, "ipc:///nonexistent", None,
                    Metrics())
    try:
        hello = {"role": "decode", "pid": 1, "host": "vm", "model": "m", "page_size": 16, "pool_tokens": 16384,
                 "pool_pages": 1024, "context_length": 8192, "kv_endpoint": "ipc:///kv"}
        for worker, kv_dtype in (("decode-0", "float32"), ("decode-1", None), ("decode-2", "bfloat16")):
            body = {**hello, "worker_id": worker, **({"kv_dtype": kv_dtype} if kv_dtype else {})}
            router._register(worker, body)
        states = {w: (i.state, i.refusal) for w, i in router.workers.items()}
        assert states["decode-0"] == ("refused", "keeps its KV cache in float32, the cluster's is bfloat16")
        assert states["decode-1"][0] == "refused"
        assert states["decode-2"] == ("up", "")
    finally:
        router.sock.close(0)
        router.ctx.term()


def test_serve_passes_prefill_max_num_seqs_to_prefill_workers_only():
    from isoserve.cli import build_parser
    from isoserve.server.launcher import _worker_command

    def parse(*argv):
        args = build_parser().parse_args(["serve", *argv])
        args.disabled_guards = frozenset()  # as cli.main sets it from --unsafe-disable-guard
        return args

    def flag(cmd, name):
        return cmd[cmd.index(name) + 1]

    args = parse("--max-num-seqs", "48", "--prefill-max-num-seqs", "4", "--no-fused-kernels")
    prefill = _worker_command(args, "prefill", 0, "ipc:///r", "ipc:///kv", 1)
    decode = _worker_command(args, "decode", 0, "ipc:///r", "ipc:///kv", 1)
    assert flag(prefill, "--max-num-seqs") == "4" and flag(decode, "--max-num-seqs") == "48"
    assert "--no-fused-kernels" in prefill and "--no-fused-kernels" in decode
    default = parse("--max-num-seqs", "48")
    assert flag(_worker_command(default, "prefill", 0, "ipc:///r", "ipc:///kv", 1), "--max-num-seqs") == "48"
    # int8 activations: each worker takes its own default unless told, and parses what it is told.
    for argv, want in [((), None), (("--int8-activations",), True), (("--no-int8-activations",), False)]:
        for role in ("prefill", "decode"):
            cmd = _worker_command(parse(*argv), role, 0, "ipc:///r", "ipc:///kv", 1)
            assert build_parser().parse_args(cmd[cmd.index("worker"):]).int8_activations is want
    # A prefill worker's step budget and burst gather (disagg/bursts.py): its own flags, parsed
    # back by the worker's command line; decode keeps --max-batched-tokens and gathers nothing.
    for argv, want in [((), ("4096", "20.0")), (("--max-batched-tokens", "8192"), ("8192", "20.0")),
                       (("--prefill-max-batched-tokens", "1024", "--prefill-gather-ms", "0"), ("1024", "0.0"))]:
        args = parse(*argv)
        prefill = _worker_command(args, "prefill", 0, "ipc:///r", "ipc:///kv", 1)
        decode = _worker_command(args, "decode", 0, "ipc:///r", "ipc:///kv", 1)
        assert (flag(prefill, "--max-batched-tokens"), flag(prefill, "--prefill-gather-ms")) == want
        assert flag(decode, "--max-batched-tokens") == str(args.max_batched_tokens)
        assert "--prefill-gather-ms" not in decode
        worker_args = build_parser().parse_args(prefill[prefill.index("worker"):])
        assert (worker_args.max_batched_tokens, worker_args.prefill_gather_ms) == (int(want[0]), float(want[1]))
    # Sharing the host's cores: the worker gets the share file and its own slot, which its own
    # command line parses back to the same pair.
    shared = _worker_command(default, "decode", 0, "ipc:///r", "ipc:///kv", 1, ("/run/cores.share", 1))
    assert flag(shared, "--core-share-file") == "/run/cores.share" and flag(shared, "--core-share-slot") == "1"
    worker_args = build_parser().parse_args(shared[shared.index("worker"):])
    assert (worker_args.core_share_file, worker_args.core_share_slot) == ("/run/cores.share", 1)
    assert flag(shared, "--core-sharing") == "split" == worker_args.core_sharing  # the default
    turns = parse("--core-sharing", "turns")
    assert flag(_worker_command(turns, "decode", 0, "ipc:///r", "ipc:///kv", 1, ("/run/cores.share", 1)),
                "--core-sharing") == "turns"
    assert "--core-share-file" not in _worker_command(default, "decode", 0, "ipc:///r", "ipc:///kv", 1)


def test_serve_decides_dtype_auto_once_by_the_cpu_and_the_model_and_starts_workers_with_it():
    # bfloat16 only where oneDNN computes in it (AVX-512 BW/VL/DQ or AVX-NE-CONVERT): elsewhere
    # oneDNN refuses to prepack a bfloat16 weight and torch widens it on every call. And there,
    # on a CPU without AMX whose int8 kernels have AVX512-VNNI, float32 for the default model (a
    # GGUF of Q4_1 projections): its int8 block kernels beat bfloat16 there. Not when the run
    # may not take them.
    from isoserve.cli import build_parser, decide_dtype
    from isoserve.server.launcher import _worker_command

    native = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    int8 = HAS_AVX512_VNNI and not HAS_AMX
    args = build_parser().parse_args(["serve"])
    assert args.dtype == "auto"
    args.disabled_guards = frozenset()
    decide_dtype(args)
    assert args.dtype == ("bfloat16" if native and not int8 else "float32")
    for role in ("prefill", "decode"):
        cmd = _worker_command(args, role, 0, "ipc:///r", "ipc:///kv", 1)
        assert cmd[cmd.index("--dtype") + 1] == args.dtype
    serve_dtype = args.dtype
    for without_int8 in (["--no-fused-kernels"], ["--no-int8-activations"], ["--int4-max-rows", "0"],
                         ["--int4-max-rows", "64"]):  # above 64 rows: dense float32, slower than bfloat16
        args = build_parser().parse_args(["serve", *without_int8])
        decide_dtype(args)
        assert args.dtype == ("bfloat16" if native else "float32"), without_int8
    offline = build_parser().parse_args(["bench", "--offline"])  # --model unset: the default model
    decide_dtype(offline)
    assert offline.dtype == serve_dtype
    over_http = build_parser().parse_args(["bench", "--base-url", "http://127.0.0.1:1"])
    decide_dtype(over_http)
    assert over_http.dtype == "auto"  # no engine runs here: nothing is decided, nothing loaded
    chosen = build_parser().parse_args(["serve", "--dtype", "bfloat16"])
    decide_dtype(chosen)
    assert chosen.dtype == "bfloat16"  # asked for by name: kept, and served on any CPU (F.linear)


def test_serve_decides_the_kv_dtype_once_and_sizes_and_starts_workers_with_it():
    """--kv-dtype auto is the model's dtype, but bfloat16 where --dtype auto fell back to float32
    (the checkpoint is bfloat16; float32 only runs it faster there); a float32 model asked for
    by name keeps float32 KV. The router plans each pool in that dtype (a memory budget holds
    twice the tokens in bfloat16) and passes it to every worker; a pair no kernel reads is
    refused before anything starts."""
    from isoserve.cli import build_parser, decide_dtype
    from isoserve.model.config import ModelConfig
    from isoserve.server.launcher import _planned_pools, _worker_command

    # (): bfloat16 KV on either CPU, under a bfloat16 model or a float32 one that fell back
    cases = {(): "bfloat16", ("--dtype", "float32"): "float32", ("--dtype", "bfloat16"): "bfloat16",
             ("--dtype", "float32", "--kv-dtype", "bfloat16"): "bfloat16",
             ("--kv-dtype", "fp8"): "float8_e4m3fn", ("--dtype", "float32", "--kv-dtype", "float8_e4m3fn"): "float8_e4m3fn"}
    for flags, kv_dtype in cases.items():
        args = build_parser().parse_args(["serve", *flags])
        args.disabled_guards = frozenset()
        decide_dtype(args)
        assert args.kv_dtype == kv_dtype, flags
        for role in ("prefill", "decode"):
            cmd = _worker_command(args, role, 0, "ipc:///r", "ipc:///kv", 1)
            assert cmd[cmd.index("--kv-dtype") + 1] == kv_dtype
    config = ModelConfig(architecture="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
                         num_layers=2, num_heads=2, num_kv_heads=1, head_dim=4, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=True)
    planned = {}
    for kv_dtype in ("float32", "bfloat16"):
        args = build_parser().parse_args(["serve", "--dtype", "float32", "--kv-dtype", kv_dtype,
                                          "--prefill-kv-memory-gb", "0.001", "--decode-kv-memory-gb", "0.001"])
        args.disabled_guards = frozenset()
        decide_dtype(args)
        planned[kv_dtype] = dict(_planned_pools(args, config, 256))
    wide, narrow = planned["float32"]["decode"], planned["bfloat16"]["decode"]
    assert wide > 0 and narrow in (2 * wide, 2 * wide + args.page_size)  # whole pages of each
    for flags in (("--dtype", "bfloat16", "--kv-dtype", "float32"), ("--dtype", "float32", "--kv-dtype", "float16")):
        args = build_parser().parse_args(["serve", *flags])
        with pytest.raises(SystemExit, match="cannot keep its KV cache in"):
            decide_dtype(args)
