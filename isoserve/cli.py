"""The `isoserve` command: serve, worker, check-config, tenants, probe, bench."""
from __future__ import annotations

import argparse
import logging
import os
import sys

from isoserve.config import DTYPE_CHOICES, GUARD_NAMES, KV_DTYPE_CHOICES, AutoInputs, dtype_name, parse_guard_names, resolve_dtypes
from isoserve.disagg.cores import POLICIES


def _at_least_one(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="smollm2-135m-instruct (default), a .gguf file or a Hugging Face checkpoint folder")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto (default): bfloat16 where the CPU (or GPU) computes in it natively, "
                        "float32 elsewhere; and float32 with int8 activations for a GGUF of Q4_1 "
                        "projections on a CPU with AVX512-VNNI and no AMX, where that is faster")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_CHOICES,
                   help="the KV cache's dtype: the model's, or bfloat16 under a float32 model, which "
                        "halves the bytes each decode step reads and doubles the tokens a pool holds "
                        "(K and V rounded to bfloat16 as they are written); or float8_e4m3fn (fp8), "
                        "8-bit floats under a bfloat16 or float32 model on a CPU: half bfloat16's bytes "
                        "again, not exact (3 mantissa bits). auto (default): the model's, "
                        "but bfloat16 where --dtype auto picks float32 on a CPU")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default 16)")
    p.add_argument("--context-length", type=int, default=None, help="default: the model's")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together at most")
    p.add_argument("--stream-interval", type=_at_least_one, default=1, metavar="N",
                   help="send a running request's tokens every N tokens (default 1: each token as it "
                        "comes; the first token and the end always at once). Larger N: fewer, larger "
                        "stream events, less router and client work per token, burstier streams")
    p.add_argument("--max-batched-tokens", type=int, default=2048,
                   help="tokens per engine step; longer prompts are prefilled in chunks")
    p.add_argument("--int4-max-rows", type=int, default=None, metavar="N",
                   help="steps of at most N tokens multiply by the GGUF's own 4-bit (Q4_1) weights, and "
                        "on AMX or in float32 its 8-bit (Q8_0) LM head, instead of the dense weights: "
                        "faster decode batches (default: bfloat16 32 where the CPU has AMX, which "
                        "isoserve's kernels use, else 4; float32 every step with int8 activations, "
                        "else 512; 0 = off; CPU only)")
    p.add_argument("--int8-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="in float32 on AVX2 or AVX512-VNNI, multiply the GGUF's 4-bit and 8-bit blocks by the "
                        "activations quantized to int8 by blocks of 32 (llama.cpp's arithmetic for these "
                        "files; faster decode batches). Default: wherever it runs; "
                        "--no-int8-activations keeps them in float32")
    p.add_argument("--no-fused-kernels", dest="fused_kernels", action="store_false",
                   help="run the work between matmuls as torch ops instead of the fused CPU kernels "
                        "(isoserve/kernels; for comparison: both paths compute the same)")
    p.add_argument("--scrub-freed-pages", action="store_true",
                   help="zero KV pages when they are freed (defense in depth; costs time)")
    p.add_argument("--unsafe-disable-guard", default="", metavar="NAME[,NAME...]",
                   help=f"TURN OFF isolation guards, only to prove they are needed: {', '.join(GUARD_NAMES)}")
    p.add_argument("--cache-dir", default=None, help="converted-weights cache (default ~/.cache/isoserve)")
    p.add_argument("--enable-failpoints", action="store_true",
                   help="arm the fault points named in ISOSERVE_FAILPOINTS (testing only)")


