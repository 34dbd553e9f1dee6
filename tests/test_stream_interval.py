"""--stream-interval: a running request's tokens go out every N tokens, its first token and its
end at once, with the same tokens, text and logprobs as one token at a time; over HTTP the
stream carries fewer, larger events and the same completion. An interval below 1 is refused.
"""
from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from isoserve import LLM, SamplingParams
from isoserve.engine.engine import Engine
from isoserve.config import EngineConfig
from serving import add_tenant, isoserve_cmd, running_server, subprocess_env

PROMPTS = ["The weather today", "def add(a, b):", "1, 2, 3,"]


def _stream(llm: LLM, params: list[SamplingParams]) -> dict[str, list]:
    """Each request's outputs as the engine emits them, step by step."""
    for i, p in enumerate(params):
        llm.engine.add_request(f"r{i}", llm.tokenizer.encode(PROMPTS[i % len(PROMPTS)]), p)
    seen: dict[str, list] = {f"r{i}": [] for i in range(len(params))}
    while llm.engine.has_work():
        for out in llm.engine.step():
            seen[out.request_id].append(out)
    return seen


@pytest.fixture(scope="module")
def llms(tiny_llama_dir):
    return {n: LLM(str(tiny_llama_dir), dtype="float32", stream_interval=n) for n in (1, 3)}


def test_outputs_come_every_n_tokens_with_the_same_tokens_text_and_logprobs(llms):
    params = [SamplingParams(max_tokens=11, temperature=0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=7, temperature=1.0, seed=4, ignore_eos=True),
              SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)]
    each, grouped = _stream(llms[1], params), _stream(llms[3], params)
    for rid in each:
        a, b = each[rid], grouped[rid]
        assert [len(o.new_token_ids) for o in a] == [1] * len(a)
        sizes = [len(o.new_token_ids) for o in b]
        assert sizes[0] == 1 and all(s == 3 for s in sizes[1:-1]) and 1 <= sizes[-1] <= 3, sizes
        assert [o.finished for o in b] == [False] * (len(b) - 1) + [True]
        assert "".join(o.new_text for o in a) == "".join(o.new_text for o in b)
        for field in ("new_token_ids", "new_logprobs"):
            assert [x for o in a for x in getattr(o, field)] == [x for o in b for x in getattr(o, field)], field
        assert (a[-1].finish_reason, a[-1].num_output_tokens) == (b[-1].finish_reason, b[-1].num_output_tokens)


def test_a_stop_string_cuts_the_text_the_same_way(llms):
    text = llms[1].generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))[0].text
    stop = text[6:9]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=stop)]
    each, grouped = _stream(llms[1], params)["r0"], _stream(llms[3], params)["r0"]
    assert "".join(o.new_text for o in grouped) == "".join(o.new_text for o in each) == text[:text.find(stop)]
    assert grouped[-1].finish_reason == "stop"


def test_an_interval_below_one_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="stream_interval"):
        Engine(EngineConfig(model=str(tiny_llama_dir), dtype="float32", stream_interval=0))
    r = subprocess.run(isoserve_cmd("serve", "--stream-interval", "0"), capture_output=True, text=True,
                       env=subprocess_env())
    assert r.returncode == 2 and "--stream-interval" in r.stderr and "at least 1" in r.stderr


def _events(response: httpx.Response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"]


def test_a_disaggregated_server_streams_every_n_tokens(tmp_path, tiny_llama_dir):
    tenants = tmp_path / "tenants.toml"
    key = add_tenant(tenants, "alice")
    body = {"model": str(tiny_llama_dir), "prompt": PROMPTS[1], "max_tokens": 13, "temperature": 0,
            "ignore_eos": True, "logprobs": 1}
    with running_server(tmp_path, "--model", str(tiny_llama_dir), "--dtype", "float32", "--tenants", str(tenants),
                        "--stream-interval", "4", "--threads-per-worker", "1") as server:
        assert "every 4 tokens (--stream-interval)" in server.log()
        headers = {"Authorization": f"Bearer {key}"}
        whole = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=120).json()
        with httpx.stream("POST", server.base_url + "/v1/completions", headers=headers, timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            events = _events(r)
    chunks = [e for e in events if e.get("choices")]
    sizes = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"][0]["logprobs"]]
    assert sizes == [1, 4, 4, 4], sizes  # the first token at once, then four at a time: 13 in all
    choice = whole["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in chunks) == choice["text"]
    assert sum((c["choices"][0]["logprobs"]["tokens"] for c in chunks if c["choices"][0]["logprobs"]), []) \
        == choice["logprobs"]["tokens"]
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"] == 13
