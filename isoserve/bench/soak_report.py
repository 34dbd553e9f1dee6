"""The soak's bookkeeping: one record per request, the summary, the table and the exit status.

Every request the soak issues ends in exactly one of OUTCOMES:

    ok                 a complete answer: finish_reason stop or length, a well-formed body, or a
                       stream that ended with [DONE]
    error              an explicit error: an HTTP error status with an OpenAI error body, or an
                       error event in a 200 stream; counted by (status, code)
    aborted_by_client  the soak closed the connection on purpose, before the answer or mid-stream
    hung               no final answer within the hang limit (--hang-after)
    lost               no final answer although the connection ended: refused or reset, no body,
                       a stream cut short without [DONE] or an error event, malformed JSON

The summary checks that issued == the sum of the outcomes; lost and hung requests (and probe
findings, when the probe ran) make the exit status 1.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from dataclasses import asdict, dataclass, field

OUTCOMES = ("ok", "error", "aborted_by_client", "hung", "lost")


@dataclass
class SoakRecord:
    index: int
    tenant: str
    api: str                 # "completions" or "chat"
    stream: bool
    prompt_tokens: int       # the target (usage says what the server saw)
    max_tokens: int
    abort: str = ""          # the plan: "", "before 0.123s", "after 5 events"
    start: float = 0.0       # seconds since the soak started
    end: float | None = None
    outcome: str = ""
    status: int | None = None
    code: str = ""
    detail: str = ""
    finish_reason: str | None = None
    output_tokens: int = 0
    usage_prompt_tokens: int | None = None
    retry_after: float | None = None   # the Retry-After header of an error answer, in seconds

    def finish(self, outcome: str, *, status: int | None = None, code: str = "", detail: str = "") -> None:
        """Set the outcome once; a later call (a timeout racing an answer) does not overwrite it."""
        if self.outcome:
            return
        self.outcome = outcome
        if status is not None:
            self.status = status
        self.code = code
        self.detail = detail

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    def to_json(self) -> dict:
        out = asdict(self)
        out["start"] = round(self.start, 4)
        out["end"] = None if self.end is None else round(self.end, 4)
        return out


@dataclass
class Kill:
    at_s: float
    role: str
    worker_id: str
    pid: int
    back_up_after_s: float | None = None   # the role had as many workers up as before, without this pid


@dataclass
class SoakResult:
    config: dict
    model: str
    max_model_len: int | None
    started_at: str
    seconds: float                  # first issue to last outcome
    issuing_seconds: float          # first issue to the last one issued
    records: list[SoakRecord]
    kills: list[Kill] = field(default_factory=list)
    kill_skips: list[dict] = field(default_factory=list)
    probe: dict | None = None       # {"findings": n, "kinds": {...}} or {"error": "..."}


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    lo = int(rank)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (rank - lo)


def summarize(result: SoakResult) -> dict:
    records = result.records
    outcomes = Counter(r.outcome or "hung" for r in records)
    counts = {name: outcomes.get(name, 0) for name in OUTCOMES}
    unknown = {k: v for k, v in outcomes.items() if k not in OUTCOMES}
    errors = Counter((r.status, r.code) for r in records if r.outcome == "error")
    lost = Counter(r.detail for r in records if r.outcome == "lost")
    ok = [r for r in records if r.outcome == "ok"]
    latencies = [r.latency for r in ok if r.latency is not None]
    output_tokens = sum(r.output_tokens for r in ok)
    accounted = sum(counts.values()) + sum(unknown.values())
    planned_aborts = sum(1 for r in records if r.abort)
    probe_bad = result.probe is not None and (result.probe.get("error") or result.probe.get("findings"))
    passed = (counts["lost"] == 0 and counts["hung"] == 0 and not unknown and accounted == len(records)
              and not probe_bad)
    return {
        "issued": len(records),
        "outcomes": counts,
        "unclassified": unknown,
        "accounted": accounted,
        "accounting_ok": accounted == len(records) and not unknown,
        "errors": [{"status": s, "code": c, "count": n} for (s, c), n in sorted(errors.items(), key=_error_key)],
        "lost_details": dict(lost.most_common()),
        "planned_aborts": planned_aborts,
        "latency_ok_s": {"p50": percentile(latencies, 50), "p99": percentile(latencies, 99),
                         "max": max(latencies) if latencies else None},
        "output_tokens_ok": output_tokens,
        "output_tok_per_s": output_tokens / result.seconds if result.seconds > 0 else 0.0,
        "kills": len(result.kills),
        "kills_back_up": sum(1 for k in result.kills if k.back_up_after_s is not None),
        "probe_findings": None if result.probe is None else result.probe.get("findings"),
        "probe_error": None if result.probe is None else result.probe.get("error"),
        "passed": passed,
    }


def _error_key(item) -> tuple:
    (status, code), _ = item
    return (status or 0, code or "")


def exit_status(summary: dict) -> int:
    return 0 if summary["passed"] else 1


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def render_table(result: SoakResult, summary: dict) -> str:
    c = summary["outcomes"]
    lines = [f"soak of {result.config.get('base_url')} ({result.model}): {result.seconds:.1f} s, "
             f"issuing for {result.issuing_seconds:.1f} s"
             + (" (interrupted)" if result.config.get("interrupted") else ""),
             f"  {'issued':<22}{summary['issued']:>8}"]
    for name in OUTCOMES:
        lines.append(f"  {name:<22}{c[name]:>8}")
    for name, n in summary["unclassified"].items():
        lines.append(f"  {'UNCLASSIFIED ' + name:<22}{n:>8}")
    lines.append(f"  {'sum of outcomes':<22}{summary['accounted']:>8}"
                 f"{'' if summary['accounting_ok'] else '   MISMATCH: requests unaccounted for'}")
    if summary["errors"]:
        lines.append("  errors by status and code:")
        for e in summary["errors"]:
            lines.append(f"    {str(e['status']):>5} {e['code'] or '(no code)':<28}{e['count']:>6}")
    if summary["lost_details"]:
        lines.append("  lost, by what happened:")
        for detail, n in summary["lost_details"].items():
            lines.append(f"    {detail[:60]:<62}{n:>5}")
    lat = summary["latency_ok_s"]
    lines.append(f"  ok latency p50 {_ms(lat['p50'])}, p99 {_ms(lat['p99'])}, max {_ms(lat['max'])}; "
                 f"{summary['output_tokens_ok']} output tokens, {summary['output_tok_per_s']:.1f} tok/s")
    lines.append(f"  client aborts planned {summary['planned_aborts']}, done {c['aborted_by_client']} "
                 "(the others finished first)")
    if result.kills or result.kill_skips or result.config.get("kill_worker_every"):
        lines.append(f"  worker kills: {len(result.kills)} ({summary['kills_back_up']} back up)")
        for k in result.kills:
            back = "not back up" if k.back_up_after_s is None else f"back up after {k.back_up_after_s:.1f} s"
            lines.append(f"    {k.at_s:7.1f} s  {k.role:<10} {k.worker_id:<16} pid {k.pid:<8} {back}")
        for s in result.kill_skips:
            lines.append(f"    {s['at_s']:7.1f} s  no kill: {s['reason']}")
    if result.probe is not None:
        if result.probe.get("error"):
            lines.append(f"  leak probe: could not run: {result.probe['error']}")
        else:
            kinds = ", ".join(f"{k} x{n}" for k, n in result.probe.get("kinds", {}).items())
            lines.append(f"  leak probe: {result.probe['findings']} findings{': ' + kinds if kinds else ''}")
    lines.append("PASS: nothing lost, nothing hung" if summary["passed"] else
                 "FAIL: " + ", ".join(_failures(summary)))
    return "\n".join(lines)


def _failures(summary: dict) -> list[str]:
    out = []
    c = summary["outcomes"]
    if c["lost"]:
        out.append(f"{c['lost']} lost")
    if c["hung"]:
        out.append(f"{c['hung']} hung")
    if not summary["accounting_ok"]:
        out.append("requests unaccounted for")
    if summary["probe_findings"]:
        out.append(f"{summary['probe_findings']} probe findings")
    if summary["probe_error"]:
        out.append("the leak probe could not run")
    return out or ["see above"]


def to_json(result: SoakResult, summary: dict) -> dict:
    return {"soak": {"started_at": result.started_at, "model": result.model,
                     "max_model_len": result.max_model_len, "config": result.config,
                     "seconds": round(result.seconds, 3), "issuing_seconds": round(result.issuing_seconds, 3)},
            "summary": summary,
            "exit_status": exit_status(summary),
            "kills": [asdict(k) for k in result.kills],
            "kill_skips": result.kill_skips,
            "probe": result.probe,
            "requests": [r.to_json() for r in result.records]}


def write_json(path: str, result: SoakResult, summary: dict) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(to_json(result, summary), f, indent=1)
        f.write("\n")
