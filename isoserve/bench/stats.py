"""Per-setting numbers from the request records.

Throughput counts successful requests only, over the setting's wall time (first request sent
to last one finished). Latency percentiles pool every successful request: TTFT one value per
request, inter-token latency (ITL) one value per gap between streamed tokens, time per output
token (TPOT) one value per request: (end - first token) / (output tokens - 1), which a server
that sends tokens in bursts cannot flatter or spoil.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from isoserve.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)


def percentiles_ms(values: list[float]) -> dict:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    ms = np.asarray(values) * 1000.0
    return {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES} | {"mean": float(ms.mean())}


def summarize(setting: dict, records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.ok]
    failures = Counter(r.outcome for r in records if not r.ok)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_counts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
    return {
        **setting,
        "requests": len(records),
        "ok": len(ok),
        "failed": len(records) - len(ok),
        "failures": dict(sorted(failures.items())),
        "duration_s": duration,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else 0.0,
        "requests_per_s": len(ok) / duration if duration > 0 else 0.0,
        "ttft_ms": percentiles_ms([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles_ms([g for r in ok for g in r.gaps()]),
        "tpot_ms": percentiles_ms([(r.end - r.start - r.ttft) / (r.output_tokens - 1)
                                   for r in ok if r.ttft is not None and r.output_tokens > 1]),
        "e2e_ms": percentiles_ms([r.end - r.start for r in ok]),
        "mean_prompt_tokens": float(np.mean(prompt_counts)) if prompt_counts else None,
        "mean_output_tokens": output_tokens / len(ok) if ok else None,
        "total_output_tokens": output_tokens,
    }
