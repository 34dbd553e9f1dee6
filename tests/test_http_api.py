"""The HTTP API end to end: a real engine on a tiny random Llama, a real uvicorn server on
loopback, the official openai client for the happy paths and httpx for everything else."""
from __future__ import annotations

import json
import socket
import stat
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from isoserve.config import EngineConfig
from isoserve.engine.engine import Engine, RequestOutput
from isoserve.engine.llm import LLM
from isoserve.engine.sampling_params import SamplingParams
from isoserve.errors import IsoserveError, KVIsolationViolation, WorkerUnavailable
from isoserve.server.app import create_app
from isoserve.server.backend import GenerationRequest
from isoserve.server.http_protocol import BoundedHeadProtocol
from isoserve.server.metrics import Metrics
from isoserve.server.tenants import (TenantStore, add_tenant, ensure_tenants_file, hash_key,
                                     read_tenants)

from engine_backend import EngineBackend

MODEL = "tiny-llama"
CHAT = [{"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Name a colour."}]}]
CHAT_AS_TEXT = [{"role": "system", "content": "You are terse."},  # what the template receives
                {"role": "user", "content": "Name a colour."}]


# ---- fixtures ----------------------------------------------------------------------------------

def serve(app, send_buffer: int | None = None) -> tuple[str, uvicorn.Server, threading.Thread]:
    """A real uvicorn server on a free loopback port, on its own thread. `send_buffer` sets
    SO_SNDBUF on the listening socket (accepted sockets inherit it)."""
    sock = socket.socket()
    if send_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           http=BoundedHeadProtocol))  # as `serve` runs it
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread


def stop(server: uvicorn.Server, thread: threading.Thread) -> None:
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def model_path(tiny_llama_dir) -> Path:
    return tiny_llama_dir  # conftest's tiny random Llama, built once per session


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    return {"path": path, "admin": ensure_tenants_file(path), "alice": add_tenant(path, "alice")}


@pytest.fixture(scope="module")
def backend(model_path):
    b = EngineBackend(Engine(EngineConfig(model=str(model_path), dtype="float32", kv_tokens=4096)))
    yield b
    b.close()


@pytest.fixture(scope="module")
def metrics() -> Metrics:
    return Metrics()


@pytest.fixture(scope="module")
def base_url(backend, keys, metrics):
    app = create_app(backend, TenantStore.load(keys["path"]), metrics, served_model_names=[MODEL])
    url, server, thread = serve(app)
    yield url
    stop(server, thread)


@pytest.fixture(scope="module")
def reference(model_path) -> LLM:
    return LLM(model=str(model_path), dtype="float32", kv_tokens=4096)


@pytest.fixture
def client(base_url, keys) -> openai.OpenAI:
    return openai.OpenAI(api_key=keys["alice"], base_url=f"{base_url}/v1", max_retries=0, timeout=30)


@pytest.fixture
def http(base_url, keys):
    with httpx.Client(base_url=base_url, timeout=30,
                      headers={"Authorization": f"Bearer {keys['alice']}"}) as c:
        yield c


