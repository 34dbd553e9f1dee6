"""The probe's output: a table for the terminal and a JSON report with the evidence."""
from __future__ import annotations

import json
from collections import Counter

from isoserve.probe.runner import RunResult


def scenario_rows(result: RunResult) -> list[dict]:
    rows = []
    for name in ["discover", "baseline", *result.info["scenarios"]]:
        recs = [r for r in result.records if r.scenario == name]
        if not recs:
            continue
        errors = Counter(f"{r.result.status} {r.result.error_code or ''}".strip() for r in recs
                         if r.result.outcome in ("error", "stream_error"))
        rows.append({"scenario": name, "requests": len(recs),
                     "ok": sum(r.result.ok for r in recs),
                     "errors": dict(errors),
                     "aborted": sum(r.result.outcome == "aborted" for r in recs),
                     "unanswered": sum(r.result.outcome in ("timeout", "lost", "malformed") for r in recs),
                     "findings": sum(1 for f in result.findings if f.scenario == name)})
    return rows


def render_table(result: RunResult) -> str:
    rows = scenario_rows(result)
    head = ("scenario", "requests", "ok", "explicit errors", "aborted", "unanswered", "findings")
    body = [(r["scenario"], str(r["requests"]), str(r["ok"]),
             ", ".join(f"{k} x{v}" for k, v in sorted(r["errors"].items())) or "-",
             str(r["aborted"]), str(r["unanswered"]), str(r["findings"])) for r in rows]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
    out = [line(head), line(tuple("-" * w for w in widths)), *map(line, body)]
    info = result.info
    out.insert(0, f"isoserve probe: {info['base_url']} model={info['model']} "
                  f"max_model_len={info['max_model_len']} prompts={info['prompt_format']} seed={info['seed']} "
                  f"({info['seconds']} s)")
    for note in result.notes:
        out.append(f"note: {note}")
    if result.findings:
        kinds = Counter(f.kind for f in result.findings)
        out.append(f"FINDINGS: {len(result.findings)} ({', '.join(f'{k} x{v}' for k, v in sorted(kinds.items()))})")
        shown = Counter()
        for f in result.findings:
            shown[f.kind] += 1
            if shown[f.kind] <= 5:
                out.append(f"  [{f.kind}] {f.scenario + ': ' if f.scenario else ''}{f.summary}")
            elif shown[f.kind] == 6:
                out.append(f"  [{f.kind}] ... {kinds[f.kind] - 5} more in the JSON report")
    else:
        out.append("no findings")
    return "\n".join(out)


def to_json(result: RunResult, exit_status: int) -> dict:
    return {"probe": result.info, "exit_status": exit_status, "notes": result.notes,
            "summary": {"findings": len(result.findings),
                        "by_kind": dict(Counter(f.kind for f in result.findings)),
                        "requests": len(result.records)},
            "scenarios": scenario_rows(result),
            "findings": [f.to_json() for f in result.findings],
            "prompts": [p.to_json() for p in result.prompts],
            "requests": [r.to_json() for r in result.records]}


def write_json(path: str, result: RunResult, exit_status: int) -> None:
    with open(path, "w") as f:
        json.dump(to_json(result, exit_status), f, indent=1, ensure_ascii=False)
        f.write("\n")
