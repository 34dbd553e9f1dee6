"""`isoserve bench`: its options, and which mode runs.

    isoserve bench --base-url http://127.0.0.1:8000 --concurrency 1,8,32 --ignore-eos --json out.json
    isoserve bench --offline --batch 1,8,32 --peers transformers,generate_batch
    isoserve bench --roofline --batch 1,8,32
    isoserve bench --prefill --prompt-tokens 2000 --peers transformers --llama-url http://127.0.0.1:8080
"""
from __future__ import annotations

import argparse
import os

from isoserve.config import DTYPE_CHOICES, KV_DTYPE_CHOICES


def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return values


def _float_list(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected positive rates like 0.5,2, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    http = p.add_argument_group("HTTP mode (any OpenAI-compatible /v1/completions endpoint)")
    http.add_argument("--base-url", help="e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    http.add_argument("--key", default=os.environ.get("ISOSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                      help="API key (default: $ISOSERVE_API_KEY, then $OPENAI_API_KEY)")
    load = http.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=_int_list, default=[1, 8, 32], metavar="C[,C...]",
                      help="closed loop: C requests in flight at all times (default 1,8,32)")
    load.add_argument("--request-rate", type=_float_list, default=None, metavar="R[,R...]",
                      help="open loop: Poisson arrivals at R requests/s")
    http.add_argument("--num-requests", type=int, default=None,
                      help="requests per setting (default: 4 x concurrency, at least 16; 64 open-loop)")
    http.add_argument("--dataset", default="fixed", choices=["fixed", "sharegpt-like"],
                      help="fixed lengths, or lognormal ShareGPT-like ones (see isoserve/bench/workload.py)")
    http.add_argument("--ignore-eos", action="store_true", help="generate max_tokens every time")
    http.add_argument("--temperature", type=float, default=0.0, help="default 0 (greedy)")
    http.add_argument("--top-p", type=float, default=1.0,
                      help="nucleus sampling with --temperature > 0 (default 1: off, not sent)")
    http.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (default 2)")
    http.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    http.add_argument("--plot", metavar="PATH.png",
                      help="throughput vs load and latency percentiles, as a PNG")

    offline = p.add_argument_group("offline mode (isoserve's LLM vs transformers, one process)")
    offline.add_argument("--offline", action="store_true", help="run the offline comparison")
    offline.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                         help="isoserve's; auto (default): as `isoserve serve` decides it (bfloat16 where "
                              "the CPU computes in it natively, else float32; float32 with int8 activations "
                              "for a GGUF's Q4_1 blocks on AVX512-VNNI without AMX)")
    offline.add_argument("--peer-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                         help="transformers' (offline and prefill modes); auto (default): bfloat16 where the "
                              "CPU computes in it natively, else float32, whatever isoserve runs in")
    offline.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_CHOICES,
                         help="isoserve's KV cache (see `isoserve serve --help`; offline, roofline and "
                              "prefill modes); the peers keep theirs in --peer-dtype")
    offline.add_argument("--device", default="cpu",
                         help="cpu (default) or cuda: where both isoserve and its peers run (offline mode)")
    offline.add_argument("--batch", type=_int_list, default=[1, 8, 32], metavar="B[,B...]",
                         help="prompts generated together (default 1,8,32)")
    offline.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_false",
                         help="isoserve's layers as torch ops instead of the fused CPU kernels "
                              "(offline, roofline and prefill modes)")
    offline.add_argument("--no-int8-activations", dest="int8_activations", action="store_const", const=False,
                         default=None,
                         help="in float32, isoserve's GGUF blocks multiply float32 activations, not int8 "
                              "ones (offline, roofline and prefill modes; see `isoserve serve --help`)")
    offline.add_argument("--peers", type=_name_list, default=["transformers"], metavar="NAME[,NAME...]",
                         help="transformers (default) and/or generate_batch (continuous batching)")

    machine = p.add_argument_group("roofline and prefill modes (also use --model, --dtype, --batch, "
                                   "--peers and the token counts)")
    machine.add_argument("--roofline", action="store_true",
                         help="measure bf16 FLOP/s and memory bandwidth; the ideal decode step per "
                              "--batch against isoserve's measured one")
    machine.add_argument("--roofline-mib", type=int, default=1024,
                         help="size of the tensor the bandwidth test reads and copies (default 1024)")
    machine.add_argument("--roofline-square", type=int, default=2048,
                         help="n of the large n x n x n matmul (default 2048)")
    machine.add_argument("--prefill", action="store_true",
                         help="time one long prompt's processing (default 2000 tokens): isoserve, "
                              "transformers (--peers) and llama.cpp (--llama-url)")
    machine.add_argument("--llama-url", metavar="URL",
                         help="prefill: a running llama-server to time as well (its /completion)")
    machine.add_argument("--repeats", type=int, default=3,
                         help="prefill: timed prompts per engine; the median counts (default 3)")

    both = p.add_argument_group("both modes")
    both.add_argument("--model", default=None,
                      help="HTTP: the served model name (default: the first in /v1/models); "
                           "offline: model name or path (default smollm2-135m-instruct)")
    both.add_argument("--prompt-tokens", type=int, default=None,
                      help="default 100 (2000 with --prefill)")
    both.add_argument("--output-tokens", type=int, default=128)
    both.add_argument("--seed", type=int, default=0)
    both.add_argument("--json", metavar="PATH", help="write every number to this JSON file")
    both.add_argument("--label", default="", help="a name for this run, in the table, JSON and plot")
    _add_soak_arguments(p)


