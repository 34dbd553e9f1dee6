"""Per-request sampling parameters, validated when created so a bad value fails at once."""
from __future__ import annotations

from dataclasses import dataclass, field

from isoserve.errors import InvalidRequest

MAX_LOGPROBS = 20
# A positive temperature below this is sampled greedily, its limit: dividing logits by ~1e-300
# overflows to inf and the distribution becomes NaN.
MIN_TEMPERATURE = 1e-5
# The largest temperature: the sampler divides by it in float32, where anything above is inf
# (and the distribution, every token at weight 1 or NaN, no longer one the sampler can draw from).
MAX_TEMPERATURE = 3.4028234663852886e38


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: no top-k
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token's plus top-k

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or [])]
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        _check(0 <= self.temperature <= MAX_TEMPERATURE, "temperature",
               f"temperature must be >= 0 and finite in float32, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(isinstance(self.top_k, int) and (self.top_k >= 1 or self.top_k in (0, -1)), "top_k",
               f"top_k must be -1 (disabled) or >= 1, got {self.top_k!r}")
        _check(self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS, "logprobs",
               f"logprobs must be between 0 and {MAX_LOGPROBS}, got {self.logprobs}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop",
               "stop must be a non-empty string or a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def to_dict(self) -> dict:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                    top_k=self.top_k, seed=self.seed, stop=list(self.stop),
                    stop_token_ids=list(self.stop_token_ids), ignore_eos=self.ignore_eos,
                    logprobs=self.logprobs)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(message, param=param)
