"""Issue 3 acceptance: the real multi-process server (router, prefill and decode workers) with
the official openai client, over real sockets, on a tiny random Llama."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
import torch
import zmq

from isoserve import LLM, SamplingParams
from serving import add_tenant, isoserve_cmd, running_server, subprocess_env, free_port, Server, wait_healthy
from tiny_models import make_tiny_llama

PROMPTS = ["The invoice is due on", "def parse(path):\n    return", "Alice and Bob met in",
           "1, 2, 3, 5, 8,", "Bonjour, je m'appelle"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama"))


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    keys = {name: add_tenant(path, name, admin=(name == "admin")) for name in ("admin", "alice", "bob", "carol")}
    return path, keys


@pytest.fixture(scope="module")
def secret_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("secret") / "cluster.secret"
    path.write_text("test-cluster-secret-0123456789abcdef")
    return path


@pytest.fixture(scope="module")
def disagg(tmp_path_factory, model, tenants, secret_file):
    tmp = tmp_path_factory.mktemp("disagg")
    # Its workers share the cores by turns; the servers of the other test files split them
    # (the default), so both policies serve every kind of request the suite sends.
    with running_server(tmp, "--model", model, "--dtype", "float32", "--tenants", str(tenants[0]),
                        "--prefill-kv-tokens", "4096", "--decode-kv-tokens", "4096",
                        "--core-sharing", "turns",
                        "--cluster-secret-file", str(secret_file)) as server:
        yield server


@pytest.fixture(scope="module")
def reference(model):
    return LLM(model=model, dtype="float32", kv_tokens=4096)


def client(server: Server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def greedy_reference(reference: LLM, prompt: str, n: int = 24) -> list[int]:
    return reference.generate(prompt, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


def completion_ids(server, key, model, prompt, n=24) -> list[int]:
    """Token ids of a greedy completion, read back from logprobs=0 token strings is lossy, so we
    compare texts with the reference's decoded text instead."""
    r = client(server, key).completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                               extra_body={"ignore_eos": True})
    return r.choices[0].text


def test_openai_client_completions_chat_stream_and_logprobs(disagg, tenants, model, reference):
    c = client(disagg, tenants[1]["alice"])
    for prompt in PROMPTS:
        want = reference.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                         logprobs=2))[0]
        r = c.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=2,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == want.text
        assert r.usage.completion_tokens == 24
        got_lp = r.choices[0].logprobs.token_logprobs
        assert got_lp == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        streamed = "".join(ch.choices[0].text for ch in c.completions.create(
            model=model, prompt=prompt, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True}) if ch.choices)
        assert streamed == want.text
    messages = [{"role": "user", "content": "Write the invoice summary."}]
    want = reference.chat(messages, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=3))
    r = c.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                  logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want.text
    assert [t.logprob for t in r.choices[0].logprobs.content] == pytest.approx(
        [lp.logprob for lp in want.logprobs], abs=1e-4)
    assert all(len(t.top_logprobs) == 3 for t in r.choices[0].logprobs.content)
    chunks = list(c.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want.text


@pytest.mark.parametrize("kv_dtype, pool_dtype, value_bytes", [("bfloat16", "bfloat16", 2),
                                                                 ("fp8", "float8_e4m3fn", 1)])
def test_a_narrow_kv_cache_under_float32_serves_what_llm_generate_gives(tmp_path, tenants, model, kv_dtype,
                                                                        pool_dtype, value_bytes):
    """--dtype float32 with --kv-dtype bfloat16 or fp8, disaggregated: each prompt's KV is
    written in the pool's dtype on the prefill worker, crosses as those bytes (half or a quarter
    of a float32 page's) and is read by the decode worker, and every tenant gets what
    LLM.generate with such a pool gives, texts and logprobs. Each worker's log names its pool's
    dtype, and the transfers moved the prompt tokens' slots in it."""
    reference = LLM(model=model, dtype="float32", kv_dtype=kv_dtype, kv_tokens=4096)
    assert reference.engine.pool.kv.dtype == getattr(torch, pool_dtype)
    with running_server(tmp_path, "--model", model, "--dtype", "float32", "--kv-dtype", kv_dtype,
                        "--prefill-kv-tokens", "4096", "--decode-kv-tokens", "4096",
                        "--tenants", str(tenants[0])) as server:
        for prompt, name in zip(PROMPTS, ["alice", "bob", "carol", "alice", "bob"]):
            want = reference.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                             logprobs=0))[0]
            r = client(server, tenants[1][name]).completions.create(
                model=model, prompt=prompt, max_tokens=24, temperature=0, logprobs=0, extra_body={"ignore_eos": True})
            assert r.choices[0].text == want.text
            assert r.choices[0].logprobs.token_logprobs == pytest.approx([lp.logprob for lp in want.logprobs], abs=1e-4)
        metrics = server.metrics()
        log = server.log()
    assert log.count(f"MiB, {pool_dtype})") == 2, log  # the prefill and the decode worker's pools
    assert f"KV cache {pool_dtype}" in log
    moved = sum(float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("isoserve_kv_transfer_bytes_total"))
    slot_bytes = reference.engine.pool.slot_bytes
    prompt_tokens = sum(len(reference.tokenizer.encode(p)) for p in PROMPTS)
    assert slot_bytes == reference.engine.model_config.kv_bytes_per_token(value_bytes)
    assert moved == prompt_tokens * slot_bytes


