"""`isoserve serve`, `isoserve worker` and `isoserve check-config`: wiring processes together."""
from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from isoserve import event_loop
from isoserve.config import EngineConfig, parse_dtype, parse_kv_dtype

log = logging.getLogger("isoserve.serve")

GIB = 1024 ** 3


def _engine_config(args, *, kv_tokens=None, kv_memory_gb=None) -> EngineConfig:
    return EngineConfig(model=args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device,
                        page_size=args.page_size, context_length=args.context_length,
                        kv_tokens=kv_tokens,
                        kv_memory_bytes=int(kv_memory_gb * GIB) if kv_memory_gb else None,
                        max_num_seqs=args.max_num_seqs, max_batched_tokens=args.max_batched_tokens,
                        scrub_freed_pages=args.scrub_freed_pages, int4_max_rows=args.int4_max_rows,
                        int8_activations=args.int8_activations,
                        fused_kernels=args.fused_kernels,
                        disabled_guards=args.disabled_guards, cache_dir=args.cache_dir,
                        stream_interval=args.stream_interval)


def _warn_disabled_guards(names) -> None:
    if names:
        log.warning("!" * 78)
        log.warning("UNSAFE: isolation guards DISABLED: %s. One tenant's data may reach another "
                    "tenant's response. Use only to prove the guards are needed.", ", ".join(sorted(names)))
        log.warning("!" * 78)


def _model_or_exit(command: str, model: str, load):
    """load()'s result; where the model cannot be read (an unknown name, a folder without
    weights, weights that do not match their config, the default model's package missing), the
    command's exit with that one line instead of a traceback."""
    try:
        return load()
    except (ValueError, ModuleNotFoundError) as e:
        raise SystemExit(f"{command}: cannot load model {model!r}: {e}") from None


# ---- worker -------------------------------------------------------------------------------
def run_worker(args) -> NoReturn:
    import torch

    from isoserve import failpoints
    from isoserve.disagg.wire import load_cluster_secret
    from isoserve.disagg.worker import Worker, WorkerOptions
    from isoserve.heap import keep_freed_memory

    keep_freed_memory()
    if args.threads:
        torch.set_num_threads(args.threads)
    _warn_disabled_guards(args.disabled_guards)
    failpoints.configure(args.enable_failpoints)
    if args.role == "decode" and not args.kv_endpoint:
        raise SystemExit("a decode worker needs --kv-endpoint (where prefill workers send KV)")
    from isoserve.model.registry import resolve_model
    _model_or_exit("worker", args.model, lambda: resolve_model(args.model))  # before loading anything
    opts = WorkerOptions(role=args.role, router=args.router,
                         secret=load_cluster_secret(args.cluster_secret_file),
                         engine=_engine_config(args, kv_tokens=args.kv_tokens,
                                               kv_memory_gb=args.kv_memory_gb),
                         worker_id=args.worker_id, kv_endpoint=args.kv_endpoint,
                         transfer_timeout_s=args.transfer_timeout,
                         disabled_guards=args.disabled_guards,
                         core_share=((args.core_share_file, args.core_share_slot)
                                     if args.core_share_file else None),
                         core_sharing=args.core_sharing,
                         prefill_gather_s=args.prefill_gather_ms / 1000)
    worker = Worker(opts)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: setattr(worker, "stopping", True))
    _exit_now(worker.run())


# ---- check-config -------------------------------------------------------------------------
def _planned_pools(args, model_config, context_length: int) -> list[tuple[str, int]]:
    """(group, pool tokens) of each planned pool, by the arithmetic the workers themselves use."""
    from isoserve.kv.pool import KVPool

    kv_dtype = parse_kv_dtype(args.kv_dtype, args.dtype, args.device)
    groups = ["aggregated"] if args.mode == "aggregated" else ["prefill", "decode"]
    pools = []
    for group in groups:
        prefix = "" if group == "aggregated" else f"{group}_"
        cfg = _engine_config(args, kv_tokens=getattr(args, f"{prefix}kv_tokens"),
                             kv_memory_gb=getattr(args, f"{prefix}kv_memory_gb"))
        pages = KVPool.pages_for(model_config, args.page_size, kv_dtype,
                                 **cfg.pool_tokens_request(context_length))
        pools.append((group, pages * args.page_size))
    return pools