def assert_openai_error(response: httpx.Response, status: int, code: str | None = None,
                        param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# ---- the openai client: results equal the offline LLM's ----------------------------------------

PROMPT_IDS = [1, 504, 3458, 314, 260, 1345, 28, 1030, 1919, 30]


def test_completion_greedy_equals_llm_generate(client, reference):
    ref = reference.generate([PROMPT_IDS], SamplingParams(max_tokens=12, temperature=0))[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=12, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == MODEL
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == \
        (len(PROMPT_IDS), len(ref.token_ids), len(PROMPT_IDS) + len(ref.token_ids))


def test_completion_text_prompt_and_stream_equal_llm_generate(client, reference):
    prompt = "The quick brown fox"
    ids = reference.tokenizer.encode(prompt)
    ref = reference.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ids)


def test_completion_logprobs_in_legacy_format(client, reference):
    ref = reference.generate([PROMPT_IDS], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    lp = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=6, temperature=0,
                                   logprobs=3).choices[0].logprobs
    tok = reference.tokenizer
    assert lp.tokens == [tok.decode([t]) for t in ref.token_ids]
    assert lp.token_logprobs == pytest.approx([r.logprob for r in ref.logprobs], abs=1e-4)
    for top, r in zip(lp.top_logprobs, ref.logprobs):
        assert top == pytest.approx({tok.decode([t]): v for t, v in r.top}, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_equals_llm_chat_with_logprobs(client, reference):
    ref = reference.chat(CHAT_AS_TEXT, SamplingParams(max_tokens=8, temperature=0, logprobs=2))
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8,
                                         temperature=0, logprobs=True, top_logprobs=2)
    choice = out.choices[0]
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert choice.finish_reason == ref.finish_reason
    content = choice.logprobs.content
    assert [c.token for c in content] == [reference.tokenizer.decode([t]) for t in ref.token_ids]
    assert [c.logprob for c in content] == pytest.approx([r.logprob for r in ref.logprobs], abs=1e-4)
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        # Byte-level BPE: the bytes are the token's own, even where its text is a partial character.
        assert "\ufffd" in c.token or bytes(c.bytes).decode("utf-8") == c.token


def test_chat_stream_equals_non_stream(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_concurrent_requests_each_get_their_own_answer(client, reference):
    prompts = [[1, 7 + i, 300 + 11 * i, 42, 9000 - i] for i in range(6)]
    refs = reference.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    with ThreadPoolExecutor(len(prompts)) as pool:
        texts = list(pool.map(lambda p: client.completions.create(
            model=MODEL, prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True},
            stream=p[1] % 2 == 0), prompts))
    texts = [t.choices[0].text if isinstance(t, openai.types.Completion)
             else "".join(c.choices[0].text for c in t) for t in texts]
    assert texts == [r.text for r in refs] and len(set(texts)) == len(texts)


def test_models_lists_the_one_limit(client, backend):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == backend.max_model_len() == 2048


# ---- errors, in OpenAI's body ---------------------------------------------------------------------

def test_missing_or_wrong_key_is_401(base_url):
    for headers in ({}, {"Authorization": "Bearer isk-not-a-key"}, {"Authorization": "Basic abc"}):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = httpx.request(method, base_url + path, headers=headers, content=b"{not json")
            assert_openai_error(r, 401, "invalid_api_key")
            assert r.headers["www-authenticate"] == "Bearer"


def test_status_needs_an_admin_key(http, base_url, keys):
    assert_openai_error(http.get("/status"), 403, "permission_denied")
    r = httpx.get(base_url + "/status", headers={"Authorization": f"Bearer {keys['admin']}"})
    assert r.status_code == 200 and r.json()["workers"][0]["pool_pages"]["total"] > 0


def test_malformed_json_is_400(http):
    for body in (b"{not json", b"", b"[1, 2]"):
        assert_openai_error(http.post("/v1/completions", content=body), 400, "invalid_request")


@pytest.mark.parametrize("field, value", [
    ("temperature", -1), ("max_tokens", 0), ("logprobs", 99), ("n", 2), ("echo", True),
    ("presence_penalty", 0.5), ("frequency_penalty", -1.0), ("top_p", 0), ("stop", ["x"] * 17)])
def test_bad_parameter_is_400_naming_it(http, field, value):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", field: value})
    assert field in assert_openai_error(r, 400, "invalid_request", param=field)["message"]


def test_bad_chat_parameters_are_400(http):
    base = {"model": MODEL, "messages": CHAT}
    cases = [({"top_logprobs": 99, "logprobs": True}, "top_logprobs"),
             ({"top_logprobs": 2}, "top_logprobs"),
             ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
              "messages[0].content[0].type"),
             ({"messages": []}, "messages")]
    for extra, param in cases:
        assert_openai_error(http.post("/v1/chat/completions", json=base | extra), 400, param=param)