def test_disaggregated_equals_aggregated_and_llm_generate(tmp_path, disagg, tenants, model, reference):
    key = tenants[1]["bob"]
    with running_server(tmp_path, "--model", model, "--dtype", "float32", "--mode", "aggregated",
                        "--kv-tokens", "4096", "--tenants", str(tenants[0])) as aggregated:
        for prompt in PROMPTS:
            want = reference.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].text
            assert completion_ids(disagg, key, model, prompt) == want
            assert completion_ids(aggregated, key, model, prompt) == want


def test_auth_and_openai_errors_on_the_live_server(disagg, tenants, model):
    url = disagg.base_url
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi"},
                   headers={"Authorization": "Bearer isk-not-a-key"})
    assert r.status_code == 401
    h = {"Authorization": f"Bearer {tenants[1]['alice']}", "Content-Type": "application/json"}
    r = httpx.post(url + "/v1/completions", content=b"{not json", headers=h)
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url + "/v1/completions", json={"model": "no-such-model", "prompt": "hi"}, headers=h)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    for bad in ({"temperature": -1}, {"max_tokens": 0}, {"top_p": 0}, {"n": 3}):
        r = httpx.post(url + "/v1/completions", json={"model": model, "prompt": "hi", **bad}, headers=h)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["param"] == next(iter(bad))


def _pages_used(server, admin_key) -> dict:
    status = httpx.get(server.base_url + "/status", headers={"Authorization": f"Bearer {admin_key}"}).json()
    return {w["id"]: w["pages_used"] for w in status["workers"]}