def check_config(args) -> int:
    from isoserve.admission import effective_prompt_limit
    from isoserve.model.loader import load_checkpoint
    from isoserve.server.audit import AuditSettings, audit_table, audit_worker

    ckpt = _model_or_exit("check-config", args.model,
                          lambda: load_checkpoint(args.model, parse_dtype(args.dtype), cache_dir=args.cache_dir))
    context = args.context_length or ckpt.config.max_position_embeddings
    settings = AuditSettings(args.mode, context, args.page_size, args.kv_dtype, args.min_kv_headroom,
                             args.allow_undersized_kv, "capacity_audit" not in args.disabled_guards)
    pools = _planned_pools(args, ckpt.config, context)
    rows = [(g, f"{g} (planned)", t, audit_worker(settings, g, t, args.page_size, context, args.kv_dtype))
            for g, t in pools]
    by_group = {g: [t for gg, t in pools if gg == g] for g, _ in pools}
    agg = by_group.get("aggregated", [])
    limit = effective_prompt_limit(context, by_group.get("prefill", agg), by_group.get("decode", agg))
    print(audit_table(settings, rows, limit))
    failed = any(r[3] for r in rows)
    print("configuration REFUSED: a pool cannot hold the context (see --min-kv-headroom, "
          "--allow-undersized-kv)" if failed else "configuration ok")
    return 2 if failed else 0


# ---- serve --------------------------------------------------------------------------------
def serve(args) -> NoReturn:
    try:
        status = event_loop.run(_serve(args))
    except KeyboardInterrupt:
        status = 0
    _exit_now(status)


