"""Read numbers out of Prometheus' text exposition (what GET /metrics returns)."""
from __future__ import annotations


def metric_sum(text: str, name: str) -> float:
    """The sum of every sample of `name` over all its label sets (0 when absent)."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        if key.split("{", 1)[0] == name:
            total += float(value)
    return total


def kv_transfer(text: str) -> dict:
    """isoserve's KV transfer totals and the MB/s they imply (bytes / summed transfer seconds)."""
    nbytes = metric_sum(text, "isoserve_kv_transfer_bytes_total")
    seconds = metric_sum(text, "isoserve_kv_transfer_seconds_sum")
    count = metric_sum(text, "isoserve_kv_transfer_seconds_count")
    return {"bytes": nbytes, "seconds": seconds, "transfers": int(count),
            "mean_bytes": nbytes / count if count else None,
            "mean_ms": 1000 * seconds / count if count else None,
            "mb_per_s": nbytes / seconds / 1e6 if seconds else None}