def test_client_disconnect_mid_stream_frees_pages_on_both_workers(disagg, tenants, model):
    admin = tenants[1]["admin"]
    h = {"Authorization": f"Bearer {tenants[1]['carol']}"}
    body = {"model": model, "prompt": "A long story: " * 40, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", disagg.base_url + "/v1/completions", json=body, headers=h, timeout=30) as r:
        assert r.status_code == 200
        seen, holding = 0, False
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
                # /status shows pool use from heartbeats (every 0.5 s): look until it shows ours.
                if seen % 10 == 0 and _pages_used(disagg, admin)["decode-0"] > 0:
                    holding = True
                    break
        assert holding, "the stream ended before /status showed its decode pages"
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        used = _pages_used(disagg, admin)
        if all(v == 0 for v in used.values()):
            break
        time.sleep(0.1)
    assert all(v == 0 for v in used.values()), used


def test_peer_without_the_cluster_secret_is_rejected_and_counted(disagg, tenants, model, secret_file):
    from isoserve.disagg.wire import Signer
    status = httpx.get(disagg.base_url + "/status",
                       headers={"Authorization": f"Bearer {tenants[1]['admin']}"}).json()
    ctx = zmq.Context()
    # The router's worker endpoint is a local ipc socket; its path is in the serve log.
    endpoint = next(line.split()[-1] for line in disagg.log().splitlines()
                    if "router listening for workers on" in line)
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, b"intruder")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    forged = Signer(b"not-the-cluster-secret-at-all!!", "intruder")
    sock.send_multipart(forged.pack("register", {"worker_id": "intruder", "role": "decode", "pid": 1,
                                                 "host": "evil", "pool_tokens": 10**9, "pool_pages": 1,
                                                 "page_size": 16, "context_length": 2048,
                                                 "kv_endpoint": "tcp://127.0.0.1:1", "model": model}))
    sock.send_multipart(forged.pack("outputs", {"outputs": []}))
    time.sleep(0.5)
    sock.close()
    ctx.term()
    metrics = httpx.get(disagg.base_url + "/metrics").text
    line = next(l for l in metrics.splitlines() if l.startswith('isoserve_rejected_messages_total{channel="router"}'))
    assert float(line.split()[-1]) >= 2
    after = httpx.get(disagg.base_url + "/status",
                      headers={"Authorization": f"Bearer {tenants[1]['admin']}"}).json()
    assert {w["id"] for w in after["workers"]} == {w["id"] for w in status["workers"]}  # nobody joined


def _by_threads(server: Server, role: str, metric: str = "isoserve_worker_steps_total") -> dict[int, float]:
    """A worker counter's values summed by its threads label, for one role."""
    steps = {}
    for line in server.metrics().splitlines():
        if line.startswith(metric + "{") and f'role="{role}"' in line:
            threads = int(line.split('threads="')[1].split('"')[0])
            steps[threads] = steps.get(threads, 0) + float(line.split()[-1])
    return steps


def test_a_lone_busy_worker_takes_the_idle_workers_cores(disagg, tenants, model):
    """One request at a time: the prefill worker is idle while decode generates, so decode
    runs its steps with every core of the host (and prefill with every core for the prompt)."""
    from isoserve.disagg.cores import host_cores

    cores = host_cores()
    assert "share %d core(s) by turns" % cores in disagg.log()
    before = {role: _by_threads(disagg, role).get(cores, 0) for role in ("prefill", "decode")}
    seconds_before = _by_threads(disagg, "decode", "isoserve_worker_step_seconds_total").get(cores, 0)
    completion_ids(disagg, tenants[1]["alice"], model, PROMPTS[0], n=24)
    deadline = time.monotonic() + 10
    while True:  # the counts arrive with each worker's heartbeats, every half second
        grown = {role: _by_threads(disagg, role).get(cores, 0) - before[role]
                 for role in ("prefill", "decode")}
        if (grown["decode"] >= 20 and grown["prefill"] >= 1) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    # 23 decode steps; the first may start before the prefill worker has marked itself idle.
    assert grown["decode"] >= 20 and grown["prefill"] >= 1, grown
    # The same heartbeats carry the steps' summed wall time: a tiny model's step is milliseconds.
    seconds = _by_threads(disagg, "decode", "isoserve_worker_step_seconds_total").get(cores, 0) - seconds_before
    assert 0 < seconds / grown["decode"] < 1.0, (seconds, grown)


def _steps(server: Server, role: str) -> float:
    return sum(_by_threads(server, role).values())


