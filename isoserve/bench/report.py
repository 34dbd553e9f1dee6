"""The printed table and the JSON file of a benchmark run."""
from __future__ import annotations

import json
from pathlib import Path

COLUMNS = [  # header, width, how to get the cell from a summary
    ("setting", 12, lambda s: setting_name(s)),
    ("ok", 5, lambda s: s["ok"]),
    ("fail", 5, lambda s: s["failed"]),
    ("out tok/s", 10, lambda s: s["output_tokens_per_s"]),
    ("req/s", 7, lambda s: s["requests_per_s"]),
    ("TTFT p50", 9, lambda s: s["ttft_ms"]["p50"]),
    ("p90", 8, lambda s: s["ttft_ms"]["p90"]),
    ("p99", 8, lambda s: s["ttft_ms"]["p99"]),
    ("ITL p50", 8, lambda s: s["itl_ms"]["p50"]),
    ("p90", 7, lambda s: s["itl_ms"]["p90"]),
    ("p99", 7, lambda s: s["itl_ms"]["p99"]),
    ("prompt", 7, lambda s: s["mean_prompt_tokens"]),
    ("output", 7, lambda s: s["mean_output_tokens"]),
]


def setting_name(summary: dict) -> str:
    if summary.get("request_rate") is not None:
        return f"rate {summary['request_rate']:g}/s"
    return f"conc {summary['concurrency']}"


def _cell(value, width: int) -> str:
    if value is None:
        text = "-"
    elif isinstance(value, float):
        text = f"{value:.1f}"
    else:
        text = str(value)
    return text.rjust(width)


def table(summaries: list[dict], label: str = "") -> str:
    lines = [f"== {label} ==" if label else "",
             " ".join(h.rjust(w) for h, w, _ in COLUMNS) + "   (latencies in ms; prompt/output: mean tokens)"]
    for s in summaries:
        lines.append(" ".join(_cell(get(s), w) for _, w, get in COLUMNS))
        for outcome, count in s["failures"].items():
            lines.append(f"    {count} x {outcome}")
    return "\n".join(line for line in lines if line)


def write_json(path: str | Path, run: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(run, indent=2) + "\n")
