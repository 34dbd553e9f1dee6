"""What a probe run is made of: the prompts it planned and the requests it sent."""
from __future__ import annotations

from dataclasses import dataclass, field

from isoserve.probe.canaries import Canary
from isoserve.probe.http import Completion


@dataclass
class Prompt:
    id: str              # "ordinary-1", "limit+1", "pool+1@320", "attack@700", "victim-1.2", ...
    role: str            # victim | attacker
    kind: str            # victim | ordinary | limit-fit | limit-1 | limit | limit+1 | far-above | pool+1 | attack
    payload: list[int] | str
    length: int          # tokens: exact for token ids, an estimate for text
    exact: bool
    max_tokens: int
    owner: str = ""      # victims: the tenant whose prompt it is
    canaries: list[Canary] = field(default_factory=list)
    over_limit: bool = False   # the prompt alone is above the advertised limit
    fits: bool = True          # prompt + max_tokens are within the advertised limit

    def to_json(self) -> dict:
        head = self.payload[:8] if isinstance(self.payload, list) else self.payload[:120]
        return {"id": self.id, "role": self.role, "kind": self.kind, "length": self.length,
                "exact_length": self.exact, "max_tokens": self.max_tokens, "owner": self.owner or None,
                "over_limit": self.over_limit, "fits": self.fits, "head": head,
                "canaries": len(self.canaries)}


@dataclass
class Record:
    """One request the probe sent, and how it ended."""
    n: int
    scenario: str        # discover | baseline | limit | pools | abort | mixed
    phase: str           # idle-1 / idle-2 (baseline), victims, attack, abort, after-abort, load
    prompt: Prompt
    tenant: str          # "victim-1", "attacker-3": the key's place on the command line
    stream: bool
    abort: str | None    # prefill | stream: closed on purpose
    result: Completion
    started: float       # seconds since the run began

    def to_json(self) -> dict:
        return {"n": self.n, "scenario": self.scenario, "phase": self.phase, "prompt": self.prompt.id,
                "tenant": self.tenant, "stream": self.stream, "abort": self.abort,
                "started_s": round(self.started, 3), **self.result.to_json()}


def idle_results(records: list[Record], prompt: Prompt) -> list[Completion]:
    """The prompt's successful runs alone on the idle server, in order."""
    return [r.result for r in records if r.prompt is prompt and r.scenario == "baseline" and r.result.ok]