def test_unknown_fields_are_ignored(http):
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                           "temperature": None, "some_future_field": {"x": 1}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_unknown_model_is_404(http):
    r = http.post("/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    assert_openai_error(r, 404, "model_not_found", param="model")
    assert_openai_error(http.get("/v1/models/gpt-4"), 404, "model_not_found")


def test_prompt_over_the_limit_is_400_context_length_exceeded(http, backend):
    received = len(backend.received)
    prompt = [5] * (backend.max_model_len() - 16 + 1)  # one token over, with the default 16
    for stream in (False, True):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "stream": stream})
        assert_openai_error(r, 400, "context_length_exceeded", param="prompt")
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT,
                                                "max_tokens": backend.max_model_len()})
    assert_openai_error(r, 400, "context_length_exceeded", param="max_tokens")  # it alone is too big
    assert len(backend.received) == received  # rejected before reaching the backend


def test_unknown_route_and_method_in_openai_body(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


# ---- streaming, disconnects, failures ---------------------------------------------------------------

def test_sse_ends_with_done(http):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])


def wait_for_abort(backend: EngineBackend, request_id: str) -> None:
    deadline = time.monotonic() + 10
    while request_id not in backend.aborted:
        assert time.monotonic() < deadline, f"{request_id} was never aborted"
        time.sleep(0.02)
    while request_id in backend.engine.requests:  # and its pages went back
        assert time.monotonic() < deadline
        time.sleep(0.02)


LONG = {"model": MODEL, "prompt": "Once", "max_tokens": 1900, "ignore_eos": True}


def test_stream_client_disconnect_aborts_the_request(http, backend):
    with http.stream("POST", "/v1/completions", json=LONG | {"stream": True}) as r:
        next(r.iter_lines())
    wait_for_abort(backend, backend.received[-1].request_id)


def test_non_stream_client_disconnect_aborts_the_request(base_url, keys, backend):
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(base_url + "/v1/completions", json=LONG, timeout=0.5,
                   headers={"Authorization": f"Bearer {keys['alice']}"})
    wait_for_abort(backend, backend.received[-1].request_id)


class FailingBackend:
    """The real backend, except that each request fails as `fail_after` says."""

    def __init__(self, inner: EngineBackend, error, fail_after: int):
        self.inner, self.error, self.fail_after = inner, error, fail_after
        self.model_name, self.tokenizer = inner.model_name, inner.tokenizer

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        count = 0
        async for out in self.inner.generate(request):
            count += len(out.new_token_ids)
            if count > self.fail_after:
                break
            yield out
        if not isinstance(self.error, IsoserveError):  # a bug, not a reported failure
            raise self.error
        yield RequestOutput(request.request_id, [], [], "", True, "error", self.error)


@pytest.fixture
def failing(backend, keys):
    servers = []

    def start(error, fail_after: int) -> httpx.Client:
        app = create_app(FailingBackend(backend, error, fail_after), TenantStore.load(keys["path"]),
                         Metrics(), served_model_names=[MODEL])
        url, server, thread = serve(app)
        servers.append((server, thread))
        return httpx.Client(base_url=url, timeout=30, headers={"Authorization": f"Bearer {keys['alice']}"})

    yield start
    for server, thread in servers:
        stop(server, thread)


def test_error_mid_stream_is_one_error_event_then_done(failing, backend):
    http = failing(KVIsolationViolation("stopped before reading KV it does not own"), fail_after=3)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 50, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert r.status_code == 200
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "kv_isolation_violation"
    assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-2])
    # The failed request's remaining generation was aborted, not left running.
    wait_for_abort(backend, backend.received[-1].request_id)
    r = http.post("/v1/completions", json=body | {"stream": False})
    assert_openai_error(r, 500, "kv_isolation_violation")


def test_error_before_first_token_keeps_its_status(failing):
    http = failing(WorkerUnavailable("no decode worker is up"), fail_after=0)
    for stream in (False, True):
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "stream": stream})
        assert_openai_error(r, 503, "worker_unavailable")


