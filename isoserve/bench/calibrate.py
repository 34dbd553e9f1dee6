"""How many prompt tokens a server makes of N of our words: tokens = offset + per_word x N.

Two probe prompts of different lengths, each with max_tokens=1, read `usage.prompt_tokens`;
the offset covers what the server adds (a BOS token, say). Without usage, assume one token per
word and say so.
"""
from __future__ import annotations

import json
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from isoserve.bench.workload import random_words

PROBE_WORDS = (32, 160)


@dataclass(frozen=True)
class Calibration:
    offset: float = 0.0
    per_word: float = 1.0
    measured: bool = False

    def words_for(self, tokens: int) -> int:
        return max(1, round((tokens - self.offset) / self.per_word))


# POSTs a JSON body to /v1/completions and returns (HTTP status, response text): the caller's
# client, whichever it is (the load generator's aiohttp session, the soak's httpx client).
PostJson = Callable[[dict], Awaitable[tuple[int, str]]]


async def calibrate(post: PostJson, model: str, seed: int) -> Calibration:
    rng = random.Random(seed ^ 0xCA1)
    counts = []
    for n in PROBE_WORDS:
        body = {"model": model, "prompt": " ".join(random_words(rng, n)), "max_tokens": 1,
                "temperature": 0}
        status, text = await post(body)
        if status != 200:
            raise RuntimeError(f"calibration request failed: HTTP {status}: {text[:500]}")
        tokens = (json.loads(text).get("usage") or {}).get("prompt_tokens")
        if not tokens:
            print("calibration: the server reports no usage.prompt_tokens; assuming one token per word")
            return Calibration()
        counts.append(tokens)
    per_word = (counts[1] - counts[0]) / (PROBE_WORDS[1] - PROBE_WORDS[0])
    if per_word <= 0:
        return Calibration()
    return Calibration(counts[0] - per_word * PROBE_WORDS[0], per_word, measured=True)
