"""Session-wide fixtures shared by the engine tests: a private weights cache and a tiny model."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the hub

import pytest

import torch

from tiny_models import make_tiny_gguf, make_tiny_llama


@pytest.fixture(scope="session")
def isoserve_cache(tmp_path_factory):
    """Converted weights of the default model, shared by the tests of one run (never ~/.cache)."""
    return tmp_path_factory.mktemp("isoserve-cache")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random-weight Llama (GQA: 4 query heads, 2 KV heads) with SmolLM2's tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-engine"))


@pytest.fixture(scope="session")
def tiny_q4_1(tmp_path_factory, tiny_llama_dir):
    """tiny_llama_dir written as a GGUF with Q4_1 projections, as llama.cpp's converter would."""
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny-q4") / "tiny-q4_1.gguf", tiny_llama_dir, q4_1=True)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """Converted weights of the tiny GGUFs, shared by the tests of one run: each conversion
    builds the tokenizer from the GGUF again (~13 s on an AVX2-only 2-core VM)."""
    return tmp_path_factory.mktemp("tiny-cache")


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_q4_1, tiny_cache):
    """tiny_q4_1 loaded in bfloat16: its weights with their Q4_1 companions."""
    from isoserve.model.loader import load_checkpoint
    return load_checkpoint(str(tiny_q4_1), torch.bfloat16, tiny_cache)


@pytest.fixture(scope="session")
def transformers_smollm2():
    """The default model in float32 as transformers' own GGUF loader builds it (~17 s on 2
    cores): the reference for our weights (test_model_loading) and for greedy decoding
    (test_engine_parity), loaded once for both."""
    from transformers import AutoModelForCausalLM

    from isoserve.model.registry import DEFAULT_MODEL, resolve_model
    path = resolve_model(DEFAULT_MODEL).path
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 local_files_only=True)
    return model.eval()
