"""`isoserve probe`: the run and its exit status (its options: arguments.py).

    isoserve probe --base-url http://127.0.0.1:8000 --model NAME --key VICTIM_KEY --key ATTACKER_KEY \\
        --pool-tokens 320 --pool-tokens 1024 --json probe.json

Exit status: 0 no findings, 1 findings, 2 the probe could not run.
"""
from __future__ import annotations

import logging
import sys
import traceback

from isoserve import event_loop
from isoserve.probe import SCENARIOS
from isoserve.probe.http import Endpoint, ProbeError
from isoserve.probe.report import render_table, write_json
from isoserve.probe.runner import Options, Probe


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
