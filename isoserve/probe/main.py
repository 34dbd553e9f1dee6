"""`isoserve probe`: its options, and the exit status.

    isoserve probe --base-url http://127.0.0.1:8000 --model NAME --key VICTIM_KEY --key ATTACKER_KEY \\
        --pool-tokens 320 --pool-tokens 1024 --json probe.json

Exit status: 0 no findings, 1 findings, 2 the probe could not run.
"""
from __future__ import annotations

import argparse
import logging
import sys
import traceback

from isoserve import event_loop
from isoserve.probe.http import Endpoint, ProbeError
from isoserve.probe.runner import SCENARIOS, Options, Probe
from isoserve.probe.report import render_table, write_json


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


def split_keys(args) -> tuple[list[str], list[int], list[int]]:
    if args.victim_key or args.attacker_key:
        if args.key:
            raise ProbeError("give either --key (split in half) or --victim-key/--attacker-key, not both")
        keys = args.victim_key + args.attacker_key
        return keys, list(range(len(args.victim_key))), list(range(len(args.victim_key), len(keys)))
    keys = args.key
    if len(keys) < 2:
        raise ProbeError("give at least two --key: the first half are victims, the rest attackers")
    n_victims = max(1, len(keys) // 2)
    return keys, list(range(n_victims)), list(range(n_victims, len(keys)))


def run(args) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    log = (lambda *_: None) if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    try:
        keys, victims, attackers = split_keys(args)
        options = Options(scenarios=tuple(args.scenario or SCENARIOS), pool_tokens=args.pool_tokens,
                          attack_tokens=args.attack_tokens, requests=args.requests,
                          concurrency=args.concurrency, max_tokens=args.max_tokens,
                          victim_tokens=args.victim_tokens, victim_prompts=args.victim_prompts,
                          top_logprobs=args.top_logprobs, tolerance=args.tolerance,
                          fuzzy_threshold=args.fuzzy_threshold, timeout=args.timeout,
                          max_model_len=args.max_model_len, token_id_range=args.token_id_range,
                          force_text=args.text_prompts, seed=args.seed)
        result = event_loop.run(_run(args, keys, victims, attackers, options, log))
    except ProbeError as e:
        print(f"probe could not run: {e}", file=sys.stderr)
        return 2
    except Exception:
        traceback.print_exc()
        print("probe could not run: unexpected error (above)", file=sys.stderr)
        return 2
    status = 1 if result.findings else 0
    print(render_table(result), flush=True)
    if args.json:
        write_json(args.json, result, status)
        print(f"report: {args.json}")
    return status


async def _run(args, keys, victims, attackers, options, log):
    endpoint = Endpoint(args.base_url, args.model, timeout=options.timeout, top_logprobs=options.top_logprobs)
    try:
        return await Probe(endpoint, keys, victims, attackers, options, log=log).run()
    finally:
        await endpoint.close()
