"""Per-request sampling on a tiny random-weight Llama: seeds, temperature, top-k, top-p, stop
strings, stop token ids, EOS, max_tokens, logprobs, parameter validation and the chat template.

transformers runs the same tiny checkpoint as the reference for logits: our logprobs must match
its log-softmax, and every sampled token must lie inside the top-k / top-p set computed from it.
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from transformers import LlamaForCausalLM

from isoserve import LLM, SamplingParams
from isoserve.errors import InvalidRequest

PROMPTS = ["The weather today", "def add(a, b):", "Mei-Ling Zhang wrote", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32")


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, local_files_only=True)
    return model.eval()


def _reference_logits(reference, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab] logits the reference gives before each generated token."""
    ids = torch.tensor([prompt_ids + token_ids])
    with torch.inference_mode():
        logits = reference(input_ids=ids).logits[0].float()
    return logits[len(prompt_ids) - 1: len(prompt_ids) - 1 + len(token_ids)]


def _greedy(llm, prompt, max_tokens=24, **extra):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **extra)
    return llm.generate([prompt], params)[0]


def _assert_idle(llm):
    engine = llm.engine
    assert engine.allocator.num_free == engine.pool.num_pages and not engine.requests


# ---- seeds and temperature --------------------------------------------------------------------

def test_same_seed_same_tokens_across_runs_and_batch_compositions(llm):
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=1234)
    alone = llm.generate([PROMPTS[0]], seeded)[0].token_ids
    assert llm.generate([PROMPTS[0]], seeded)[0].token_ids == alone
    other = SamplingParams(max_tokens=16, temperature=0.8, seed=99)
    greedy = SamplingParams(max_tokens=5, temperature=0)
    mixed = llm.generate([PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0]], [other, seeded, greedy, seeded])
    assert mixed[1].token_ids == alone and mixed[3].token_ids == alone
    assert alone != _greedy(llm, PROMPTS[0], 16).token_ids


def test_different_seeds_give_different_tokens(llm):
    runs = {tuple(llm.generate([PROMPTS[0]], SamplingParams(max_tokens=16, temperature=1.0, seed=s))[0].token_ids)
            for s in range(4)}
    assert len(runs) == 4


def test_seeded_tokens_survive_preemption(tiny_llama_dir, llm):
    small = LLM(str(tiny_llama_dir), dtype="float32", kv_tokens=48, page_size=4)
    params = [SamplingParams(max_tokens=20, temperature=1.0, seed=10 + i, ignore_eos=True) for i in range(4)]
    batch = small.generate(PROMPTS, params)
    assert small.engine.scheduler.num_preemptions > 0
    assert [r.token_ids for r in batch] == [llm.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    _assert_idle(small)


def test_temperature_without_seed_varies(llm):
    torch.manual_seed(0)  # the unseeded path draws from torch's global generator
    params = SamplingParams(max_tokens=12, temperature=1.0)
    runs = {tuple(r.token_ids) for r in llm.generate([PROMPTS[0]] * 4, params)}
    runs |= {tuple(llm.generate([PROMPTS[0]], params)[0].token_ids)}
    assert len(runs) > 1


# ---- top-k / top-p ----------------------------------------------------------------------------

def test_top_k_1_and_tiny_top_p_equal_greedy(llm):
    greedy = [r.token_ids for r in llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0,
                                                                         ignore_eos=True))]
    for params in (SamplingParams(max_tokens=24, temperature=1.0, top_k=1, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=3.0, top_k=1, seed=5, ignore_eos=True),
                   SamplingParams(max_tokens=24, temperature=1.0, top_p=1e-6, seed=5, ignore_eos=True)):
        assert [r.token_ids for r in llm.generate(PROMPTS, params)] == greedy, params


def _allowed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> set[int]:
    """Tokens with non-zero probability under temperature, top-k then top-p (smallest prefix of
    the sorted distribution whose mass reaches top_p); ties at the boundary count as allowed."""
    scaled = logits / temperature
    if top_k > 0:
        kth = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled.double(), dim=-1)
    sorted_probs, order = probs.sort(descending=True)
    before = sorted_probs.cumsum(-1) - sorted_probs
    keep = (before < top_p + 1e-6) & (sorted_probs > 0)
    return set(order[keep].tolist())


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 3, 1.0), (0.05, -1, 0.5), (0.1, 8, 0.9),
                                                     (2.0, 20, 1.0)])
