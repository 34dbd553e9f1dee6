"""`isoserve probe`'s options, apart from the probe itself: the CLI builds its parser in every
process it starts (the server and each worker too), and the probe's modules import httpx.
"""
from __future__ import annotations

import argparse

from isoserve.probe import SCENARIOS


def _id_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    try:
        lo_i, hi_i = int(lo), int(hi)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI, got {text!r}") from None
    if not 0 <= lo_i < hi_i:
        raise argparse.ArgumentTypeError(f"expected 0 <= LO < HI, got {text!r}")
    return lo_i, hi_i


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="the server, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--model", default=None, help="model name (default: the first that /v1/models lists)")
    p.add_argument("--key", action="append", default=[], metavar="KEY",
                   help="a tenant's API key; repeat it. The first half of the keys (at least one) are "
                        "victims, the rest attackers")
    p.add_argument("--victim-key", action="append", default=[], metavar="KEY",
                   help="a victim tenant's key (instead of splitting --key)")
    p.add_argument("--attacker-key", action="append", default=[], metavar="KEY",
                   help="an attacker tenant's key (instead of splitting --key)")
    p.add_argument("--scenario", action="append", choices=SCENARIOS, default=None,
                   help=f"run only these scenarios (repeatable; default all: {', '.join(SCENARIOS)})")
    p.add_argument("--pool-tokens", action="append", type=int, default=[], metavar="N",
                   help="a KV pool size in tokens, from the server's startup log (repeatable): "
                        "prompts just above it are sent, and a limit above it is a finding")
    p.add_argument("--attack-tokens", action="append", type=int, default=[], metavar="N",
                   help="also send attacker prompts of exactly N tokens (repeatable)")
    p.add_argument("--requests", type=int, default=24, help="requests in the mixed-load scenario (default 24)")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight at most (default 32)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument("--victim-tokens", type=int, default=200, help="approximate length of victim prompts")
    p.add_argument("--victim-prompts", type=int, default=0,
                   help="prompts per victim (default: enough for one round to write the largest pool over)")
    p.add_argument("--top-logprobs", type=int, default=5,
                   help="top logprobs asked for per token (0: compare text only)")
    p.add_argument("--tolerance", type=float, default=0.15,
                   help="logprob difference (nats) allowed above the idle noise floor (default 0.15)")
    p.add_argument("--fuzzy-threshold", type=float, default=0.88, help="fuzzy canary match ratio (default 0.88)")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a request may take; longer is a hung request (a finding)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="the advertised limit, when /v1/models does not say it")
    p.add_argument("--token-id-range", type=_id_range, default=(1000, 30000), metavar="LO:HI",
                   help="token ids attacker prompts are drawn from (default 1000:30000)")
    p.add_argument("--text-prompts", action="store_true", help="send text prompts even if token ids are accepted")
    p.add_argument("--seed", type=int, default=None, help="seed for prompts and canaries (default: the clock)")
    p.add_argument("--json", metavar="PATH", help="write the full report (requests, findings, evidence) here")
    p.add_argument("--quiet", action="store_true", help="print only the final table")
