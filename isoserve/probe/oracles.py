"""What counts as a finding. Each oracle looks at the requests of a run and says what is wrong.

  canary          another tenant's canary (exact, or fuzzy beyond the threshold) in a response
                  or an error message
  divergence      a prompt's greedy output or top logprobs under load and faults differ from the
                  same prompt run alone on the idle server, by more than the idle noise floor
  idle_divergence the two idle runs of one prompt differ by more than the tolerance: the output
                  depends on something other than the prompt (stale memory, say) even when idle
  silent_acceptance  a 200 (or a stream that started) for a prompt above the advertised limit
  over_limit_admitted  a prompt above the advertised limit failed inside the server (a 5xx other
                  than "unavailable") instead of being refused with a 4xx at the door
  prompt_altered  the server reports a different prompt length than the token ids we sent
                  (it truncated or padded the prompt)
  limit_not_honoured  a request within the advertised limit (prompt + max_tokens) was refused
                  as too long: the advertised limit is not what the server can hold
  limit_not_served  a prompt within the advertised limit failed inside the server (5xx, not
                  "unavailable") on every idle try while other prompts were served
  limit_exceeds_pool  the advertised limit is larger than a KV pool the operator named
                  (--pool-tokens): the incident's precondition
  lost / timeout / malformed  a request that did not end with a correct response or an
                  explicit error (an HTTP error with an OpenAI body, or an SSE error event)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from isoserve.probe.canaries import Canary, scan
from isoserve.probe.http import EXPLICIT, Completion
from isoserve.probe.records import Prompt, Record, idle_results

UNAVAILABLE = (502, 503, 504)


@dataclass
class Finding:
    kind: str
    summary: str
    scenario: str = ""
    requests: list[int] = field(default_factory=list)
    evidence: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kind": self.kind, "scenario": self.scenario, "requests": self.requests,
                "summary": self.summary, "evidence": self.evidence}


# ---- differential ----------------------------------------------------------------------------

def compare(ref: Completion, got: Completion, allowance: float) -> dict | None:
    """None when `got` matches `ref` within `allowance` nats; else where and how they differ.

    Tokens are compared in order. A different token at a position where both runs had the two
    candidates within `allowance` of each other (a near tie) is noise, and the comparison ends
    there: everything after it is conditioned on a different token. Chosen and top logprobs
    are compared at every position before that.
    """
    if not (ref.has_logprobs and got.has_logprobs):
        if ref.text == got.text:
            return None
        i = _common_prefix(ref.text, got.text)
        return {"basis": "text", "position": i, "expected": ref.text, "got": got.text}
    worst = 0.0
    for i in range(min(len(ref.tokens), len(got.tokens))):
        rt, gt = ref.tokens[i], got.tokens[i]
        if rt != gt:
            margin = max(_margin(ref, i, gt), _margin(got, i, rt))
            if margin <= allowance:
                return None  # a near tie went the other way
            return {"basis": "token", "position": i, "expected_token": rt, "got_token": gt,
                    "margin": _round(margin), "expected": ref.text, "got": got.text}
        delta = abs(ref.token_logprobs[i] - got.token_logprobs[i])
        common = ref.top_logprobs[i].keys() & got.top_logprobs[i].keys() if i < min(
            len(ref.top_logprobs), len(got.top_logprobs)) else set()
        top_delta = max((abs(ref.top_logprobs[i][t] - got.top_logprobs[i][t]) for t in common), default=0.0)
        worst = max(worst, delta, top_delta)
        if max(delta, top_delta) > allowance:
            return {"basis": "logprob", "position": i, "token": rt, "delta": _round(max(delta, top_delta)),
                    "expected_logprob": _round(ref.token_logprobs[i]),
                    "got_logprob": _round(got.token_logprobs[i]), "expected": ref.text, "got": got.text}
    if len(ref.tokens) != len(got.tokens) and ref.finish_reason != got.finish_reason:
        return {"basis": "length", "expected_tokens": len(ref.tokens), "got_tokens": len(got.tokens),
                "expected": ref.text, "got": got.text}
    return None


def noise_floor(a: Completion, b: Completion) -> float:
    """Largest logprob difference between two runs, up to their first differing token."""
    if not (a.has_logprobs and b.has_logprobs):
        return 0.0
    floor = 0.0
    for i in range(min(len(a.tokens), len(b.tokens))):
        if a.tokens[i] != b.tokens[i]:
            break
        floor = max(floor, abs(a.token_logprobs[i] - b.token_logprobs[i]))
        if i < min(len(a.top_logprobs), len(b.top_logprobs)):
            for t in a.top_logprobs[i].keys() & b.top_logprobs[i].keys():
                floor = max(floor, abs(a.top_logprobs[i][t] - b.top_logprobs[i][t]))
    return floor


def _margin(c: Completion, i: int, other: str) -> float:
    """How much more likely c's own token at i was than `other`, by c's own top logprobs."""
    chosen = c.token_logprobs[i]
    top = c.top_logprobs[i] if i < len(c.top_logprobs) else {}
    if other in top:
        return chosen - top[other]
    if top:
        return chosen - min(top.values())  # `other` was below all of the top: at least this much
    return math.inf


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _round(x: float) -> float:
    return round(x, 4) if math.isfinite(x) else str(x)


# ---- canaries --------------------------------------------------------------------------------

def canary_hits(text: str, canaries: list[Canary], baseline_texts: list[str],
                threshold: float) -> list[dict]:
    """Hits of other tenants' canaries in `text`, minus fuzzy ones that the same prompt's idle
    runs (made before any victim had sent anything) also score: those are the model's own
    habits, not a leak."""
    hits = scan(text, canaries, fuzzy_threshold=threshold)
    if not hits:
        return []
    control = {h.canary for t in baseline_texts for h in scan(t, canaries, fuzzy_threshold=threshold)}
    return [h.to_json() for h in hits if h.exact or h.canary not in control]


# ---- the judge -------------------------------------------------------------------------------

@dataclass
class Judge:
    prompts: list[Prompt]
    records: list[Record]
    limit: int | None            # the advertised max_model_len
    pool_tokens: list[int]       # the operator's --pool-tokens
    tolerance: float             # nats allowed on top of the idle noise floor
    fuzzy_threshold: float

    def findings(self) -> list[Finding]:
        out = self._config() + self._limit_served()
        self.canaries = [c for p in self.prompts for c in p.canaries]
        self.refs: dict[str, tuple[float, list[Completion]]] = {}  # prompt id -> (noise floor, idle runs)
        for p in self.prompts:
            refs = idle_results(self.records, p)
            self.refs[p.id] = (noise_floor(refs[0], refs[1]) if len(refs) >= 2 else 0.0, refs)
            out += self._idle(p, refs)
        for rec in self.records:
            out += self._request(rec)
        return out

    def _config(self) -> list[Finding]:
        if self.limit is None or not self.pool_tokens or self.limit <= min(self.pool_tokens):
            return []
        return [Finding("limit_exceeds_pool",
                        f"the server advertises max_model_len={self.limit} but a KV pool holds only "
                        f"{min(self.pool_tokens)} tokens: a prompt that fits the limit may not fit the pool",
                        evidence={"max_model_len": self.limit, "pool_tokens": self.pool_tokens})]

    def _limit_served(self) -> list[Finding]:
        """A prompt that fits the advertised limit and fails inside the server on every idle try,
        while other prompts are served: the server cannot hold what it advertises."""
        if self.limit is None or not any(idle_results(self.records, p) for p in self.prompts):
            return []
        out = []
        for p in self.prompts:
            idle = [r for r in self.records if r.prompt is p and r.scenario == "baseline"]
            if p.fits and p.exact and len(idle) >= 2 and all(_server_fault(r.result) for r in idle):
                codes = sorted({f"{r.result.status} {r.result.error_code}" for r in idle})
                out.append(Finding(
                    "limit_not_served", f"prompt {p.id}: {p.length} + {p.max_tokens} tokens fit the advertised "
                    f"limit {self.limit} but failed inside the server on all {len(idle)} idle tries "
                    f"({', '.join(codes)}) while other prompts were served", "baseline", [r.n for r in idle],
                    {"prompt": p.id, "errors": [r.result.error_message for r in idle][:3]}))
        return out

    def _idle(self, p: Prompt, refs: list[Completion]) -> list[Finding]:
        if len(refs) < 2 or (diff := compare(refs[0], refs[1], self.tolerance)) is None:
            return []
        recs = [r.n for r in self.records if r.prompt is p and r.scenario == "baseline" and r.result.ok][:2]
        return [Finding("idle_divergence", f"prompt {p.id}: two runs alone on the idle server differ "
                        f"({diff['basis']} at position {diff.get('position')}): the output depends on "
                        "something other than the prompt", "baseline", recs, {"prompt": p.id, **diff})]

    def _request(self, rec: Record) -> list[Finding]:
        p, r = rec.prompt, rec.result
        out = []

        def finding(kind: str, summary: str, **evidence) -> None:
            out.append(Finding(kind, f"request {rec.n} ({p.id}, {rec.tenant}): {summary}", rec.scenario,
                               [rec.n], {"prompt": p.id, "prompt_tokens_sent": p.length,
                                         "max_tokens": p.max_tokens, **evidence}))

        # (4) every request ends in a correct response or an explicit error
        if r.outcome not in EXPLICIT:
            finding(r.outcome, f"no correct response and no explicit error: {r.detail}", status=r.status)
        # (3) nothing above the advertised limit is served, or even let in
        accepted = r.ok or (r.outcome in ("aborted", "stream_error") and r.status == 200 and r.events > 0)
        over = self._over_limit(p, r)
        if over and accepted:
            finding("silent_acceptance", f"{p.length} tokens, above the advertised limit {self.limit}, "
                    f"was served (HTTP 200, {len(r.text)} characters)", output=r.text,
                    prompt_tokens_reported=r.prompt_tokens)
        elif over and _server_fault(r):
            finding("over_limit_admitted", f"{p.length} tokens, above the advertised limit {self.limit}, "
                    f"was not refused at the door: it failed inside with {r.status} {r.error_code}",
                    status=r.status, error_code=r.error_code, error_message=r.error_message)
        if r.ok and p.exact and r.prompt_tokens is not None and r.prompt_tokens != p.length:
            finding("prompt_altered", f"sent {p.length} token ids, the server reports {r.prompt_tokens} "
                    "prompt tokens: the prompt was truncated or padded", prompt_tokens_reported=r.prompt_tokens)
        if (p.fits and p.exact and r.outcome == "error" and r.status == 400
                and _says_too_long(r.error_code, r.error_message)):
            finding("limit_not_honoured", f"{p.length} + {p.max_tokens} tokens fit the advertised limit "
                    f"{self.limit} but the server refused them as too long", error_message=r.error_message)
        # (1) other tenants' canaries, in the output or in an error message
        floor, refs = self.refs.get(p.id, (0.0, []))
        others = [c for c in self.canaries if c.owner != rec.tenant]
        text = r.text + ("\n" + r.error_message if r.error_message else "")
        hits = canary_hits(text, others, [ref.text for ref in refs], self.fuzzy_threshold)
        if hits:
            finding("canary", f"{len(hits)} canar{'y' if len(hits) == 1 else 'ies'} of other tenants in "
                    f"the response: {', '.join(h['match'] for h in hits[:3])}", hits=hits, output=text)
        # (2) differential: the same prompt alone on the idle server
        if r.ok and rec.scenario != "baseline" and refs:
            allowance = self.tolerance + floor
            diffs = [compare(ref, r, allowance) for ref in refs]
            if all(d is not None for d in diffs):
                d = diffs[0]
                finding("divergence", f"output differs from the same prompt alone on the idle server "
                        f"({d['basis']} at position {d.get('position')}, allowance {allowance:.3f} nats)",
                        noise_floor=round(floor, 5), **d)
        return out

    def _over_limit(self, p: Prompt, r: Completion) -> bool:
        """Exact for token ids; for text, what the server says it counted, else only when the
        estimate is far above the limit."""
        if self.limit is None:
            return False
        if p.exact:
            return p.over_limit
        if r.prompt_tokens is not None:
            return r.prompt_tokens > self.limit
        return p.length > 1.5 * self.limit


def _server_fault(r: Completion) -> bool:
    """An explicit error from inside the server: a 5xx other than "unavailable", or an error
    event in a stream that is neither "unavailable" nor a (late) refusal as too long."""
    if r.outcome == "error":
        return r.status is not None and r.status >= 500 and r.status not in UNAVAILABLE
    if r.outcome == "stream_error":
        return "unavailable" not in (r.error_code or "") and not _says_too_long(r.error_code, r.error_message)
    return False


def _says_too_long(code: str | None, message: str | None) -> bool:
    text = f"{code or ''} {message or ''}".lower()
    return "context_length" in text or "context length" in text or "too long" in text or "maximum" in text
