"""Issue 4 acceptance: the isolation guard ends exactly the request whose KV is not its own.

Each bad state is forged for real -- in the page metadata of a running engine, or by a faulty
prefill worker (failpoints) in a live `isoserve serve` -- and the request it touches must end
with the right error code, while the other requests of the same batch finish with exactly the
tokens they get when run alone.

- Engine level, on two model shapes (GQA and plain multi-head attention), on the CPU and on a
  GPU where there is one (tiny_models.DEVICES): a page written by
  another request, a stale epoch, unwritten slots inside the read range. With the writer-tag
  guard switched off, the same forgeries go unnoticed: the check is what catches them.
- Transfer level, live server: a partial manifest, a wrong checksum, a duplicate transfer, a
  late transfer after an abort, and the incident itself (a placeholder for a prompt the prefill
  pool cannot hold, with the outer guards switched off).
"""
from __future__ import annotations

import asyncio
import random
import re
import time
from pathlib import Path

import httpx
import pytest

from isoserve import LLM, SamplingParams
from isoserve.config import EngineConfig
from isoserve.engine.engine import Engine
from serving import add_tenant, running_server, subprocess_env
from tiny_models import DEVICES, make_tiny_llama

NEW_TOKENS = 12


def prompt_ids(n: int, seed: int) -> list[int]:
    """n ordinary (non-special) token ids of SmolLM2's vocabulary."""
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)


# ==== engine level ============================================================================

SHAPES = {"gqa": dict(num_heads=4, num_kv_heads=2), "mha": dict(num_heads=4, num_kv_heads=4)}
BATCH = [prompt_ids(n, seed) for seed, n in enumerate((37, 50, 21, 64))]
VICTIM = 1          # BATCH[1]: 50 tokens, pages 0-2 full after the prefill
FORGE_AFTER = 3     # steps: one prefill of the whole batch, then two decode steps


def _other_writer(engine: Engine, victim, page: int) -> None:
    """A page of the victim that another running request wrote (its tag on it)."""
    other = next(s for s in engine.scheduler.running if s is not victim)
    engine.pool.writer[victim.pages[page]] = other.tag


def _stale_epoch(engine: Engine, victim, page: int) -> None:
    """A page re-allocated behind the victim's back: its epoch moved on."""
    engine.pool.epoch[victim.pages[page]] += 1


def _unwritten_slots(engine: Engine, victim, page: int) -> None:
    """A full page of the victim whose last slots were never written."""
    assert int(engine.pool.filled[victim.pages[page]]) == engine.pool.page_size
    engine.pool.filled[victim.pages[page]] = engine.pool.page_size - 5


FORGERIES = {"other-writer": (_other_writer, 1), "stale-epoch": (_stale_epoch, 2),
             "unwritten-slots": (_unwritten_slots, 0)}


@pytest.fixture(scope="module", params=list(SHAPES))
def shape_model(request, tmp_path_factory, tiny_llama_dir) -> str:
    if request.param == "gqa":
        return str(tiny_llama_dir)  # the session's tiny Llama is this GQA shape
    return str(make_tiny_llama(tmp_path_factory.mktemp(f"tiny-{request.param}") / "llama",
                               **SHAPES[request.param]))


