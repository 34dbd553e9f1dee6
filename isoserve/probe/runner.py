"""The probe's run: discover the server, plan prompts, measure each alone, attack, judge.

    discover   /v1/models with every key: the model, its advertised limit (max_model_len);
               whether the server takes prompts as token ids (exact lengths) or needs text
    plan       victim prompts full of canaries (fresh per run); attacker prompts at the limit
               -1, exactly, +1 and far above, just above each pool size, and ordinary ones
    baseline   every prompt alone on the idle server, twice (plain, then streamed): the
               reference output and the noise floor, before any victim has sent anything
    scenarios  each starts with a round of victim traffic (enough to write every pool over),
               then:  limit  -- the limit prompts, one at a time
                      pools  -- the pool-boundary (and --attack-tokens) prompts, one at a time
                      abort  -- requests closed mid-prefill and mid-stream, then every prompt again
                      mixed  -- --requests requests from all tenants at once, victims and
                                attackers interleaved, a third of them streamed
    judge      the oracles (oracles.py) over every request

Tenants: victims send only canary prompts, each with its own key; attackers send everything
else, their keys in turn. The differential oracle also watches victims' own outputs: a victim's
answer computed from someone else's data is a leak in the other direction.
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

from isoserve.probe import SCENARIOS
from isoserve.probe.canaries import FUZZY_THRESHOLD, victim_prompt
from isoserve.probe.http import Completion, Endpoint, ProbeError
from isoserve.probe.oracles import UNAVAILABLE, Finding, Judge
from isoserve.probe.records import Prompt, Record, idle_results

MAX_FAR_ABOVE_EXTRA = 65536  # "far above" is 4x the limit, but at most this much above it
UNAVAILABLE_WAIT_S = 30.0    # how long a request waits out an unavailable server (a restart)


@dataclass
class Options:
    scenarios: tuple[str, ...] = SCENARIOS
    pool_tokens: list[int] = field(default_factory=list)
    attack_tokens: list[int] = field(default_factory=list)
    requests: int = 24              # mixed-load requests
    concurrency: int = 32
    max_tokens: int = 16
    victim_tokens: int = 200
    victim_prompts: int = 0         # per victim; 0: enough to write the largest pool over once
    top_logprobs: int = 5
    tolerance: float = 0.15         # nats, on top of the measured noise floor
    fuzzy_threshold: float = FUZZY_THRESHOLD
    timeout: float = 120.0
    max_model_len: int | None = None
    token_id_range: tuple[int, int] = (1000, 30000)
    force_text: bool = False
    seed: int | None = None
    retries: int = 2                # extra tries for an idle run that fails (faults, restarts)


@dataclass
class RunResult:
    info: dict
    prompts: list[Prompt]
    records: list[Record]
    findings: list[Finding]
    notes: list[str]


class Probe:
    def __init__(self, endpoint: Endpoint, keys: list[str], victims: list[int], attackers: list[int],
                 options: Options, log=print):
        if not victims or not attackers:
            raise ProbeError("the probe needs at least one victim key and one attacker key")
        self.ep = endpoint
        self.keys = keys
        self.victims = victims
        self.attackers = attackers
        self.opt = options
        self.log = log
        self.seed = options.seed if options.seed is not None else time.time_ns() % 2**32
        self.rng = random.Random(self.seed)
        self.records: list[Record] = []
        self.notes: list[str] = []
        self.limit: int | None = None
        self.token_ids = True
        self.exact = True
        self.per_word = 1.0
        self.chars_per_token = 1.4  # canary-dense text, until measured
        self.prompts: list[Prompt] = []
        self._attacker_turn = 0
        self._t0 = time.perf_counter()
        self._sem = asyncio.Semaphore(options.concurrency)

    # ---- the run --------------------------------------------------------------------------
    async def run(self) -> RunResult:
        await self.discover()
        self.plan()
        self.log(f"probe: {len(self.prompts)} prompts ({sum(p.role == 'victim' for p in self.prompts)} victim), "
                 f"limit={self.limit}, prompts as {'token ids' if self.token_ids else 'text'}, seed={self.seed}")
        await self.baseline()
        for name in self.opt.scenarios:
            self.log(f"probe: scenario {name}")
            await getattr(self, f"scenario_{name}")()
        findings = self.judge()
        info = {"base_url": self.ep.base_url, "model": self.ep.model, "seed": self.seed,
                "max_model_len": self.limit, "pool_tokens": self.opt.pool_tokens,
                "prompt_format": "token_ids" if self.token_ids else "text", "exact_lengths": self.exact,
                "victims": [self.tenant(i) for i in self.victims],
                "attackers": [self.tenant(i) for i in self.attackers],
                "scenarios": list(self.opt.scenarios), "max_tokens": self.opt.max_tokens,
                "tolerance": self.opt.tolerance, "seconds": round(time.perf_counter() - self._t0, 2)}
        return RunResult(info, self.prompts, self.records, findings, self.notes)

    def tenant(self, key_index: int) -> str:
        role = "victim" if key_index in self.victims else "attacker"
        return f"{role}-{key_index + 1}"

    # ---- discover -------------------------------------------------------------------------
    async def discover(self) -> None:
        cards = None
        for i, key in enumerate(self.keys):
            status, data = await self.ep.get_json("/v1/models", key)
            if status != 200 or not isinstance(data, dict):
                raise ProbeError(f"key #{i + 1} ({self.tenant(i)}) is not accepted by GET /v1/models: "
                                 f"HTTP {status} {str(data)[:200]}")
            cards = cards or data.get("data") or []
        ids = [c.get("id") for c in cards if isinstance(c, dict)]
        if self.ep.model is None:
            if not ids:
                raise ProbeError("/v1/models lists no model; pass --model")
            self.ep.model = ids[0]
        elif ids and self.ep.model not in ids:
            raise ProbeError(f"model {self.ep.model!r} is not served here; /v1/models lists {ids}")
        card = next((c for c in cards if isinstance(c, dict) and c.get("id") == self.ep.model), {})
        self.limit = self.opt.max_model_len or _advertised_limit(card)
        if self.limit is None:
            status, props = await self.ep.get_json("/props", self.keys[0])  # llama.cpp's server
            if status == 200 and isinstance(props, dict):
                self.limit = (props.get("default_generation_settings") or {}).get("n_ctx")
        if self.limit is None:
            self.notes.append("the server advertises no context limit (max_model_len) and none was given "
                              "with --max-model-len: the limit scenario and the limit oracles are off")
        await self._prompt_format()
        await self._calibrate_victim_text()

    async def _prompt_format(self) -> None:
        """Token-id prompts give exact lengths; fall back to text where the server refuses them."""
        if not self.opt.force_text:
            ids = self.random_ids(8)
            r = (await self._until_answered(lambda: self._discover_request("format-check", ids), True)).result
            if r.ok:
                if r.prompt_tokens is not None and r.prompt_tokens != len(ids):
                    self.exact = False
                    self.notes.append(f"the server counted {r.prompt_tokens} tokens for 8 token ids: "
                                      "lengths are not exact")
                return
            if r.status is None or not 400 <= r.status < 500:
                raise ProbeError(f"a minimal completion failed: {r.outcome} {r.status} "
                                 f"{r.error_code or ''} {r.error_message or r.detail}")
            self.notes.append(f"token-id prompts refused (HTTP {r.status}: {r.error_message or r.detail}); "
                              "using text, whose lengths are estimates")
        self.token_ids = False
        self.exact = False
        counts = []
        for words in (32, 160):
            text = self.random_words(words)
            r = (await self._until_answered(lambda: self._discover_request("calibrate", text), True)).result
            if not r.ok:
                raise ProbeError(f"a minimal text completion failed: {r.outcome} {r.status} "
                                 f"{r.error_message or r.detail}")
            counts.append(r.prompt_tokens)
        if None not in counts and counts[1] > counts[0]:
            self.per_word = (counts[1] - counts[0]) / 128
        else:
            self.notes.append("no usage.prompt_tokens: assuming one token per word")

    async def _discover_request(self, pid: str, payload, key_index: int | None = None) -> Record:
        key_index = self.attackers[0] if key_index is None else key_index
        started = time.perf_counter() - self._t0
        r = await self.ep.complete(self.keys[key_index], payload, 1)
        return self._record("discover", "discover", _scratch(pid, payload), key_index, r, started=started)

    async def _calibrate_victim_text(self) -> None:
        """Characters per token of canary-dense text, from one throwaway record set (its
        canaries are never used), so victim prompts come out near --victim-tokens."""
        text, _ = victim_prompt(random.Random(self.seed ^ 0x5EED), "calibration", self.opt.victim_tokens,
                                self.chars_per_token)
        r = (await self._until_answered(lambda: self._discover_request("calibrate-victim-text", text,
                                                                       self.victims[0]), True)).result
        if r.ok and r.prompt_tokens:
            self.chars_per_token = len(text) / r.prompt_tokens
        else:
            self.notes.append("could not measure the tokens of victim text: victim prompt lengths are rough")

    # ---- plan -----------------------------------------------------------------------------
    def random_ids(self, n: int) -> list[int]:
        lo, hi = self.opt.token_id_range
        return [self.rng.randrange(lo, hi) for _ in range(n)]

    def random_words(self, n: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(n))

    def attacker_prompt(self, pid: str, kind: str, length: int, max_tokens: int) -> Prompt:
        if self.token_ids:
            payload: list[int] | str = self.random_ids(length)
        else:
            payload = self.random_words(max(1, round(length / self.per_word)))
        p = Prompt(pid, "attacker", kind, payload, length, self.exact, max_tokens)
        if self.limit is not None:
            p.over_limit = length > self.limit
            p.fits = length + max_tokens <= self.limit
        return p

    def plan(self) -> None:
        m = self.opt.max_tokens
        prompts = []
        # Ordinary attacker prompts: the bulk of a real tenant's traffic.
        top = min(256, max(16, (self.limit or 512) // 2))
        for i in range(2):
            prompts.append(self.attacker_prompt(f"ordinary-{i + 1}", "ordinary", self.rng.randrange(16, top + 1), m))
        if "limit" in self.opt.scenarios and self.limit is not None:
            L = self.limit
            if L - m >= 1:
                prompts.append(self.attacker_prompt("limit-fit", "limit-fit", L - m, m))
            prompts += [self.attacker_prompt("limit-1", "limit-1", L - 1, 1),
                        self.attacker_prompt("limit", "limit", L, 1),
                        self.attacker_prompt("limit+1", "limit+1", L + 1, 1),
                        self.attacker_prompt("far-above", "far-above", min(4 * L, L + MAX_FAR_ABOVE_EXTRA), 1)]
        if "pools" in self.opt.scenarios:
            for pool in sorted(set(self.opt.pool_tokens)):
                prompts.append(self.attacker_prompt(f"pool+1@{pool}", "pool+1", pool + 1, m))
            for n in sorted(set(self.opt.attack_tokens)):
                prompts.append(self.attacker_prompt(f"attack@{n}", "attack", n, m))
        victims = []
        per_victim = self.opt.victim_prompts or self._victim_prompts_needed()
        for v in self.victims:
            owner = self.tenant(v)
            for j in range(per_victim):
                text, canaries = victim_prompt(self.rng, owner, self.opt.victim_tokens, self.chars_per_token)
                p = Prompt(f"{owner}.{j + 1}", "victim", "victim", text, self.opt.victim_tokens, False, m,
                           owner=owner, canaries=canaries)
                victims.append(p)
        self.prompts = prompts + victims

    def _victim_prompts_needed(self) -> int:
        """Enough victim prompts that one round writes the largest pool over (at most 16 each)."""
        fill = max(self.opt.pool_tokens) if self.opt.pool_tokens else min(self.limit or 2048, 8192)
        return max(1, min(16, math.ceil(fill / (self.opt.victim_tokens * len(self.victims))) + 1))

    @property
    def victim_prompts(self) -> list[Prompt]:
        return [p for p in self.prompts if p.role == "victim"]

    def attack_prompts(self, *kinds: str) -> list[Prompt]:
        return [p for p in self.prompts if p.role == "attacker" and (not kinds or p.kind in kinds)]

    # ---- requests -------------------------------------------------------------------------
    def _record(self, scenario: str, phase: str, prompt: Prompt, key_index: int, result: Completion,
                stream: bool = False, abort: str | None = None, started: float = 0.0) -> Record:
        rec = Record(len(self.records) + 1, scenario, phase, prompt, self.tenant(key_index), stream, abort,
                     result, started)
        self.records.append(rec)
        return rec

    def next_attacker(self) -> int:
        k = self.attackers[self._attacker_turn % len(self.attackers)]
        self._attacker_turn += 1
        return k

    def key_for(self, prompt: Prompt) -> int:
        if prompt.role == "victim":
            return next(i for i in self.victims if self.tenant(i) == prompt.owner)
        return self.next_attacker()

    async def send(self, scenario: str, phase: str, prompt: Prompt, *, stream: bool = False,
                   abort: str | None = None, abort_after_s: float = 0.0) -> Record:
        key_index = self.key_for(prompt)
        async with self._sem:
            started = time.perf_counter() - self._t0
            result = await self.ep.complete(self.keys[key_index], prompt.payload, prompt.max_tokens,
                                            stream=stream, abort=abort, abort_after_s=abort_after_s)
        return self._record(scenario, phase, prompt, key_index, result, stream, abort, started)

    async def send_all(self, scenario: str, phase: str, prompts: list[Prompt], streams=None) -> list[Record]:
        streams = streams or [False] * len(prompts)
        return list(await asyncio.gather(*[self.send(scenario, phase, p, stream=s)
                                           for p, s in zip(prompts, streams)]))

    # ---- baseline -------------------------------------------------------------------------
    async def baseline(self) -> None:
        """Each prompt alone, twice: first all attackers' (before any victim data is on the
        server), then all victims'. Run 1 is a plain request, run 2 a stream (which also gives
        the time to first token that the mid-prefill abort aims at)."""
        self.log("probe: baseline (each prompt alone, twice)")
        for group in (self.attack_prompts(), self.victim_prompts):
            for run, stream in ((1, False), (2, True)):
                for p in group:
                    await self._until_answered(lambda: self.send("baseline", f"idle-{run}", p, stream=stream))

    async def _until_answered(self, attempt, patient: bool = False) -> Record:
        """Retry a request that failed inside the server (a fault) up to --retries times, and
        one that found the server unavailable (a worker restarting) for up to 30 s; `patient`
        retries any server error for that long (discovery: the probe needs one answer)."""
        deadline = time.perf_counter() + UNAVAILABLE_WAIT_S
        failures = 0
        while True:
            rec = await attempt()
            r = rec.result
            if r.ok or (r.outcome == "error" and r.status is not None and 400 <= r.status < 500):
                return rec
            unavailable = r.status in UNAVAILABLE or r.outcome in ("timeout", "lost")
            if (unavailable or patient) and time.perf_counter() < deadline:
                await asyncio.sleep(1.0)
                continue
            failures += 1
            if failures > self.opt.retries:
                return rec

    def baselines(self, prompt: Prompt) -> list[Completion]:
        return idle_results(self.records, prompt)

    # ---- scenarios ------------------------------------------------------------------------
    async def victim_round(self, scenario: str) -> None:
        await self.send_all(scenario, "victims", self.victim_prompts)

    async def scenario_limit(self) -> None:
        if self.limit is None:
            self.notes.append("scenario limit skipped: no advertised limit")
            return
        await self.victim_round("limit")
        for p in self.attack_prompts("limit-fit", "limit-1", "limit", "limit+1", "far-above"):
            await self.send("limit", "attack", p)

    async def scenario_pools(self) -> None:
        prompts = self.attack_prompts("pool+1", "attack")
        if not prompts:
            self.notes.append("scenario pools skipped: no --pool-tokens or --attack-tokens given")
            return
        await self.victim_round("pools")
        for p in prompts:
            await self.send("pools", "attack", p)

    async def scenario_abort(self) -> None:
        """Close requests mid-prefill (the longest prompt that fits, closed at half its
        idle time to first token) and mid-stream (after two events), from every attacker, while
        victims run; then run every prompt again: nothing left behind may change an answer."""
        fitting = [p for p in self.attack_prompts() if p.fits and self.baselines(p)]
        if not fitting:
            self.notes.append("scenario abort skipped: no attacker prompt completed when idle")
            return
        long = max(fitting, key=lambda p: p.length)
        short = min((p for p in fitting if p.max_tokens >= 4), key=lambda p: p.length, default=long)
        ttft = min((r.result.ttft for r in self.records if r.prompt is long and r.result.ttft), default=0.05)
        victims = asyncio.ensure_future(self.victim_round("abort"))
        aborts = []
        for _ in range(2):
            for _ in self.attackers:
                aborts.append(self.send("abort", "abort", long, abort="prefill", abort_after_s=max(0.002, ttft / 2)))
                aborts.append(self.send("abort", "abort", short, abort="stream"))
        await asyncio.gather(victims, *aborts)
        await asyncio.sleep(1.0)  # let late transfers and aborts land before checking
        for p in self.attack_prompts() + self.victim_prompts:
            await self.send("abort", "after-abort", p)

    async def scenario_mixed(self) -> None:
        """Victims and attackers interleaved, all in flight together."""
        victims, attackers = self.victim_prompts, self.attack_prompts()
        order = []
        for i in range(self.opt.requests):
            pool = victims if i % 2 == 0 else attackers
            order.append(pool[(i // 2) % len(pool)])
        await self.send_all("mixed", "load", order, streams=[i % 3 == 2 for i in range(len(order))])

    # ---- judge --------------------------------------------------------------------------
    def judge(self) -> list[Finding]:
        return Judge(self.prompts, self.records, self.limit, self.opt.pool_tokens, self.opt.tolerance,
                     self.opt.fuzzy_threshold).findings()


def _advertised_limit(card: dict) -> int | None:
    """vLLM, SGLang and isoserve say `max_model_len`; llama.cpp's card has only the training
    context (the served one comes from its /props)."""
    for name in ("max_model_len", "context_length", "max_context_length", "context_window"):
        value = card.get(name)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _scratch(pid: str, payload) -> Prompt:
    return Prompt(pid, "attacker", "discover", payload, len(payload) if isinstance(payload, list) else 0,
                  False, 1)


_WORDS = ("ledger", "river", "copper", "stone", "window", "market", "signal", "harbor", "lantern",
          "meadow", "engine", "circuit", "garden", "winter", "paper", "silver", "bridge", "forest",
          "canvas", "mirror", "orbit", "pepper", "rocket", "saddle", "timber", "velvet", "walnut")