def _pool_args(p: argparse.ArgumentParser) -> None:
    for group in ("prefill", "decode"):
        p.add_argument(f"--{group}-kv-tokens", type=int, default=None,
                       help=f"KV pool of each {group} worker, in tokens (default: 2 x context length)")
        p.add_argument(f"--{group}-kv-memory-gb", type=float, default=None,
                       help=f"KV pool of each {group} worker as a memory budget in GiB")
    p.add_argument("--kv-tokens", type=int, default=None, help="KV pool in tokens (aggregated mode)")
    p.add_argument("--kv-memory-gb", type=float, default=None, help="KV pool in GiB (aggregated mode)")
    p.add_argument("--min-kv-headroom", type=float, default=1.0,
                   help="each pool must hold context length x this many tokens (docs recommend 2.0)")
    p.add_argument("--allow-undersized-kv", action="store_true",
                   help="accept pools below the headroom and lower the advertised limit to fit them")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="isoserve", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("ISOSERVE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="start the router and its workers (the main job)")
    _engine_args(serve)
    _pool_args(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--mode", default="disaggregated", choices=["disaggregated", "aggregated"])
    serve.add_argument("--prefill-workers", type=int, default=1)
    serve.add_argument("--decode-workers", type=int, default=1)
    serve.add_argument("--prefill-max-num-seqs", type=int, default=None, metavar="N",
                       help="prompts a prefill worker computes in one step at most (default: "
                            "--max-num-seqs); fewer hand their KV to decode sooner")
    serve.add_argument("--prefill-max-batched-tokens", type=int, default=None, metavar="N",
                       help="prompt tokens a prefill worker computes in one step at most (default: "
                            "--max-batched-tokens, at least 4096): a burst of prompts in one step")
    serve.add_argument("--prefill-gather-ms", type=float, default=20.0, metavar="MS",
                       help="a prefill worker with no step running holds new prompts until none has "
                            "arrived for MS milliseconds (at most 5x MS), so that a burst is computed "
                            "in one step (default 20; 0 = start at once)")
    serve.add_argument("--aggregated-workers", type=int, default=1, help="workers in --mode aggregated")
    serve.add_argument("--tenants", default=os.path.expanduser("~/.config/isoserve/tenants.toml"),
                       help="tenants file (TOML, keys stored hashed); created on first start")
    serve.add_argument("--listen-workers", default=None,
                       help="endpoint workers register on, e.g. tcp://0.0.0.0:7100 (default: a local ipc socket)")
    serve.add_argument("--cluster-secret-file", default=None,
                       help="shared secret for router/worker messages (default: a fresh one for local workers)")
    limits = serve.add_argument_group("deadlines (each ends a request with its own error code)")
    limits.add_argument("--queue-timeout", type=float, default=120.0,
                        help="seconds a request may wait before work on it begins: 503 queue_timeout "
                             "(default 120)")
    limits.add_argument("--transfer-timeout", type=float, default=180.0,
                        help="seconds a decode worker waits for a request's KV after reserving its "
                             "pages, prefill queueing included (keep it above --queue-timeout): "
                             "kv_transfer_incomplete (default 180)")
    limits.add_argument("--generation-timeout", type=float, default=900.0,
                        help="seconds from arrival to the last token: 504 generation_timeout (default 900)")
    bounds = serve.add_argument_group("backpressure (beyond these, 429 with Retry-After)")
    bounds.add_argument("--max-requests-in-flight", type=int, default=256,
                        help="requests admitted and not ended, over all tenants (default 256)")
    bounds.add_argument("--max-tokens-in-flight", type=int, default=None,
                        help="prompt + max_tokens summed over those requests (default: no bound)")
    bounds.add_argument("--tenant-max-concurrent-requests", type=int, default=64,
                        help="per tenant, unless its [tenants.limits] says otherwise (default 64)")
    bounds.add_argument("--tenant-max-queued-tokens", type=int, default=None,
                        help="per tenant, unless its [tenants.limits] says otherwise (default: no bound)")
    serve.add_argument("--heartbeat-timeout", type=float, default=5.0,
                       help="a worker silent this long is marked down (default 5 s)")
    serve.add_argument("--shutdown-grace", type=float, default=30.0,
                       help="on SIGTERM, seconds in-flight requests get to finish; the rest end with "
                            "503 server_shutting_down (default 30)")
    serve.add_argument("--threads-per-worker", type=int, default=None,
                       help="torch threads per worker process, fixed (default: cores / workers, "
                            "and a busy worker takes the cores of idle ones; see --share-idle-cores)")
    serve.add_argument("--share-idle-cores", action=argparse.BooleanOptionalAction, default=True,
                       help="workers on this host share its cores (see --core-sharing), so "
                            "prefill gets every core while decode waits and the other way round "
                            "(default on; off, or --threads-per-worker, pins each worker to "
                            "cores / workers threads)")
    serve.add_argument("--core-sharing", choices=POLICIES, default="split",
                       help="how workers sharing the cores use them: split (default: each busy "
                            "worker takes cores / busy workers threads, and their steps overlap) "
                            "or turns (one busy worker steps at a time with every core, the busy "
                            "ones taking turns step by step: lower tails, higher median TTFT "
                            "on 2 cores)")
    serve.add_argument("--worker-start-timeout", type=float, default=900.0)

    worker = sub.add_parser("worker", help="run one prefill or decode worker that joins a router")
    _engine_args(worker)
    worker.add_argument("--role", required=True, choices=["prefill", "decode", "aggregated"])
    worker.add_argument("--router", required=True, help="router's worker endpoint, e.g. tcp://HOST:7100")
    worker.add_argument("--cluster-secret-file", default=None,
                        help="file holding the cluster secret (or set ISOSERVE_CLUSTER_SECRET)")
    worker.add_argument("--worker-id", default="")
    worker.add_argument("--kv-endpoint", default="",
                        help="decode: where prefill workers send KV, e.g. tcp://10.0.0.5:7200")
    worker.add_argument("--kv-tokens", type=int, default=None, help="KV pool in tokens")
    worker.add_argument("--kv-memory-gb", type=float, default=None, help="KV pool in GiB")
    worker.add_argument("--transfer-timeout", type=float, default=180.0,
                        help="seconds to wait for a request's KV after reserving its pages")
    worker.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    worker.add_argument("--core-share-file", default=None,
                        help="share the host's cores with the other workers using this file (made "
                             "by serve, one slot per worker): --threads is then only the start")
    worker.add_argument("--core-share-slot", type=int, default=0, help="this worker's slot in that file")
    worker.add_argument("--core-sharing", choices=POLICIES, default="split",
                        help="with --core-share-file: split the cores, or take turns with all of them")
    worker.add_argument("--prefill-gather-ms", type=float, default=20.0, metavar="MS",
                        help="prefill: hold new prompts until none has arrived for MS milliseconds "
                             "(at most 5x MS) before a step, so that a burst is one step (default 20)")

    check = sub.add_parser("check-config", help="audit pool sizes against the context, without serving")
    _engine_args(check)
    _pool_args(check)
    check.add_argument("--mode", default="disaggregated", choices=["disaggregated", "aggregated"])

    tenants = sub.add_parser("tenants", help="manage tenants and their API keys")
    tsub = tenants.add_subparsers(dest="tenants_command", required=True)
    add = tsub.add_parser("add", help="add a tenant and print its new API key (shown once)")
    add.add_argument("name")
    add.add_argument("--tenants", required=True, help="tenants file (TOML)")
    add.add_argument("--admin", action="store_true", help="may read /status")
    add.add_argument("--max-concurrent-requests", type=int, default=None,
                     help="this tenant's requests in flight at once (default: serve's)")
    add.add_argument("--max-queued-tokens", type=int, default=None,
                     help="prompt + max_tokens over this tenant's requests in flight (default: serve's)")

    from isoserve.probe.arguments import add_arguments as add_probe_arguments
    probe = sub.add_parser("probe", help="black-box leak probe of an OpenAI-compatible server "
                                         "(exit 0: no findings, 1: findings, 2: could not run)")
    add_probe_arguments(probe)

    from isoserve.bench.main import add_arguments as add_bench_arguments
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server, or the offline engine")
    add_bench_arguments(bench)
    return parser


def decide_dtype(args: argparse.Namespace) -> None:
    """--dtype auto and --kv-dtype auto become the dtypes they stand for, once, here: the router
    sizes the pools with them and starts its workers with them, and every log line names them.
    `bench` against a URL (or a soak) runs no engine here: nothing to decide."""
    if args.command == "bench" and not (args.offline or args.roofline or args.prefill):
        return
    device = getattr(args, "device", "cpu")
    auto = AutoInputs.of(args)
    if getattr(args, "kv_dtype", None) is not None:
        try:
            args.dtype, args.kv_dtype = resolve_dtypes(args.dtype, args.kv_dtype, device, auto)
        except ValueError as e:
            raise SystemExit(f"isoserve: {e}") from None
    elif getattr(args, "dtype", None) == "auto":
        args.dtype = dtype_name("auto", device, auto)
    if getattr(args, "peer_dtype", None) is not None:  # the benchmarks' peers: the device's own choice
        args.peer_dtype = dtype_name(args.peer_dtype, device)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if hasattr(args, "unsafe_disable_guard"):
        args.disabled_guards = parse_guard_names(args.unsafe_disable_guard)
    decide_dtype(args)
    if args.command == "serve":
        from isoserve.server.launcher import serve
        return serve(args)
    if args.command == "worker":
        from isoserve.server.launcher import run_worker
        return run_worker(args)
    if args.command == "check-config":
        from isoserve.server.launcher import check_config
        return check_config(args)
    if args.command == "tenants":
        from isoserve.server.tenants import add_tenant
        limits = {"max_concurrent_requests": args.max_concurrent_requests,
                  "max_queued_tokens": args.max_queued_tokens}
        try:
            key = add_tenant(args.tenants, args.name, admin=args.admin, limits=limits)
        except ValueError as e:
            raise SystemExit(f"isoserve tenants add: {e}") from None
        print(f"added tenant {args.name!r} to {args.tenants}; its API key (shown only now): {key}")
        return 0
    if args.command == "probe":
        from isoserve.probe.main import run as run_probe
        return run_probe(args)
    if args.command == "bench":
        from isoserve.bench.main import run as run_bench
        return run_bench(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
