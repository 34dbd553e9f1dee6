"""The incremental detokenizer gives, after every token, exactly what decoding the whole output
gives (engine/detokenizer.py): on the default model's real tokenizer, over random vocabulary,
raw byte tokens (broken UTF-8), special tokens and multi-byte text."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from isoserve.engine.detokenizer import Detokenizer
from isoserve.model.registry import DEFAULT_MODEL, resolve_model
from isoserve.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(DEFAULT_MODEL))


def _token_lists(tokenizer):
    vocab = st.integers(0, len(tokenizer) - 1)
    raw_bytes = st.integers(0, 255)  # the byte-level alphabet: most are parts of a character
    special = st.sampled_from(sorted(tokenizer.all_special_ids))
    text = st.text(alphabet="héllo wörld 日本語テスト🙂ñ .,", min_size=1, max_size=40).map(
        lambda s: tokenizer.encode(s, add_special_tokens=False))
    mixed = st.lists(st.one_of(vocab, raw_bytes, special), min_size=1, max_size=40)
    return st.one_of(mixed, text.filter(bool))


def _check_every_step(tokenizer, ids):
    detok = Detokenizer(tokenizer)
    assert detok.new_stream() is not None  # the default model's tokenizer takes the fast path
    output = detok.start()
    for n in range(1, len(ids) + 1):
        text = output.after(ids[:n])
        assert text == tokenizer.decode(ids[:n], skip_special_tokens=True), (ids[:n], text)


def test_the_text_after_every_token_is_the_full_decode(tokenizer):
    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_token_lists(tokenizer))
    def check(ids):
        _check_every_step(tokenizer, ids)
    check()


def test_a_character_split_over_tokens_is_held_back_then_given_whole(tokenizer):
    """'🙂' is four bytes; as raw byte tokens the stream holds the first three and the text is
    the full decode's (replacement characters), then the fourth completes it."""
    ids = tokenizer.encode("ok 🙂 done", add_special_tokens=False)
    _check_every_step(tokenizer, ids)
    output = Detokenizer(tokenizer).start()
    texts = [output.after(ids[:n]) for n in range(1, len(ids) + 1)]
    assert texts[-1] == "ok 🙂 done"


def test_a_tokenizer_that_cleans_up_spaces_always_decodes_in_full(tokenizer):
    class CleaningUp:
        clean_up_tokenization_spaces = True
        backend_tokenizer = tokenizer.backend_tokenizer
        decode = staticmethod(tokenizer.decode)
    assert Detokenizer(CleaningUp()).new_stream() is None
