"""The capacity audit (DESIGN invariant 1): every pool a request may occupy is compared with
the context length before the worker gets traffic. Used by the router at registration and by
`isoserve check-config` on planned workers, so both judge by the same rule."""
from __future__ import annotations

from dataclasses import dataclass

ROLES_BY_MODE = {"disaggregated": ("prefill", "decode"), "aggregated": ("aggregated",)}


@dataclass
class AuditSettings:
    mode: str
    context_length: int
    page_size: int
    kv_dtype: str  # the pools' dtype ("bfloat16", "float32"): a transfer's bytes mean that
    min_kv_headroom: float = 1.0
    allow_undersized_kv: bool = False
    audit_enabled: bool = True  # False only with --unsafe-disable-guard capacity_audit


def audit_worker(s: AuditSettings, role: str, pool_tokens: int, page_size: int,
                 context_length: int, kv_dtype: str | None) -> str:
    """Why a worker may not serve, or "" when it may."""
    if role not in ROLES_BY_MODE[s.mode]:
        return f"role {role} is not used in {s.mode} mode"
    if page_size != s.page_size:
        return f"page size {page_size} differs from the cluster's {s.page_size}"
    if kv_dtype != s.kv_dtype:  # its transfers would each be refused (disagg/manifest.py)
        return f"keeps its KV cache in {kv_dtype}, the cluster's is {s.kv_dtype}"
    if context_length != s.context_length:
        return f"context length {context_length} differs from the cluster's {s.context_length}"
    needed = s.context_length * s.min_kv_headroom
    if s.audit_enabled and not s.allow_undersized_kv and pool_tokens < needed:
        return (f"KV pool holds {pool_tokens} tokens, below context length {s.context_length} "
                f"x min-kv-headroom {s.min_kv_headroom:g} = {needed:.0f}")
    return ""


def audit_table(s: AuditSettings, rows: list[tuple[str, str, int, str]], limit: int) -> str:
    """rows: (group, worker, pool tokens, refusal or "")."""
    table = [("group", "worker", "pool tokens", "context", "ratio", "verdict")]
    for group, worker, tokens, refusal in sorted(rows):
        table.append((group, worker, str(tokens), str(s.context_length),
                      f"{tokens / s.context_length:.2f}", f"REFUSED: {refusal}" if refusal else "ok"))
    widths = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(widths[i]) for i, c in enumerate(r)).rstrip() for r in table]
    lines.append(f"advertised limit (max_model_len): {limit} tokens")
    return "\n".join(lines)
