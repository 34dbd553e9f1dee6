"""Parity with the reference: the default model in float32, greedy, against Hugging Face
transformers running the same weights (loaded by transformers itself from the same GGUF).

Both sides get the same token ids (tokenized once) and produce exactly 48 tokens: we ignore
EOS, and the reference has no EOS to stop on. The reference's token choices are checked to be
the argmax of its raw logits, so no logits processor shaped them.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the hub

import pytest
import torch
from transformers import GenerationConfig

from engine_prompts import PROMPTS
from isoserve import LLM, SamplingParams
from isoserve.model.registry import DEFAULT_MODEL

NEW_TOKENS = 48
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def llm(isoserve_cache):
    return LLM(DEFAULT_MODEL, dtype="float32", cache_dir=str(isoserve_cache))


@pytest.fixture(scope="module")
def prompt_ids(llm):
    return [llm.tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def ours(llm, prompt_ids):
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    return llm.generate(prompt_ids, params)


@pytest.fixture(scope="module")
def reference(prompt_ids, transformers_smollm2):
    """(tokens [B, 48], raw-logit log-softmaxes [B, 48, vocab]) from transformers' generate."""
    model = transformers_smollm2
    # Plain greedy and nothing else: no EOS to stop on, no repetition penalty or other
    # processor. generate() fills unset fields from model.generation_config, so replace that too.
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=0,
                              eos_token_id=None, pad_token_id=0, repetition_penalty=1.0,
                              output_logits=True, return_dict_in_generate=True)
    shared_config, model.generation_config = model.generation_config, config  # the model is shared
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompt_ids])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompt_ids])
    try:
        with torch.inference_mode():
            out = model.generate(input_ids=input_ids, attention_mask=mask, generation_config=config)
    finally:
        model.generation_config = shared_config
    tokens = out.sequences[:, width:]
    logprobs = torch.log_softmax(torch.stack(out.logits, dim=1).float(), dim=-1)
    return tokens, logprobs


def test_reference_is_plain_greedy_over_48_tokens(reference, prompt_ids):
    tokens, logprobs = reference
    assert tokens.shape == (len(prompt_ids), NEW_TOKENS)
    assert torch.equal(tokens, logprobs.argmax(dim=-1))  # no processor changed a choice
    # At least one prompt's greedy continuation passes through EOS: the reference went on.
    assert (tokens == 2).any()


def test_prompts_are_varied(prompt_ids):
    lengths = sorted(len(p) for p in prompt_ids)
    assert len(prompt_ids) >= 16
    assert lengths[0] == 1 and lengths[-1] >= 150


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_greedy_tokens_match_transformers(ours, reference, prompt_ids, index):
    result = ours[index]
    expected = reference[0][index].tolist()
    assert result.prompt_token_ids == prompt_ids[index]
    assert result.finish_reason == "length"
    if result.token_ids != expected:
        step = next(i for i, (a, b) in enumerate(zip(result.token_ids, expected)) if a != b)
        top2 = reference[1][index, step].topk(2).values.tolist()
        pytest.fail(f"prompt {index}: first difference at step {step}: ours {result.token_ids[step]}, "
                    f"transformers {expected[step]} (reference top-2 margin {top2[0] - top2[1]:.2e})")


@pytest.mark.parametrize("index", range(len(PROMPTS)))
def test_logprobs_match_transformers(ours, reference, index):
    result = ours[index]
    ref_logprobs = reference[1][index]
    assert len(result.logprobs) == NEW_TOKENS
    for step, (token, lp) in enumerate(zip(result.token_ids, result.logprobs)):
        assert lp.token_id == token
        expected = float(ref_logprobs[step, token])
        assert abs(lp.logprob - expected) <= LOGPROB_TOLERANCE, (
            f"prompt {index} step {step} token {token}: ours {lp.logprob:.6f}, "
            f"transformers {expected:.6f}")