@pytest.fixture(scope="module", params=DEVICES)
def device(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def solo_tokens(shape_model, device) -> list[list[int]]:
    """Each prompt of BATCH generated alone."""
    engine = Engine(EngineConfig(model=shape_model, dtype="float32", kv_tokens=1024, device=device))
    solo = []
    for i, ids in enumerate(BATCH):
        engine.add_request(f"solo-{i}", ids, GREEDY)
        tokens = []
        while engine.has_work():
            for out in engine.step():
                assert out.error is None
                tokens += out.new_token_ids
        assert len(tokens) == NEW_TOKENS
        solo.append(tokens)
    return solo


@pytest.fixture(scope="module")
def guarded_engine(shape_model, device) -> Engine:
    return Engine(EngineConfig(model=shape_model, dtype="float32", kv_tokens=1024, device=device))


@pytest.fixture(scope="module")
def unguarded_engine(shape_model, device) -> Engine:
    return Engine(EngineConfig(model=shape_model, dtype="float32", kv_tokens=1024, device=device,
                               disabled_guards=frozenset({"writer_tags"})))


def run_forged_batch(engine: Engine, forgery: str):
    """Run BATCH, forge the victim's pages after FORGE_AFTER steps, run to the end.

    Returns the request ids, the tokens and the final output of each request, and for each step
    after the forgery: (its outputs, the victim's pages still allocated, the victim's sequence
    if the engine still holds it)."""
    forge, page = FORGERIES[forgery]
    rids = [f"{forgery}-{i}-{time.monotonic_ns()}" for i in range(len(BATCH))]
    for rid, ids in zip(rids, BATCH):
        engine.add_request(rid, ids, GREEDY)
    tokens = {rid: [] for rid in rids}
    finals, after, victim_pages = {}, [], None
    steps = 0
    while engine.has_work():
        outs = engine.step()
        steps += 1
        for out in outs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
        if victim_pages is not None:
            after.append((outs, [p for p in victim_pages if engine.allocator.is_allocated(p)],
                          engine.requests.get(rids[VICTIM])))
        if steps == FORGE_AFTER:
            victim = engine.requests[rids[VICTIM]]
            assert all(s.num_computed > 0 for s in engine.scheduler.running)
            assert len(engine.scheduler.running) == len(BATCH)  # all in decode together
            victim_pages = list(victim.pages)
            forge(engine, victim, page)
    assert engine.allocator.num_free == engine.pool.num_pages and not engine.requests
    return rids, tokens, finals, after


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_engine_guard_ends_only_the_forged_request(guarded_engine, solo_tokens, forgery):
    engine = guarded_engine
    violations = engine.stats.counters["guard_violations"]
    rids, tokens, finals, after = run_forged_batch(engine, forgery)
    victim = rids[VICTIM]

    # The very next step stops the victim, in the same batch as the others, which got tokens.
    outs, still_allocated, victim_seq = after[0]
    (end,) = [o for o in outs if o.request_id == victim]
    assert end.finished and end.finish_reason == "error"
    assert end.error is not None and end.error.code == "kv_isolation_violation"
    assert end.error.http_status == 500
    assert end.new_token_ids == []  # no token computed from the forged page
    assert {o.request_id for o in outs if o.new_token_ids} == set(rids) - {victim}
    assert still_allocated == [] and victim_seq is None  # its pages are free at once
    assert engine.stats.counters["guard_violations"] == violations + 1
    # Nothing from the victim after its end; before it, only its own solo tokens.
    assert all(o.request_id != victim for step_outs, _, _ in after[1:] for o in step_outs)
    assert tokens[victim] == solo_tokens[VICTIM][:FORGE_AFTER]
    # The others finish as if they had run alone.
    for i, rid in enumerate(rids):
        if rid != victim:
            assert finals[rid].finish_reason == "length" and finals[rid].error is None
            assert tokens[rid] == solo_tokens[i], f"request {i} differs from its solo run"


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_without_the_writer_tag_guard_the_same_forgery_goes_unnoticed(unguarded_engine, solo_tokens, forgery):
    engine = unguarded_engine
    rids, tokens, finals, _ = run_forged_batch(engine, forgery)
    assert engine.stats.counters["guard_violations"] == 0
    # The metadata lies but the KV bytes are the victim's own: it runs on, unnoticed.
    assert all(finals[rid].finish_reason == "length" and finals[rid].error is None for rid in rids)
    assert [tokens[rid] for rid in rids] == solo_tokens


# ==== transfer level, live server =============================================================

CONTEXT = 512
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def model(tiny_llama_dir) -> str:
    return str(tiny_llama_dir)  # GQA: 4 query heads, 2 KV heads


@pytest.fixture(scope="module")
def tenants(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    path = tmp_path_factory.mktemp("tenants") / "tenants.toml"
    return path, {name: add_tenant(path, name, admin=(name == "admin")) for name in ("admin", "alice")}


@pytest.fixture(scope="module")
def reference(model) -> LLM:
    return LLM(model=model, dtype="float32", context_length=CONTEXT, kv_tokens=2 * CONTEXT)


def solo_texts(reference: LLM, prompts: list[list[int]]) -> list[str]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [reference.generate([p], params)[0].text for p in prompts]


def serve_with_failpoints(tmp: Path, model: str, tenants, failpoints: str, *extra: str):
    return running_server(tmp, "--model", model, "--dtype", "float32", "--context-length", str(CONTEXT),
                          "--tenants", str(tenants[0]), "--enable-failpoints", *extra,
                          env=subprocess_env(ISOSERVE_FAILPOINTS=failpoints))


async def _complete(client: httpx.AsyncClient, key: str, model: str, prompt: list[int],
                    stream: bool = False) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}
    return await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def complete_all(server, key: str, model: str, prompts: list[list[int]]) -> list[httpx.Response]:
    """All prompts at once, as concurrent requests."""
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            return await asyncio.gather(*[_complete(client, key, model, p) for p in prompts])
    return asyncio.run(run())


def metric(server, name: str, **labels: str) -> float:
    """A sample's value from /metrics; 0 when the series does not exist yet."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(server.base_url + "/metrics").text.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if m and m[1] == name and ",".join(sorted((m[2] or "").split(","))) == want:
            return float(m[3])
    return 0.0


def wait_for_metric(server, value: float, name: str, timeout: float = 5, **labels: str) -> float:
    """Worker counters reach /metrics with heartbeats (every 0.5 s): poll briefly."""
    deadline = time.monotonic() + timeout
    while (got := metric(server, name, **labels)) < value and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def pages_used(server, admin_key: str) -> dict[str, int]:
    status = httpx.get(server.base_url + "/status", headers={"Authorization": f"Bearer {admin_key}"}).json()
    return {w["id"]: w["pages_used"] for w in status["workers"]}


def assert_pools_drain(server, admin_key: str, timeout: float = 5) -> None:
    """Every page of every worker comes back (within a few heartbeats)."""
    deadline = time.monotonic() + timeout
    while any((used := pages_used(server, admin_key)).values()):
        assert time.monotonic() < deadline, f"pages still held: {used}"
        time.sleep(0.1)


# Prompts of 2-5 pages (page size 16), so a truncated manifest is really partial.
FAULT_PROMPTS = [prompt_ids(n, 100 + i) for i, n in enumerate((40, 57, 33, 70, 48, 61))]


@pytest.mark.parametrize("failpoint, reason", [("transfer.truncate=1in2", "coverage"),
                                               ("transfer.corrupt_bytes=1in2", "checksum")],
                         ids=["partial-manifest", "wrong-checksum"])
def test_bad_transfer_ends_its_request_and_the_batch_goes_on(tmp_path, model, tenants, reference,
                                                             failpoint, reason):
    want = solo_texts(reference, FAULT_PROMPTS)
    with serve_with_failpoints(tmp_path, model, tenants, failpoint) as server:
        rs = complete_all(server, tenants[1]["alice"], model, FAULT_PROMPTS)
        ok = rejected = 0
        for r, text in zip(rs, want):
            if r.status_code == 200:
                assert r.json()["choices"][0]["text"] == text
                assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS
                ok += 1
            else:
                assert r.status_code == 500, r.text
                error = r.json()["error"]
                assert error["code"] == "kv_transfer_incomplete" and reason in error["message"], error
                rejected += 1
        # Every second transfer is bad, whatever order the prefill worker took them in.
        assert ok == rejected == len(FAULT_PROMPTS) // 2
        assert wait_for_metric(server, rejected, "isoserve_kv_transfers_rejected_total",
                               reason=reason) == rejected
        assert_pools_drain(server, tenants[1]["admin"])
        assert "rejected KV transfer" in server.log()


def test_duplicate_transfer_is_dropped_and_counted(tmp_path, model, tenants, reference):
    prompts = FAULT_PROMPTS[:4]
    want = solo_texts(reference, prompts)
    with serve_with_failpoints(tmp_path, model, tenants, "transfer.duplicate=always") as server:
        rs = complete_all(server, tenants[1]["alice"], model, prompts)
        assert [r.status_code for r in rs] == [200] * len(prompts), [r.text for r in rs]
        assert [r.json()["choices"][0]["text"] for r in rs] == want
        # Each request's second copy arrives while it decodes: dropped as a duplicate.
        assert wait_for_metric(server, len(prompts), "isoserve_kv_transfers_rejected_total",
                               reason="duplicate") == len(prompts)
        assert_pools_drain(server, tenants[1]["admin"])


def test_late_transfer_after_an_abort_is_dropped_and_later_requests_are_correct(
        tmp_path, model, tenants, reference):
    prompts = FAULT_PROMPTS[:3]
    want = solo_texts(reference, prompts)
    key, admin = tenants[1]["alice"], tenants[1]["admin"]
    # Only the first transfer waits: the later requests' go out at once.
    with serve_with_failpoints(tmp_path, model, tenants, "transfer.delay_ms=1500x1") as server:
        body = {"model": model, "prompt": prompts[0], "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up before the KV is sent
            httpx.post(server.base_url + "/v1/completions", json=body, timeout=0.5,
                       headers={"Authorization": f"Bearer {key}"})
        # The transfer still goes out 1.5 s after the prefill and reaches a decode worker that
        # has already freed the request's pages: it is dropped, never written.
        assert wait_for_metric(server, 1, "isoserve_kv_transfers_rejected_total", timeout=10,
                               reason="unknown_or_late") == 1
        assert_pools_drain(server, admin)
        rs = complete_all(server, key, model, prompts)
        assert [r.status_code for r in rs] == [200] * len(prompts), [r.text for r in rs]
        assert [r.json()["choices"][0]["text"] for r in rs] == want
        assert metric(server, "isoserve_kv_transfers_rejected_total", reason="unknown_or_late") == 1
        assert_pools_drain(server, admin)


def test_the_incident_placeholder_transfer_is_stopped_by_the_writer_tag_guard(tmp_path, model, tenants, reference):
    """The incident: a prompt the prefill pool cannot hold is replaced by a one-token placeholder
    and "transferred complete". With the limit, the audit and the coverage check all switched
    off, the writer-tag guard on decode is the last line, and it holds: 500, never a 200."""
    key = tenants[1]["alice"]
    victims = FAULT_PROMPTS[:3]              # fit the 64-token prefill pool
    attacker = prompt_ids(200, seed=666)     # fits the context and the decode pool, not prefill
    too_long_for_decode = prompt_ids(300, seed=667)
    want = solo_texts(reference, victims)
    with serve_with_failpoints(tmp_path, model, tenants, "prefill.placeholder_on_reject=always",
                               "--prefill-kv-tokens", "64", "--decode-kv-tokens", "256",
                               "--unsafe-disable-guard", "admission,capacity_audit,transfer_coverage"
                               ) as server:
        log = server.log()
        assert "UNSAFE: isolation guards DISABLED" in log and "FAILPOINT ACTIVE" in log

        async def mixed():
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
                return await asyncio.gather(
                    *[_complete(client, key, model, p) for p in victims],
                    _complete(client, key, model, attacker),
                    _complete(client, key, model, attacker, stream=True))

        *victim_rs, attack, attack_stream = asyncio.run(mixed())
        for r in (attack, attack_stream):
            assert r.status_code == 500, r.text
            assert r.json()["error"]["code"] == "kv_isolation_violation"
        assert [r.status_code for r in victim_rs] == [200] * len(victims)
        assert [r.json()["choices"][0]["text"] for r in victim_rs] == want
        assert wait_for_metric(server, 2, "isoserve_guard_violations_total",
                               worker="decode-0", guard="writer_tags") == 2
        log = server.log()
        assert log.count("failpoint prefill.placeholder_on_reject fired:") == 2  # the bug did happen
        assert "KV isolation violation" in log  # logged with pages and tags

        # The engine's own "cannot fit" check is not a guard: it stays on, and ends the request.
        r = asyncio.run(_one(server, key, model, too_long_for_decode))
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
        # ... and the workers serve on.
        r = asyncio.run(_one(server, key, model, victims[0]))
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0]
        assert_pools_drain(server, tenants[1]["admin"])


async def _one(server, key, model, prompt) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
        return await _complete(client, key, model, prompt)
