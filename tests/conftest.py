"""Session-wide fixtures shared by the engine tests: a private weights cache and a tiny model."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the hub

import pytest

from tiny_models import make_tiny_llama


@pytest.fixture(scope="session")
def isoserve_cache(tmp_path_factory):
    """Converted weights of the default model, shared by the tests of one run (never ~/.cache)."""
    return tmp_path_factory.mktemp("isoserve-cache")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny random-weight Llama (GQA: 4 query heads, 2 KV heads) with SmolLM2's tokenizer."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-engine"))