def test_unexpected_exception_is_500_in_openai_body(failing):
    http = failing(RuntimeError("a bug"), fail_after=0)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 20, "ignore_eos": True}
    for stream in (False, True):
        r = http.post("/v1/completions", json=body | {"stream": stream})
        assert_openai_error(r, 500, "internal_error")
        assert "a bug" not in r.text  # internals stay in the log
    http = failing(RuntimeError("a bug"), fail_after=2)
    with http.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "internal_error"
    assert events[-1] == "data: [DONE]"


# ---- health and metrics ------------------------------------------------------------------------------

def test_health(base_url):
    r = httpx.get(base_url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics_in_prometheus_text(http, base_url, metrics):
    http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3})
    metrics.set_pool_pages("decode-0", "decode", total=256, used=10, free=246)
    metrics.observe_transfer(4096, 0.002)
    metrics.count_rejected_transfer("checksum")
    metrics.count_guard_violation("decode-0", "writer_tags")
    metrics.count_rejected_message("control")
    metrics.set_worker_up("decode-0", "decode", True)
    r = httpx.get(base_url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    assert 'isoserve_requests_total{code="",endpoint="/v1/completions",status="200"}' in text
    assert 'isoserve_requests_total{code="invalid_api_key",endpoint="/v1/models",status="401"}' in text
    assert 'isoserve_requests_total{code="request_aborted",endpoint="/v1/completions",status="499"}' in text
    assert 'isoserve_pool_pages{role="decode",state="free",worker="decode-0"} 246.0' in text
    for name in ("isoserve_prompt_tokens_total", "isoserve_completion_tokens_total",
                 "isoserve_time_to_first_token_seconds_bucket", "isoserve_inter_token_latency_seconds_count",
                 "isoserve_e2e_request_latency_seconds_sum", "isoserve_kv_transfer_bytes_total 4096.0",
                 "isoserve_kv_transfer_seconds_count 1.0", 'isoserve_kv_transfers_rejected_total{reason="checksum"}',
                 "isoserve_guard_violations_total", 'isoserve_rejected_messages_total{channel="control"}',
                 'isoserve_worker_up{role="decode",worker="decode-0"} 1.0'):
        assert name in text, name


# ---- tenants --------------------------------------------------------------------------------------

def test_tenants_store_only_key_hashes(tmp_path):
    path = tmp_path / "conf" / "tenants.toml"
    admin_key = ensure_tenants_file(path)
    assert admin_key.startswith("isk-") and len(admin_key) >= 4 + 43
    assert ensure_tenants_file(path) is None  # only on first start
    key = add_tenant(path, "bob")
    text = path.read_text()
    for k in (admin_key, key):
        assert k not in text and k.removeprefix("isk-") not in text and hash_key(k) in text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    store = TenantStore.load(path)
    assert store.authenticate(admin_key).name == "default" and store.authenticate(admin_key).admin
    assert store.authenticate(key).name == "bob" and not store.authenticate(key).admin
    assert store.authenticate("isk-" + "A" * 43) is None and store.authenticate("") is None
    assert [t.name for t in read_tenants(path)] == ["default", "bob"]


def test_duplicate_tenant_name_is_refused(tmp_path):
    path = tmp_path / "tenants.toml"
    add_tenant(path, "carol")
    with pytest.raises(ValueError, match="already exists"):
        add_tenant(path, "carol")
    with pytest.raises(ValueError, match="invalid tenant name"):
        add_tenant(path, 'evil"\n[[tenants]]')
    assert [t.name for t in read_tenants(path)] == ["carol"]


def test_running_store_sees_added_tenants(tmp_path):
    path = tmp_path / "tenants.toml"
    ensure_tenants_file(path)
    store = TenantStore.load(path)
    key = add_tenant(path, "dave")
    assert store.authenticate(key).name == "dave"
    path.write_text("this is [not toml")  # a broken edit keeps the tenants already loaded
    assert store.authenticate(key).name == "dave"