def _exit_now(status: int) -> NoReturn:
    """End a serve or worker process that has shut down in order: its requests ended, its
    sockets closed, its workers stopped. The interpreter's own teardown would then only unload
    modules, and with torch imported that takes ~0.6 s (measured here), which every stop and
    every worker restart would wait for."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _die_with_parent() -> None:
    """In a worker started by `serve`: get SIGTERM if serve dies, even by SIGKILL (Linux)."""
    import ctypes
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not Linux: serve's own shutdown still stops its workers
        pass


def _local_endpoint(endpoint: str) -> str:
    """Where a worker on this host reaches an endpoint the router bound to all interfaces."""
    return endpoint.replace("://0.0.0.0:", "://127.0.0.1:").replace("://*:", "://127.0.0.1:")


def _max_num_seqs(args, role: str) -> int:
    if role == "prefill" and args.prefill_max_num_seqs:
        return args.prefill_max_num_seqs
    return args.max_num_seqs


# A prefill worker's default step budget: 32 prompts of ~100 tokens in one step, not two (the
# first of which would start decoding, and then finish, apart from the rest: disagg/bursts.py).
PREFILL_MIN_BATCHED_TOKENS = 4096


def _max_batched_tokens(args, role: str) -> int:
    if role != "prefill":
        return args.max_batched_tokens
    return args.prefill_max_batched_tokens or max(args.max_batched_tokens, PREFILL_MIN_BATCHED_TOKENS)


def _worker_command(args, role: str, index: int, router: str, kv_endpoint: str, threads: int,
                    core_share: tuple[str, int] | None = None) -> list[str]:
    prefix = "" if role == "aggregated" else f"{role}_"
    cmd = [sys.executable, "-m", "isoserve.cli", "--log-level", args.log_level, "worker",
           "--role", role, "--router", router, "--worker-id", f"{role}-{index}",
           "--model", args.model, "--dtype", args.dtype, "--kv-dtype", args.kv_dtype, "--device", args.device,
           "--page-size", str(args.page_size), "--max-num-seqs", str(_max_num_seqs(args, role)),
           "--max-batched-tokens", str(_max_batched_tokens(args, role)),
           "--transfer-timeout", str(args.transfer_timeout), "--threads", str(threads),
           "--stream-interval", str(args.stream_interval)]
    if args.int4_max_rows is not None:  # otherwise each worker takes its own kernel's default
        cmd += ["--int4-max-rows", str(args.int4_max_rows)]
    if args.int8_activations is not None:
        cmd.append("--int8-activations" if args.int8_activations else "--no-int8-activations")
    if args.context_length:
        cmd += ["--context-length", str(args.context_length)]
    if role == "prefill":
        cmd += ["--prefill-gather-ms", str(args.prefill_gather_ms)]
    if core_share:
        cmd += ["--core-share-file", core_share[0], "--core-share-slot", str(core_share[1]),
                "--core-sharing", args.core_sharing]
    if not args.fused_kernels:
        cmd.append("--no-fused-kernels")
    if getattr(args, f"{prefix}kv_tokens") is not None:
        cmd += ["--kv-tokens", str(getattr(args, f"{prefix}kv_tokens"))]
    if getattr(args, f"{prefix}kv_memory_gb") is not None:
        cmd += ["--kv-memory-gb", str(getattr(args, f"{prefix}kv_memory_gb"))]
    if kv_endpoint:
        cmd += ["--kv-endpoint", kv_endpoint]
    if args.scrub_freed_pages:
        cmd.append("--scrub-freed-pages")
    if args.enable_failpoints:
        cmd.append("--enable-failpoints")
    if args.disabled_guards:
        cmd += ["--unsafe-disable-guard", ",".join(sorted(args.disabled_guards))]
    if args.cache_dir:
        cmd += ["--cache-dir", args.cache_dir]
    return cmd


async def _serve(args) -> int:
    from isoserve.disagg.cores import create_share_file, host_cores
    from isoserve.disagg.wire import load_cluster_secret, new_cluster_secret
    from isoserve.model.loader import conversion_needed, load_checkpoint
    from isoserve.server.metrics import Metrics
    from isoserve.server.supervisor import Supervisor

    _warn_disabled_guards(args.disabled_guards)
    dtype = parse_dtype(args.dtype)

    def load():
        return _model_or_exit("serve", args.model, lambda: load_checkpoint(args.model, dtype, cache_dir=args.cache_dir))

    # An unknown model fails here, before any worker starts. A GGUF's first start converts it
    # here, once, so that the workers read the cache instead of each converting it at once; that
    # checkpoint then serves the router too.
    first_start = _model_or_exit("serve", args.model, lambda: conversion_needed(args.model, dtype, args.cache_dir))
    ckpt = load() if first_start else None
    runtime_dir = Path(tempfile.mkdtemp(prefix="isoserve-"))
    listen = args.listen_workers or f"ipc://{runtime_dir}/router.sock"
    if args.cluster_secret_file:
        secret = load_cluster_secret(args.cluster_secret_file)
    else:
        secret = new_cluster_secret().encode()

    plan = ([("aggregated", args.aggregated_workers)] if args.mode == "aggregated" else
            [("prefill", args.prefill_workers), ("decode", args.decode_workers)])
    total = sum(n for _, n in plan)
    cores = host_cores()
    threads = args.threads_per_worker or max(1, cores // max(total, 1))
    share_file = None
    if args.share_idle_cores and not args.threads_per_worker and total > 1 and args.device == "cpu":
        share_file = str(runtime_dir / "cores.share")
        create_share_file(share_file, total)
        if args.core_sharing == "turns":
            log.info("%d worker(s) share %d core(s) by turns: a busy worker steps with all %d while "
                     "the others wait (--no-share-idle-cores pins %d thread(s) each)",
                     total, cores, cores, threads)
        else:
            log.info("%d worker(s) share %d core(s): %d thread(s) each while all are busy, up to %d "
                     "while the others are idle (--core-sharing turns steps one at a time with "
                     "all of them; --no-share-idle-cores pins them)", total, cores, threads, cores)
    else:
        log.info("%d worker(s), %d torch thread(s) each, on %d core(s)", total, threads, cores)
    if args.mode != "aggregated":
        log.info("steps: a prefill worker computes up to %d prompt tokens (%d prompts) a step, holding "
                 "a burst of prompts until none arrives for %g ms (--prefill-gather-ms); a decode "
                 "worker decodes up to %d sequences a step", _max_batched_tokens(args, "prefill"),
                 _max_num_seqs(args, "prefill"), args.prefill_gather_ms, _max_num_seqs(args, "decode"))
    if args.stream_interval > 1:
        log.info("streams: a running request's tokens go out every %d tokens (--stream-interval); "
                 "its first token and its end at once", args.stream_interval)
    slots = iter(range(total))
    env = {**os.environ, "ISOSERVE_CLUSTER_SECRET": secret.decode()}
    metrics = Metrics()
    supervisor = Supervisor(lambda cmd: subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent), metrics)
    router = None
    try:
        for role, count in plan:
            for i in range(count):
                kv = f"ipc://{runtime_dir}/kv-{role}-{i}.sock" if role == "decode" else ""
                supervisor.start(f"{role}-{i}", role,
                                 _worker_command(args, role, i, _local_endpoint(listen), kv, threads,
                                                 (share_file, next(slots)) if share_file else None))
        # The workers load the model (seconds) while this process imports the HTTP side and
        # loads the tokenizer; its router binds after they started. zmq queues a worker's
        # registration until the router listens, so an early one just waits for it.
        import uvicorn

        from isoserve.engine.deadlines import Deadlines
        from isoserve.server.app import create_app
        from isoserve.server.backpressure import LoadLimits
        from isoserve.server.http_protocol import BoundedHeadProtocol
        from isoserve.server.limits import KEEP_ALIVE_TIMEOUT_S
        from isoserve.server.router import Router, RouterSettings
        from isoserve.server.tenants import TenantStore, ensure_tenants_file

        ckpt = ckpt or load()  # config and tokenizer for the router
        settings = RouterSettings(model_name=ckpt.name,
                                  context_length=args.context_length or ckpt.config.max_position_embeddings,
                                  page_size=args.page_size, mode=args.mode, kv_dtype=args.kv_dtype,
                                  min_kv_headroom=args.min_kv_headroom,
                                  allow_undersized_kv=args.allow_undersized_kv,
                                  disabled_guards=args.disabled_guards,
                                  deadlines=Deadlines(args.queue_timeout, args.generation_timeout),
                                  heartbeat_timeout_s=args.heartbeat_timeout)
        router = Router(settings, secret, listen, ckpt.tokenizer, metrics)
        del ckpt  # the router keeps only the tokenizer
        await router.start()
        if total:
            log.info("waiting for %d worker(s) to load the model and register", total)
            await _wait_for_workers(router, supervisor.processes(), total, args.worker_start_timeout)
            print(router.audit_table(), flush=True)
            refused = [w for w in router.workers.values() if w.state == "refused"]
            if refused:
                print("serve: capacity audit FAILED: a KV pool cannot hold the context length "
                      "(raise the pool size, or pass --allow-undersized-kv to lower the advertised "
                      "limit instead)", file=sys.stderr, flush=True)
                return 2
        else:
            log.info("no local workers: waiting for workers to register on %s (secret from %s)",
                     listen, args.cluster_secret_file or "ISOSERVE_CLUSTER_SECRET")
        supervisor.watch(router)
        new_key = ensure_tenants_file(args.tenants)
        tenants = TenantStore.load(args.tenants)
        limits = LoadLimits(args.max_requests_in_flight, args.max_tokens_in_flight,
                            args.tenant_max_concurrent_requests, args.tenant_max_queued_tokens)
        app = create_app(router, tenants, metrics, served_model_names=[settings.model_name],
                         limits=limits)
        server = uvicorn.Server(uvicorn.Config(
            app, host=args.host, port=args.port, log_level="warning", lifespan="off",
            http=BoundedHeadProtocol, timeout_keep_alive=KEEP_ALIVE_TIMEOUT_S,
            # A last resort only: _drain_on_exit ends every request explicitly before this.
            timeout_graceful_shutdown=int(args.shutdown_grace) + 10))
        _print_how_to_call(args, settings.model_name, router.max_model_len(), new_key)
        _log_limits(args, limits)
        # uvicorn re-raises the signal that stopped it once it is done; with the default
        # SIGTERM action that would kill us before the workers are stopped below.
        signal.signal(signal.SIGTERM, lambda *_: None)
        drain = asyncio.create_task(_drain_on_exit(server, app.state.api, router, args.shutdown_grace))
        await server.serve()
        if server.should_exit:
            # uvicorn returns once the last connection closed, which can be within the drain's
            # 0.1 s poll of the last request ending: let it see that and say how the drain
            # ended (it is bounded by the grace period) rather than cancel it mid-sentence.
            await drain
        else:
            drain.cancel()
        log.info("serve: stopped; stopping the workers")
        return 0
    finally:
        await supervisor.stop()
        if router is not None:
            await router.stop()
        shutil.rmtree(runtime_dir, ignore_errors=True)  # the sockets and the core-share file


async def _drain_on_exit(server, api, router, grace_s: float) -> None:
    """Graceful shutdown. uvicorn, on SIGTERM or SIGINT, stops accepting connections and waits
    for the open ones; here new requests on those get 503 server_shutting_down, requests in
    flight get `grace_s` to finish, and whatever is left then ends with that explicit error
    (and is aborted on its workers) so every client gets an answer before the process exits."""
    from isoserve.errors import ServerShuttingDown

    while not server.should_exit:
        await asyncio.sleep(0.1)
    api.start_draining()
    log.warning("serve: shutting down: no new requests; %d in flight get up to %.0f s to finish",
                api.in_flight(), grace_s)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    while api.in_flight() and loop.time() < deadline:
        await asyncio.sleep(0.1)
    if api.in_flight():
        ended = router.end_all(ServerShuttingDown(
            f"The server shut down before this request finished (grace period {grace_s:g} s)."))
        log.warning("serve: grace period over: ended %d request(s) with server_shutting_down", ended)
    else:
        log.info("serve: every request in flight finished")


def _log_limits(args, limits) -> None:
    log.info("limits: queue %.0f s, transfer %.0f s, generation %.0f s; in flight at most %s "
             "requests%s; per tenant %s requests%s (tenants file may override); shutdown grace %.0f s",
             args.queue_timeout, args.transfer_timeout, args.generation_timeout,
             limits.max_requests or "unbounded",
             f" / {limits.max_tokens} tokens" if limits.max_tokens else "",
             limits.tenant_max_requests or "unbounded",
             f" / {limits.tenant_max_tokens} tokens" if limits.tenant_max_tokens else "",
             args.shutdown_grace)


async def _wait_for_workers(router, procs, total: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while len(router.workers) < total:
        # A worker the capacity audit refused exits on its own, maybe before its peers register:
        # that is the audit's verdict (the table and exit status 2 follow), not a failed start.
        refused = {w.pid for w in router.workers.values() if w.state == "refused"}
        dead = [p for p in procs if p.poll() is not None and p.pid not in refused]
        if dead:
            raise SystemExit(f"serve: a worker exited with status {dead[0].returncode} before registering")
        if loop.time() > deadline:
            raise SystemExit(f"serve: only {len(router.workers)} of {total} workers registered "
                             f"within {timeout:.0f} s")
        await asyncio.sleep(0.1)


def _print_how_to_call(args, model: str, limit: int, new_key: str | None) -> None:
    base = f"http://{args.host}:{args.port}"
    key = new_key or "$ISOSERVE_API_KEY"
    lines = [f"isoserve {args.mode} serving {model} ({args.dtype}, KV cache {args.kv_dtype}) on {base}; "
             f"max_model_len={limit}"]
    if new_key:
        lines.append(f"First start: created {args.tenants} with tenant 'default' (admin). Its API key, "
                     f"shown only now:\n    {new_key}")
    lines += ["Call it:",
              f"    curl {base}/v1/completions -H 'Authorization: Bearer {key}' "
              f"-H 'Content-Type: application/json' -d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'",
              "    python -c \"from openai import OpenAI; "
              f"c = OpenAI(base_url='{base}/v1', api_key='{key}'); "
              f"print(c.chat.completions.create(model='{model}', messages=[{{'role': 'user', 'content': 'Hi'}}]).choices[0].message.content)\""]
    print("\n".join(lines), flush=True)