def test_a_burst_of_requests_is_prefilled_in_one_step_and_decoded_together(
        tmp_path, model, tenants, secret_file, reference):
    """Eight requests sent at once: the prefill worker holds the first until the others are in
    (a wide --prefill-gather-ms here, so a slow test host cannot split the burst) and computes
    all eight in one step; it tells the decode worker how many transfers follow each, and the
    decode worker starts none of its steps before the last is in, so all eight decode in
    lockstep: 11 decode steps for 12 tokens each (the first comes from prefill)."""
    from concurrent.futures import ThreadPoolExecutor

    with running_server(tmp_path, "--model", model, "--dtype", "float32", "--tenants", str(tenants[0]),
                        "--prefill-kv-tokens", "4096", "--decode-kv-tokens", "4096",
                        "--prefill-gather-ms", "1000",
                        "--cluster-secret-file", str(secret_file)) as server:
        assert "holding a burst of prompts until none arrives for 1000 ms" in server.log()
        before = {role: _steps(server, role) for role in ("prefill", "decode")}
        c = client(server, tenants[1]["alice"])
        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(lambda p: c.completions.create(
                model=model, prompt=p, max_tokens=12, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].text, prompts))
        for p, text in zip(prompts, texts):  # held, not changed
            assert text == reference.generate(p, SamplingParams(max_tokens=12, temperature=0,
                                                                ignore_eos=True))[0].text
        deadline = time.monotonic() + 10
        while True:  # the counts arrive with the workers' heartbeats, every half second
            grown = {role: _steps(server, role) - before[role] for role in ("prefill", "decode")}
            if (grown["prefill"] >= 1 and grown["decode"] >= 11) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        time.sleep(1.2)  # two more heartbeats: no step is still to be counted
        grown = {role: _steps(server, role) - before[role] for role in ("prefill", "decode")}
        assert grown == {"prefill": 1, "decode": 11}, grown


def test_two_workers_per_role_over_tcp_serve_50_concurrent_requests_from_3_tenants(
        tmp_path, model, tenants, secret_file, reference):
    router_port = free_port()
    with running_server(tmp_path, "--model", model, "--dtype", "float32", "--tenants", str(tenants[0]),
                        "--prefill-workers", "0", "--decode-workers", "0",
                        "--listen-workers", f"tcp://127.0.0.1:{router_port}",
                        "--cluster-secret-file", str(secret_file), wait=False) as server:
        import subprocess
        workers = []
        logs = []
        for role in ("prefill", "prefill", "decode", "decode"):
            i = len(workers)
            extra = ["--kv-endpoint", f"tcp://127.0.0.1:{free_port()}"] if role == "decode" else []
            log = open(tmp_path / f"worker-{i}.log", "w")
            logs.append(log)
            workers.append(subprocess.Popen(
                isoserve_cmd("worker", "--role", role, "--router", f"tcp://127.0.0.1:{router_port}",
                             "--cluster-secret-file", str(secret_file), "--worker-id", f"{role}-tcp-{i}",
                             "--model", model, "--dtype", "float32", "--kv-tokens", "4096",
                             "--threads", "1", *extra),
                stdout=log, stderr=subprocess.STDOUT, env=subprocess_env()))
        try:
            wait_healthy(server)
            deadline = time.monotonic() + 120
            while len(httpx.get(server.base_url + "/status", headers={
                    "Authorization": f"Bearer {tenants[1]['admin']}"}).json()["workers"]) < 4:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(50)]
            want = [r.text for r in reference.generate(
                prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))]
            names = ["alice", "bob", "carol"]

            async def one(i):
                c = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=tenants[1][names[i % 3]],
                                       max_retries=0, timeout=120)
                r = await c.completions.create(model=model, prompt=prompts[i], max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
                return r.choices[0].text

            async def all_of_them():
                return await asyncio.gather(*[one(i) for i in range(50)])

            got = asyncio.run(all_of_them())
            assert got == want
            status = httpx.get(server.base_url + "/status",
                               headers={"Authorization": f"Bearer {tenants[1]['admin']}"}).json()
            assert sorted(w["role"] for w in status["workers"]) == ["decode", "decode", "prefill", "prefill"]
        finally:
            for w in workers:
                w.terminate()
            for w in workers:
                w.wait(timeout=20)
            for log in logs:
                log.close()
