"""Seeded synthetic requests that any server tokenizes to about the lengths asked for.

Prompts are text, not token ids, so one workload runs against any OpenAI-compatible server.
Each prompt is a seeded random sequence of common English words, each of which is a single
token (with its leading space) in SmolLM2's vocabulary and in most BPE vocabularies. Random
words also keep prompts distinct, so no prefix cache makes one request cheaper than another.
A calibration against the server (calibrate.py) turns a token target into a word count; the
lengths the server really saw come back in each response's `usage` and are what gets reported.

Length distributions:

    fixed          every request has prompt_tokens and output_tokens.
    sharegpt-like  lognormal lengths with the long right tail of chat logs such as ShareGPT:
                   prompt: median 120 tokens, sigma 1.0, clipped to [4, 1024] (mean ~200);
                   output: median 128 tokens, sigma 0.9, clipped to [4, 1024] (mean ~190).
                   These are round numbers in the range serving benchmarks report for
                   ShareGPT, not a fit to the data set. Prompt + output is also clipped to
                   the server's max_model_len when it advertises one.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

# All single tokens with a leading space in SmolLM2's vocabulary (checked when this was written).
WORDS = """
time year people way day man thing woman life child world school state family student group
country problem hand part place case week company system program question work government number
night point home water room mother area money story fact month lot right study book eye job word
business issue side kind head house service friend father power hour game line end member law car
city community name president team minute idea kid body information back parent face others level
office door health person art war history party result change morning reason research girl guy
moment air teacher force education foot boy age policy music market sense nation plan college
interest death experience effect class control care field development role effort rate heart drug
show leader light voice wife police mind price report decision son view relationship town road arm
difference value building action model season society tax director position player record paper
space ground form event official matter center couple site project activity star table need court
oil situation cost industry figure street image phase stock land river garden bread window green
blue red small large early late young old long short high low open simple strong clear happy quiet
bright warm cold fresh quick slow soft hard rich poor free full deep wide near far walk talk run
read write sing play build carry bring keep hold turn move stand sit wait watch listen learn teach
grow cook clean paint draw send pay buy sell share start stop follow lead help ask answer call meet
visit travel stay leave return arrive
""".split()

SHAREGPT_PROMPT = (120, 1.0, 4, 1024)  # median, sigma, min, max
SHAREGPT_OUTPUT = (128, 0.9, 4, 1024)


@dataclass(frozen=True)
class RequestSpec:
    index: int
    prompt_tokens: int   # the target; the server's usage says what it really was
    output_tokens: int   # sent as max_tokens
    words: tuple[str, ...]

    @property
    def prompt(self) -> str:
        return " ".join(self.words)


def random_words(rng: random.Random, count: int) -> list[str]:
    return rng.choices(WORDS, k=count)


def lengths(dataset: str, count: int, rng: random.Random, prompt_tokens: int, output_tokens: int,
            max_model_len: int | None = None) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) for each request."""
    if dataset == "fixed":
        return [(prompt_tokens, output_tokens)] * count
    if dataset != "sharegpt-like":
        raise ValueError(f"unknown dataset {dataset!r}: use fixed or sharegpt-like")
    pairs = []
    for _ in range(count):
        p, o = _lognormal(rng, *SHAREGPT_PROMPT), _lognormal(rng, *SHAREGPT_OUTPUT)
        if max_model_len and p + o > max_model_len:
            o = max(1, min(o, max_model_len // 4))
            p = max(1, min(p, max_model_len - o))
        pairs.append((p, o))
    return pairs


def _lognormal(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(high, max(low, round(rng.lognormvariate(math.log(median), sigma)))))


def build_requests(pairs: list[tuple[int, int]], words_for_tokens, seed: int) -> list[RequestSpec]:
    """One RequestSpec per (prompt, output) pair; words_for_tokens(n) is the calibrated word count."""
    rng = random.Random(seed)
    return [RequestSpec(i, p, o, tuple(random_words(rng, words_for_tokens(p))))
            for i, (p, o) in enumerate(pairs)]
