"""A sequence's output text, kept up to date token by token.

Decoding a sequence's whole output again after each new token costs O(n) per token: on this
project's CPUs ~50 us at 128 tokens but ~770 us at 2,000, per sequence and step (at batch 32 and
long outputs, milliseconds of every step). tokenizers' `DecodeStream` turns each new token into
its new text at a constant cost. It holds back a token whose text ends in an incomplete UTF-8
character (`step` returns None) and gives it with the token that completes it.

So the text is the stream's text wherever the stream has just given some, and a full decode
wherever it holds something back. Either way it is exactly `tokenizer.decode(output,
skip_special_tokens=True)`, as when every step decoded everything (tests/test_detokenizer.py
checks that after every token, on random vocabulary, raw bytes, special tokens and multi-byte
text). Tokenizers the stream cannot stand in for always take the full decode: slow tokenizers
(no Rust backend) and those that clean up tokenization spaces after decoding.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream


class Detokenizer:
    """The engine's: one per tokenizer, starting each sequence's OutputText."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.backend = None if cleans_up else backend

    def new_stream(self) -> DecodeStream | None:
        """One sequence's stream (None: this tokenizer always decodes in full)."""
        return DecodeStream(skip_special_tokens=True) if self.backend is not None else None

    def start(self) -> OutputText:
        return OutputText(self)


class OutputText:
    """One sequence's: its stream and the text that stream has given so far."""

    def __init__(self, detokenizer: Detokenizer):
        self._detokenizer = detokenizer
        self._stream = detokenizer.new_stream()
        self._streamed = ""

    def after(self, output_token_ids: list[int]) -> str:
        """The output's text after its last token, which this has not seen yet."""
        if self._stream is not None:
            piece = self._stream.step(self._detokenizer.backend, output_token_ids[-1])
            if piece is not None:
                self._streamed += piece
                return self._streamed
        return self._detokenizer.tokenizer.decode(output_token_ids, skip_special_tokens=True)
