"""Issue 7 acceptance: schemathesis, driven by the OpenAPI document the server itself serves at
/openapi.json, finds no 5xx and no response that breaks that document (status codes, content
types, bodies), and every request the document calls invalid is refused.

One real `isoserve serve` (aggregated: router and one worker process) on the tiny random Llama;
a bounded number of examples per operation so the file runs in about a minute on two cores.
"""
from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from serving import add_tenant, running_server

# Generated requests keep their outputs short: the point is the API surface, not decoding time.
# (Only integers above it are lowered, so a request the schema calls invalid stays invalid.)
MAX_TOKENS = 4
# For a deeper search by hand: ISOSERVE_SCHEMATHESIS_EXAMPLES=500 (and a random seed each run).
DEEP = int(os.environ.get("ISOSERVE_SCHEMATHESIS_EXAMPLES", "0"))
EXAMPLES_WITH_KEY = DEEP or 25
EXAMPLES_WITHOUT_KEY = DEEP // 5 or 5


@pytest.fixture(scope="module")
def live(tmp_path_factory, tiny_llama_dir):
    tmp = tmp_path_factory.mktemp("schemathesis")
    tenants = tmp / "tenants.toml"
    key = add_tenant(tenants, "alice", admin=True)  # admin: /status is exercised past its 403 too
    with running_server(tmp, "--model", str(tiny_llama_dir), "--dtype", "float32", "--mode", "aggregated",
                        "--kv-tokens", "4096", "--tenants", str(tenants)) as server:
        yield server.base_url, {"Authorization": f"Bearer {key}"}


def short_outputs(ctx, body):
    if isinstance(body, dict):
        for field in ("max_tokens", "max_completion_tokens"):
            value = body.get(field)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and float(value).is_integer() and value > MAX_TOKENS:  # 7.0 is an integer too
                body[field] = MAX_TOKENS
        if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = MAX_TOKENS  # a chat without a limit may fill the whole context
    return body


@pytest.fixture(scope="module")
def api_schema(live):
    base_url, auth = live
    # The document needs a tenant key: it describes this deployment (model names, vocabulary).
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=auth, timeout=30)
    schema.hook("map_body")(short_outputs)
    return schema


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model}"), ("GET", "/status"), ("GET", "/health"), ("GET", "/metrics")]
WITH_INPUT = {"/v1/completions", "/v1/chat/completions", "/v1/models/{model}"}


def fuzz(schema, method: str, path: str, examples: int, headers: dict | None) -> None:
    """Valid and (where there is input to break) invalid requests for one operation, each sent
    to the server and its response checked by every schemathesis check."""
    operation = schema[path][method]
    strategy = operation.as_strategy(GenerationMode.POSITIVE)
    if path in WITH_INPUT:
        strategy = strategy | operation.as_strategy(GenerationMode.NEGATIVE)

    @given(strategy)
    @settings(max_examples=examples, deadline=None, database=None, derandomize=not DEEP,
              suppress_health_check=list(HealthCheck))
    def run(case):
        case.call_and_validate(headers=headers, timeout=60)

    run()


def completed(base_url: str, path: str) -> float:
    """How many requests to `path` the server answered with 200, from its own metrics."""
    line = f'isoserve_requests_total{{code="",endpoint="{path}",status="200"}} '
    text = httpx.get(base_url + "/metrics").text
    return next((float(l.removeprefix(line)) for l in text.splitlines() if l.startswith(line)), 0.0)


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_api_with_a_tenant_key(api_schema, live, method, path):
    before = completed(live[0], path)
    fuzz(api_schema, method, path, EXAMPLES_WITH_KEY, live[1])
    if path in ("/v1/completions", "/v1/chat/completions"):  # not only refusals: real generations too
        assert completed(live[0], path) >= before + 3


@pytest.mark.parametrize("method, path", OPERATIONS)
def test_api_without_a_key(api_schema, method, path):
    fuzz(api_schema, method, path, EXAMPLES_WITHOUT_KEY, None)
