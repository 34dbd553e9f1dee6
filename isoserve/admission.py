"""The one admission limit (DESIGN invariant 1).

Every layer -- the LLM API, the router, each prefill and decode worker -- asks this module
whether a prompt may enter, so no layer can have a looser idea of "fits" than another.
"""
from __future__ import annotations

from collections.abc import Iterable

from isoserve.errors import ContextLengthExceeded


def effective_prompt_limit(context_length: int, prefill_pool_tokens: Iterable[int],
                           decode_pool_tokens: Iterable[int], max_tokens: int = 0) -> int:
    """Longest prompt a request with `max_tokens` new tokens can have.

    The request occupies one prefill pool (its prompt) and one decode pool (prompt plus
    everything it generates), and must fit the model context. We take the smallest pool of
    each group because the router may pick any worker of the group. An engine keeps room for
    every token a request may generate, and a prefill engine runs the prompt as a request for
    its first token: a prefill pool must hold the prompt plus one token (max_tokens=0, as for
    max_model_len, asks only what the pools hold).
    """
    prefill = list(prefill_pool_tokens)
    decode = list(decode_pool_tokens)
    limit = context_length - max_tokens
    if prefill:
        limit = min(limit, min(prefill) - min(max_tokens, 1))
    if decode:
        limit = min(limit, min(decode) - max_tokens)
    return max(limit, 0)


def check_prompt_fits(prompt_len: int, limit: int, max_tokens: int = 0) -> None:
    """Raise ContextLengthExceeded for a prompt over the limit; a rejection ends the request."""
    if prompt_len <= 0:
        raise ContextLengthExceeded("prompt is empty: at least one token is required",
                                    param="prompt")
    if prompt_len > limit:
        raise ContextLengthExceeded(
            f"This model's maximum context length allows a prompt of {limit} tokens with "
            f"max_tokens={max_tokens}, but the prompt has {prompt_len} tokens. "
            "Shorten the prompt or lower max_tokens.",
            # When max_tokens alone leaves no room, it is the value to fix.
            param="prompt" if limit > 0 else "max_tokens")