def test_sampled_tokens_lie_in_the_top_k_top_p_set(llm, reference, temperature, top_k, top_p):
    params = [SamplingParams(max_tokens=20, temperature=temperature, top_k=top_k, top_p=top_p,
                             seed=seed, ignore_eos=True) for seed in range(len(PROMPTS))]
    greedy_steps = 0
    for prompt, result in zip(PROMPTS, llm.generate(PROMPTS, params)):
        logits = _reference_logits(reference, result.prompt_token_ids, result.token_ids)
        for step, token in enumerate(result.token_ids):
            allowed = _allowed(logits[step], temperature, top_k, top_p)
            assert token in allowed, f"{prompt!r} step {step}: {token} outside {sorted(allowed)[:20]}"
            greedy_steps += token == int(logits[step].argmax())
    assert greedy_steps < len(PROMPTS) * 20  # it sampled, it did not just take the argmax


# ---- stopping ---------------------------------------------------------------------------------

def _first_completed(llm, tokens: list[int], stops: list[str]) -> int:
    """How many tokens were generated when the first stop string appeared in the text."""
    for n in range(1, len(tokens) + 1):
        if any(s in llm.tokenizer.decode(tokens[:n], skip_special_tokens=True) for s in stops):
            return n
    raise AssertionError(f"no stop string of {stops} in the text")


def test_stop_string_spanning_two_tokens_is_cut_from_the_text(llm):
    base = _greedy(llm, PROMPTS[0])
    text, tokens = base.text, base.token_ids
    cut = len(llm.tokenizer.decode(tokens[:4], skip_special_tokens=True))
    stop = text[cut - 2: cut + 2]  # the end of token 4 and the start of token 5
    assert stop.isascii() and stop.strip() and len(stop) == 4
    result = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0, stop=stop))[0]
    assert result.finish_reason == "stop"
    assert result.text == text[:text.find(stop)] and stop not in result.text
    assert result.token_ids == tokens[:_first_completed(llm, tokens, [stop])]
    _assert_idle(llm)


def test_earliest_of_several_stop_strings_ends_the_text(llm):
    base = _greedy(llm, PROMPTS[1])
    text, tokens = base.text, base.token_ids
    # Two stop strings inside one long token: both appear at the same step; the one earlier in
    # the text wins even though it is listed second.
    k = next(i for i in range(2, len(tokens)) if len(llm.tokenizer.decode([tokens[i]]).strip()) >= 5)
    start = len(llm.tokenizer.decode(tokens[:k], skip_special_tokens=True))
    piece = llm.tokenizer.decode(tokens[:k + 1], skip_special_tokens=True)[start:]
    early, late = piece[-4:-2], piece[-2:]
    stops = [late, early]
    expected_end = min(text.find(s) for s in stops)
    result = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0, stop=stops))[0]
    assert result.finish_reason == "stop"
    assert result.text == text[:expected_end]
    assert not any(s in result.text for s in stops)
    assert result.token_ids == tokens[:_first_completed(llm, tokens, stops)]


def test_stop_token_ids_end_the_request_with_that_token(llm):
    tokens = _greedy(llm, PROMPTS[2]).token_ids
    stop_token = tokens[6]
    end = tokens.index(stop_token) + 1
    result = _greedy(llm, PROMPTS[2], stop_token_ids=[stop_token])  # ignore_eos does not matter
    assert result.finish_reason == "stop" and result.token_ids == tokens[:end]


def test_eos_stops_unless_ignore_eos(llm, tiny_llama_dir, tmp_path):
    """A checkpoint whose generation_config names as EOS a token the model greedily produces."""
    tokens = _greedy(llm, PROMPTS[3]).token_ids
    eos = tokens[5]
    folder = shutil.copytree(tiny_llama_dir, tmp_path / "tiny-eos")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    with_eos = LLM(str(folder), dtype="float32")
    stopped = with_eos.generate([PROMPTS[3]], SamplingParams(max_tokens=24, temperature=0))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == tokens[:tokens.index(eos) + 1]
    ignored = with_eos.generate([PROMPTS[3]], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0]
    assert ignored.finish_reason == "length" and ignored.token_ids == tokens


