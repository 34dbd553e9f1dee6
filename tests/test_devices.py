"""The engine on each device this machine has (tiny_models.DEVICES: the CPU, and a GPU where there
is one) against transformers on the same device and weights: a tiny random Llama in float32,
greedy, a batch of prompts of different lengths run together through the paged KV cache.

On a GPU this is the check that the CUDA path (torch ops instead of the fused CPU kernels, the
pool and the step's index tensors on the device, the guard's metadata on the host) computes
the same model; bench/device_check.sh runs it there.
"""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the hub

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from isoserve import LLM, SamplingParams
from tiny_models import DEVICES

NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 23, 40)
LOGPROB_TOLERANCE = 1e-3


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(100, 40000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("device", DEVICES)
def test_engine_matches_transformers_on_each_device(tiny_llama_dir, device):
    prompts = _prompts()
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", device=device, page_size=4)
    ours = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                                logprobs=0))
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32,
                                                     local_files_only=True).to(device).eval()
    config = GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                              eos_token_id=None, pad_token_id=0, output_logits=True,
                              return_dict_in_generate=True)
    for prompt, result in zip(prompts, ours):
        assert result.error is None
        with torch.inference_mode():
            out = reference.generate(input_ids=torch.tensor([prompt], device=device),
                                     generation_config=config)
        assert result.token_ids == out.sequences[0, len(prompt):].tolist()
        theirs = [float(torch.log_softmax(step[0].float(), -1)[token])
                  for step, token in zip(out.logits, result.token_ids)]
        mine = [lp.logprob for lp in result.logprobs]
        assert max(abs(a - b) for a, b in zip(mine, theirs)) < LOGPROB_TOLERANCE
