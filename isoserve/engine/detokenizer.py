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
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleans_up = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self._backend = None if cleans_up else backend

    def new_stream(self) -> DecodeStream | None:
        """One sequence's stream (None: this tokenizer always decodes in full)."""
        return DecodeStream(skip_special_tokens=True) if self._backend is not None else None

    def text_after(self, output_token_ids: list[int], stream: DecodeStream | None,
                   streamed: str) -> tuple[str, str]:
        """(the output's text, the stream's text so far) after the last of output_token_ids,
        which the stream has not seen yet; `streamed` is the stream's text before it."""
        if stream is not None:
            piece = stream.step(self._backend, output_token_ids[-1])
            if piece is not None:
                streamed += piece
                return streamed, streamed
        return self.tokenizer.decode(output_token_ids, skip_special_tokens=True), streamed