def _add_soak_arguments(p: argparse.ArgumentParser) -> None:
    """`--soak`: mixed traffic, client aborts and worker kills, every request accounted for
    (isoserve/bench/soak.py). Uses --base-url, --concurrency or --request-rate, --model,
    --temperature, --seed and --json from above."""
    soak = p.add_argument_group("soak mode (loopback only: it may SIGKILL worker processes)")
    soak.add_argument("--soak", action="store_true",
                      help="soak the server: tenants, mixed lengths, client aborts, optional worker kills")
    soak.add_argument("--soak-keys", type=_name_list, default=[], metavar="KEY[,KEY...]",
                      help="one API key per tenant (KEY or NAME=KEY)")
    soak.add_argument("--soak-tenants-file", metavar="PATH",
                      help="a text file of tenant keys, one a line (KEY, NAME=KEY or NAME KEY)")
    soak.add_argument("--admin-key", default=os.environ.get("ISOSERVE_ADMIN_KEY"),
                      help="admin key for /status (worker pids); needed by --kill-worker-every "
                           "(default: $ISOSERVE_ADMIN_KEY)")
    soak.add_argument("--duration", type=float, default=600.0, help="seconds of issuing (default 600)")
    soak.add_argument("--max-requests", type=int, default=None, help="stop issuing after this many")
    soak.add_argument("--abort-fraction", type=float, default=0.05,
                      help="share of requests the client abandons on purpose (default 0.05)")
    soak.add_argument("--kill-worker-every", type=float, default=None, metavar="S",
                      help="SIGKILL a random up worker every S seconds")
    soak.add_argument("--kill-roles", type=_name_list, default=["prefill", "decode", "aggregated"],
                      metavar="ROLE[,ROLE...]", help="roles that may be killed (default all)")
    soak.add_argument("--hang-after", type=float, default=300.0,
                      help="a request without a final answer after this many seconds is hung (default "
                           "300; keep it above the longest legitimate request)")
    soak.add_argument("--chat-fraction", type=float, default=0.5, help="share of chat requests (default 0.5)")
    soak.add_argument("--stream-fraction", type=float, default=0.5, help="share streamed (default 0.5)")
    soak.add_argument("--soak-max-prompt-tokens", type=int, default=None,
                      help="cap the ShareGPT-like prompt lengths")
    soak.add_argument("--soak-max-output-tokens", type=int, default=None,
                      help="cap the ShareGPT-like max_tokens")
    soak.add_argument("--probe-after", action="store_true",
                      help="then run the leak probe (isoserve probe) with the tenant keys")
    soak.add_argument("--probe-json", metavar="PATH", help="the probe's full report")
    soak.add_argument("--progress-every", type=float, default=5.0, help="seconds between progress lines")


def run(args) -> int:
    import logging

    from isoserve.bench import report
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no log line per request
    if args.prompt_tokens is None:
        args.prompt_tokens = 2000 if getattr(args, "prefill", False) else 100
    if not 0 < args.top_p <= 1:
        raise SystemExit(f"bench: --top-p must be in (0, 1], got {args.top_p}")
    if getattr(args, "soak", False):
        from isoserve.bench.soak import run_soak
        return run_soak(args)
    if args.roofline or args.prefill:
        if args.roofline and args.prefill:
            raise SystemExit("bench: --roofline and --prefill are separate runs; give one")
        if args.roofline:
            from isoserve.bench.roofline import run_roofline as measure, table
        else:
            from isoserve.bench.prefill import run_prefill as measure, table
        result = measure(args)
        print(table(result))
    elif args.offline:
        from isoserve.bench.offline import run_offline, table
        if args.plot:
            print("bench: --plot draws HTTP runs only; the offline table is printed instead")
        result = run_offline(args)
        print(table(result))
    else:
        if not args.base_url:
            raise SystemExit("bench: give --base-url (HTTP mode) or --offline")
        from isoserve.bench.http_mode import run_http
        result = run_http(args)
        print(report.table(result["summaries"], args.label or f"{result['model']} at {args.base_url}"))
        cal = result["calibration"]
        print(f"prompts: {cal['tokens_per_word']:.3f} tokens per word + {cal['offset_tokens']:.1f} "
              f"({'measured' if cal['measured'] else 'assumed'}); ITL = gaps between streamed tokens")
        if args.plot:
            from isoserve.bench.plot import plot_runs
            plot_runs([(args.label, result["summaries"])], args.plot,
                      title=args.label or f"{result['model']} at {args.base_url}")
            print(f"wrote {args.plot}")
    if args.json:
        report.write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0