@pytest.mark.parametrize("max_tokens", [1, 5, 17])
def test_max_tokens_gives_exactly_that_many_and_length(llm, max_tokens):
    full = _greedy(llm, PROMPTS[0], 17).token_ids
    result = _greedy(llm, PROMPTS[0], max_tokens)
    assert result.finish_reason == "length" and result.token_ids == full[:max_tokens]
    assert result.text == llm.tokenizer.decode(result.token_ids, skip_special_tokens=True)


# ---- logprobs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_give_k_alternatives_matching_the_reference(llm, reference, k):
    for temperature in (0.0, 0.7):
        params = SamplingParams(max_tokens=12, temperature=temperature, seed=3, logprobs=k, ignore_eos=True)
        result = llm.generate([PROMPTS[1]], params)[0]
        ref = torch.log_softmax(_reference_logits(reference, result.prompt_token_ids, result.token_ids), -1)
        assert len(result.logprobs) == len(result.token_ids) == 12
        for step, (token, lp) in enumerate(zip(result.token_ids, result.logprobs)):
            # The sampled token's logprob under the model's own distribution (before temperature).
            assert lp.token_id == token and lp.logprob <= 0
            assert abs(lp.logprob - float(ref[step, token])) < 1e-4
            assert len(lp.top) == k
            values = [v for _, v in lp.top]
            assert values == sorted(values, reverse=True)
            assert sum(math.exp(v) for v in values) <= 1 + 1e-5
            for token_id, value in lp.top:
                assert abs(value - float(ref[step, token_id])) < 1e-4
            if k:  # they really are the k most likely tokens
                assert values[-1] >= float(ref[step].topk(k).values[-1]) - 1e-4
                if temperature == 0:
                    assert lp.top[0] == (token, pytest.approx(lp.logprob))
        # Our logprobs are normalized over the whole vocabulary, as the reference's are.
        assert torch.allclose(torch.logsumexp(ref, -1), torch.zeros(len(ref)), atol=1e-5)


def test_no_logprobs_unless_asked(llm):
    assert _greedy(llm, PROMPTS[0], 4).logprobs is None


# ---- validation -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,param", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=1e39), "temperature"),  # finite in float64, inf in the sampler's float32
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(logprobs=99), "logprobs"),
    (dict(logprobs=-1), "logprobs"),
    (dict(top_k=-2), "top_k"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_invalid_sampling_params_are_refused_with_the_param(kwargs, param):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param and info.value.http_status == 400


def test_prompt_with_token_ids_outside_the_vocabulary_is_refused(llm):
    steps = llm.engine.stats.counters["steps"]
    vocab = llm.engine.model_config.vocab_size
    for bad in ([1, 2, vocab], [-1, 5]):
        with pytest.raises(InvalidRequest) as info:
            llm.generate([[10, 11], bad], SamplingParams(max_tokens=4))
        assert info.value.param == "prompt"
    assert llm.engine.stats.counters["steps"] == steps
    _assert_idle(llm)


# ---- chat -------------------------------------------------------------------------------------------

def test_chat_applies_the_models_chat_template(llm):
    conversation = [{"role": "system", "content": "You are terse."},
                    {"role": "user", "content": "Name a prime number."}]
    expected_ids = llm.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                     tokenize=True)["input_ids"]
    assert expected_ids[0] == llm.tokenizer.convert_tokens_to_ids("<|im_start|>")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    result = llm.chat(conversation, params)
    assert result.prompt_token_ids == expected_ids
    assert result.token_ids == llm.generate([expected_ids], params)[0].token_ids
    second = [{"role": "user", "content": "And another?"}]
    both = llm.chat([conversation, second], params)
    assert [r.prompt_token_ids for r in both] == [
        expected_ids,
        llm.tokenizer.apply_chat_template(second, add_generation_prompt=True, tokenize=True)["input_ids"]]
