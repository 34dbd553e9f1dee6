"""Batching does not change what a request computes: the parity prompts give the same greedy
tokens one at a time, all together, arriving step by step, with prefills split by a small
per-step token budget, and in a pool small enough to force preemption by recompute.

And a request that can never fit ends at once with an explicit error; no prompt is truncated.
"""
from __future__ import annotations

import pytest

from engine_prompts import PROMPTS
from isoserve import LLM, SamplingParams
from isoserve.errors import ContextLengthExceeded
from isoserve.model.registry import DEFAULT_MODEL

# 16 new tokens keep the one-at-a-time run affordable on 2 cores (parity checks 48); with
# 16-token pages every request still starts a new page while decoding.
NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
SMALL_POOL = dict(kv_tokens=256, page_size=4)  # any one prompt fits; all of them together do not


def _llm(cache, **options) -> LLM:
    return LLM(DEFAULT_MODEL, dtype="float32", cache_dir=str(cache), **options)


@pytest.fixture(scope="module")
def llm(isoserve_cache):
    return _llm(isoserve_cache)


@pytest.fixture(scope="module")
def small_pool_llm(isoserve_cache):
    return _llm(isoserve_cache, **SMALL_POOL)


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def together(llm, prompt_ids):
    results = llm.generate(prompt_ids, GREEDY)
    assert all(r.finish_reason == "length" and len(r.token_ids) == NEW_TOKENS for r in results)
    return [r.token_ids for r in results]


def _assert_same_tokens(got: list[list[int]], expected: list[list[int]]) -> None:
    diffs = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    assert len(got) == len(expected) and not diffs, f"prompts whose tokens differ: {diffs}"


def _assert_pool_idle(llm: LLM) -> None:
    engine = llm.engine
    assert engine.allocator.num_free == engine.pool.num_pages
    assert not engine.requests and not engine.scheduler.has_work()


def test_one_at_a_time_equals_all_together(llm, prompt_ids, together):
    alone = [llm.generate([ids], GREEDY)[0].token_ids for ids in prompt_ids]
    _assert_same_tokens(alone, together)
    _assert_pool_idle(llm)


def test_requests_joining_at_every_step_equal_all_together(llm, prompt_ids, together):
    """Continuous batching: request i arrives at step i and each leaves when it is done."""
    engine = llm.engine
    tokens: dict[str, list[int]] = {}
    finished = set()
    pending = list(enumerate(prompt_ids))
    while pending or engine.has_work():
        if pending:
            i, ids = pending.pop(0)
            engine.add_request(f"join-{i}", ids, GREEDY)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.error is None and out.finish_reason == "length"
                finished.add(out.request_id)
    assert finished == {f"join-{i}" for i in range(len(prompt_ids))}
    _assert_same_tokens([tokens[f"join-{i}"] for i in range(len(prompt_ids))], together)
    _assert_pool_idle(llm)


def test_prefills_split_by_a_small_token_budget_equal_all_together(isoserve_cache, prompt_ids, together):
    llm = _llm(isoserve_cache, max_batched_tokens=24)
    results = llm.generate(prompt_ids, GREEDY)
    _assert_same_tokens([r.token_ids for r in results], together)
    # No step computed more than 24 tokens (the default budget needs about 50 steps).
    computed = sum(len(p) for p in prompt_ids) + len(prompt_ids) * (NEW_TOKENS - 1)
    assert llm.engine.stats.counters["steps"] >= computed / 24
    _assert_pool_idle(llm)


def test_preemption_by_recompute_equals_all_together(small_pool_llm, prompt_ids, together):
    llm = small_pool_llm
    before = llm.engine.scheduler.num_preemptions
    results = llm.generate(prompt_ids, GREEDY)
    assert llm.engine.scheduler.num_preemptions > before, "the pool was meant to force preemption"
    _assert_same_tokens([r.token_ids for r in results], together)
    _assert_pool_idle(llm)


def _long_prompt(llm: LLM, n: int) -> list[int]:
    base = llm.tokenizer.encode(PROMPTS[-2] + " " + PROMPTS[-1])
    ids = (base * (n // len(base) + 1))[:n]
    assert len(ids) == n
    return ids


def _assert_rejected_at_once(llm: LLM, prompts: list[list[int]], max_tokens: int) -> None:
    steps = llm.engine.stats.counters["steps"]
    with pytest.raises(ContextLengthExceeded) as info:
        llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
    assert info.value.param == "prompt" and info.value.http_status == 400
    assert llm.engine.stats.counters["steps"] == steps, "nothing may run for a rejected batch"
    _assert_pool_idle(llm)


def test_prompt_over_the_pool_is_rejected_at_once(small_pool_llm):
    llm = small_pool_llm
    capacity = llm.engine.capacity_tokens
    assert capacity == 256
    # prompt + max_tokens one over the pool; the prompt alone fits.
    _assert_rejected_at_once(llm, [_long_prompt(llm, capacity - 16 + 1)], max_tokens=16)
    # A batch with one such request is refused as a whole before anything runs.
    _assert_rejected_at_once(llm, [[1, 2, 3], _long_prompt(llm, capacity + 5), [4, 5]], max_tokens=4)


def test_prompt_over_the_context_is_rejected_at_once(llm):
    context = llm.engine.context_length
    assert context == 8192 and llm.engine.capacity_tokens > context
    _assert_rejected_at_once(llm, [_long_prompt(llm, 100)], max_tokens=context - 99)
    _assert_rejected_at_once(llm, [_long_prompt(llm, context + 1)], max_tokens=1)


def test_prompt_at_the_limit_runs_whole(small_pool_llm):
    llm = small_pool_llm
    limit = llm.engine.prompt_limit(8)
    assert limit == llm.engine.capacity_tokens - 8
    ids = _long_prompt(llm, limit)
    result = llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    assert result.error is None and result.finish_reason == "length"
    assert result.prompt_token_ids == ids and len(result.token_ids) == 8  # nothing was cut
    _assert_pool_idle(llm)
    _assert_rejected_at_once(llm, [_long_prompt(llm, limit + 1)], max_tokens=8)
