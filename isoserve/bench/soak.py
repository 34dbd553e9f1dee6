"""`isoserve bench --soak`: hours of mixed traffic in minutes, with faults, and an account of
every request.

    isoserve bench --soak --base-url http://127.0.0.1:8000 --soak-keys KEY1,KEY2,KEY3,KEY4 \\
        --admin-key ADMIN_KEY --duration 600 --concurrency 24 --abort-fraction 0.05 \\
        --kill-worker-every 60 --probe-after --json soak.json

    check the URL is loopback -> /v1/models (model, max_model_len) -> calibrate prompt words ->
    issue requests (closed loop of C, or Poisson at R/s) until --duration or --max-requests,
    while killing a worker every --kill-worker-every seconds -> wait for the outstanding ones
    (each at most --hang-after) -> wait for killed workers to come back -> leak probe
    (--probe-after) -> table, JSON, exit status

Requests: tenants in turn; ShareGPT-like prompt and output lengths (workload.py) capped to the
advertised max_model_len; completions or chat, streamed or not (--chat-fraction,
--stream-fraction). A random --abort-fraction of them are abandoned on purpose: the connection
is closed before the answer (at a random time up to the recent typical latency) or, for
streams, after a random number of events. Outcomes: see soak_report.py.

Worker kills: GET /status with the admin key, pick an `up` worker of --kill-roles at random,
and SIGKILL its pid -- only when /status says it runs on this host and the process is an
isoserve one. That is why the soak refuses any base URL that is not loopback.
"""
from __future__ import annotations

import asyncio
import ipaddress
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

from isoserve import event_loop
from isoserve.bench.calibrate import Calibration, calibrate
from isoserve.bench.soak_report import (Kill, SoakRecord, SoakResult, exit_status, render_table,
                                        summarize, write_json)
from isoserve.bench.soak_requests import Plan, Tenant, exchange
from isoserve.bench.workload import lengths, random_words

ROLES = ("prefill", "decode", "aggregated")
DEFAULT_CONCURRENCY = 8
MAX_OPEN_LOOP_IN_FLIGHT = 1024
RECOVERY_WAIT_S = 60.0       # after the load: how long killed workers may take to come back
STATUS_POLL_S = 0.5
FIRST_ABORT_GUESS_S = 1.0    # the typical latency before any request has finished
BUSY_BACKOFF_S = 0.5         # closed loop: pause after a 429/503 without Retry-After
MAX_BACKOFF_S = 10.0         # ... and at most this long with one


class SoakError(Exception):
    """The soak cannot run (exit status 2)."""


# ---- options ----------------------------------------------------------------------------------

def check_loopback(base_url: str) -> None:
    """The soak kills processes: it talks only to a server on this machine's loopback."""
    parts = urllib.parse.urlsplit(base_url if "://" in base_url else "http://" + base_url)
    host = (parts.hostname or "").lower()
    if host == "localhost":
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SoakError(f"refusing to soak {base_url!r}: the soak may kill worker processes, so it runs "
                        "only against a loopback address (127.0.0.1, ::1 or localhost)")


_ADDED_LINE = re.compile(r"tenant '([^']+)'.*:\s*(\S+)\s*$")  # `isoserve tenants add`'s output


def parse_tenant(item: str, index: int) -> Tenant:
    """KEY, NAME=KEY, NAME KEY, or the line `isoserve tenants add` prints."""
    item = item.strip()
    added = _ADDED_LINE.search(item)
    if added:
        return Tenant(added.group(1), added.group(2))
    if "=" in item and " " not in item:
        name, _, key = item.partition("=")
        return Tenant(name, key)
    words = item.split()
    if len(words) == 2:
        return Tenant(words[0], words[1])
    if len(words) == 1:
        return Tenant(f"tenant-{index}", words[0])
    raise SoakError(f"cannot read a tenant key from {item!r}: use KEY, NAME=KEY or NAME KEY")


def read_tenants_file(path: str) -> list[str]:
    """A text file of tenant keys, one a line (KEY, NAME=KEY or NAME KEY); # starts a comment.
    Not the server's tenants.toml, which holds only hashes of the keys."""
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise SoakError(f"cannot read --soak-tenants-file: {e}") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]


@dataclass
class SoakConfig:
    base_url: str
    tenants: list[Tenant]
    admin_key: str | None = None
    model: str | None = None
    duration: float = 600.0
    max_requests: int | None = None
    concurrency: int | None = DEFAULT_CONCURRENCY
    request_rate: float | None = None
    abort_fraction: float = 0.05
    kill_worker_every: float | None = None
    kill_roles: tuple[str, ...] = ROLES
    hang_after: float = 300.0
    seed: int = 0
    temperature: float = 0.0
    chat_fraction: float = 0.5
    stream_fraction: float = 0.5
    max_prompt_tokens: int | None = None
    max_output_tokens: int | None = None
    probe_after: bool = False
    probe_json: str | None = None
    progress_every: float = 5.0

    def describe(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("tenants", "admin_key")}
        out["tenants"] = [t.name for t in self.tenants]
        out["kill_roles"] = list(self.kill_roles)
        return out


def config_from_args(args) -> SoakConfig:
    if not args.base_url:
        raise SoakError("give --base-url")
    items = list(args.soak_keys or [])
    if args.soak_tenants_file:
        items += read_tenants_file(args.soak_tenants_file)
    tenants = [parse_tenant(item, i) for i, item in enumerate(items)]
    if not tenants:
        raise SoakError("give the tenants' API keys: --soak-keys KEY1,KEY2,... or --soak-tenants-file PATH")
    if len({t.name for t in tenants}) < len(tenants):  # unnamed keys get tenant-<i>; named ones must differ
        raise SoakError("two tenants have the same name")
    rate = concurrency = None
    if args.request_rate:
        if len(args.request_rate) != 1:
            raise SoakError("a soak runs at one --request-rate")
        rate = args.request_rate[0]
    elif len(args.concurrency) == 1:
        concurrency = args.concurrency[0]
    elif args.concurrency == [1, 8, 32]:  # the sweep's default: not given
        concurrency = DEFAULT_CONCURRENCY
    else:
        raise SoakError("a soak runs at one --concurrency")
    for name in ("abort_fraction", "chat_fraction", "stream_fraction"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise SoakError(f"--{name.replace('_', '-')} must be between 0 and 1")
    if args.duration <= 0 or args.hang_after <= 0:
        raise SoakError("--duration and --hang-after must be positive")
    if args.max_requests is not None and args.max_requests < 1:
        raise SoakError("--max-requests must be at least 1")
    roles = tuple(args.kill_roles)
    if unknown := [r for r in roles if r not in ROLES]:
        raise SoakError(f"unknown --kill-roles {unknown}: use {', '.join(ROLES)}")
    if args.kill_worker_every is not None:
        if args.kill_worker_every <= 0:
            raise SoakError("--kill-worker-every must be positive")
        if not args.admin_key:
            raise SoakError("--kill-worker-every needs --admin-key (it reads worker pids from /status)")
    if args.probe_after and len(tenants) < 2:
        raise SoakError("--probe-after needs at least two tenant keys (victims and attackers)")
    return SoakConfig(base_url=args.base_url, tenants=tenants, admin_key=args.admin_key, model=args.model,
                      duration=args.duration, max_requests=args.max_requests, concurrency=concurrency,
                      request_rate=rate, abort_fraction=args.abort_fraction,
                      kill_worker_every=args.kill_worker_every, kill_roles=roles, hang_after=args.hang_after,
                      seed=args.seed, temperature=args.temperature, chat_fraction=args.chat_fraction,
                      stream_fraction=args.stream_fraction, max_prompt_tokens=args.soak_max_prompt_tokens,
                      max_output_tokens=args.soak_max_output_tokens, probe_after=args.probe_after,
                      probe_json=args.probe_json, progress_every=args.progress_every)


# ---- the run ----------------------------------------------------------------------------------

@dataclass
class _Counts:
    issued: int = 0
    in_flight: int = 0
    outcomes: Counter = field(default_factory=Counter)


class Soak:
    def __init__(self, cfg: SoakConfig, log=None):
        self.cfg = cfg
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.root = cfg.base_url.rstrip("/")
        if self.root.endswith("/v1"):
            self.root = self.root[:-3]
        self.rng = random.Random(cfg.seed)             # the workload
        self.kill_rng = random.Random(cfg.seed + 1)    # which worker dies: independent of the workload
        self.records: list[SoakRecord] = []
        self.kills: list[Kill] = []
        self.kill_skips: list[dict] = []
        self.counts = _Counts()
        self.typical_latency = FIRST_ABORT_GUESS_S
        self.issuing = False
        self.interrupted = False
        self.t0 = 0.0
        self.calibration = Calibration()
        self.length_cap: int | None = None

    def now(self) -> float:
        return time.monotonic() - self.t0

    # ---- setup ----
    async def _discover(self, client: httpx.AsyncClient) -> tuple[str, int | None]:
        headers = {"Authorization": f"Bearer {self.cfg.tenants[0].key}"}
        try:
            r = await client.get("/v1/models", headers=headers)
            cards = r.json().get("data", []) if r.status_code == 200 else []
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise SoakError(f"GET {self.root}/v1/models failed: {type(e).__name__}: {e}") from None
        if not cards and self.cfg.model is None:
            raise SoakError(f"GET /v1/models with the first tenant key answered HTTP {r.status_code} "
                            f"and no model ({r.text[:200]!r}); check the keys")
        model = self.cfg.model or cards[0]["id"]
        card = next((c for c in cards if c.get("id") == model), {})
        return model, card.get("max_model_len")

    async def _status(self, client: httpx.AsyncClient) -> dict:
        if not self.cfg.admin_key:
            raise SoakError("no --admin-key")
        try:
            r = await client.get("/status", headers={"Authorization": f"Bearer {self.cfg.admin_key}"},
                                 timeout=10.0)
            data = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise SoakError(f"GET /status failed: {type(e).__name__}") from None
        if r.status_code != 200 or not isinstance(data, dict):
            raise SoakError(f"GET /status answered HTTP {r.status_code}: {r.text[:200]!r}")
        return data

    # ---- the workload ----
    def _may_issue(self) -> bool:
        if self.interrupted:
            return False
        if self.cfg.max_requests is not None and self.counts.issued >= self.cfg.max_requests:
            return False
        return self.now() < self.cfg.duration

    def _next_plan(self, model: str) -> Plan:
        cfg, rng = self.cfg, self.rng
        index = self.counts.issued
        self.counts.issued += 1
        tenant = cfg.tenants[index % len(cfg.tenants)]
        prompt, output = lengths("sharegpt-like", 1, rng, 0, 0, self.length_cap)[0]
        prompt = min(prompt, cfg.max_prompt_tokens or prompt)
        output = min(output, cfg.max_output_tokens or output)
        api = "chat" if rng.random() < cfg.chat_fraction else "completions"
        stream = rng.random() < cfg.stream_fraction
        text = " ".join(random_words(rng, self.calibration.words_for(prompt)))
        body: dict = {"model": model, "max_tokens": output, "temperature": cfg.temperature}
        if cfg.temperature > 0:
            body["seed"] = cfg.seed + index
        if api == "chat":
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        record = SoakRecord(index, tenant.name, api, stream, prompt, output)
        plan = Plan(record, tenant, body)
        if rng.random() < cfg.abort_fraction:
            if stream and rng.random() < 0.5:
                plan.abort_after_events = rng.randint(1, max(1, output - 1))
                record.abort = f"after {plan.abort_after_events} events"
            else:
                plan.abort_before_s = rng.random() * self.typical_latency
                record.abort = f"before the answer, at {plan.abort_before_s:.3f} s"
        return plan

    async def _send(self, client: httpx.AsyncClient, plan: Plan) -> SoakRecord:
        rec = plan.record
        rec.start = self.now()
        self.records.append(rec)
        self.counts.in_flight += 1
        task = None
        try:
            async with asyncio.timeout(self.cfg.hang_after):
                task = asyncio.ensure_future(exchange(client, plan))
                done, _ = await asyncio.wait({task}, timeout=plan.abort_before_s)
                if task in done:
                    task.result()
                else:  # cancelling the exchange closes its connection: the server sees a disconnect
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    rec.finish("aborted_by_client", detail="closed before the answer was complete")
        except TimeoutError:
            rec.finish("hung", detail=f"no final answer within {self.cfg.hang_after:g} s")
        except Exception as e:  # a bug of ours must not hide a request either
            rec.finish("lost", detail=f"soak client error {type(e).__name__}: {e}")
        finally:
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            rec.end = self.now()
            self.counts.in_flight -= 1
            if not rec.outcome:
                rec.finish("lost", detail="no outcome recorded")
            self.counts.outcomes[rec.outcome] += 1
            if rec.outcome == "ok":  # aborts before the answer land anywhere up to a typical latency
                self.typical_latency = 0.9 * self.typical_latency + 0.1 * (rec.end - rec.start)
        return rec

    async def _closed_loop(self, client: httpx.AsyncClient, model: str) -> None:
        async def user() -> None:
            while self._may_issue():
                rec = await self._send(client, self._next_plan(model))
                if rec.outcome == "error" and rec.status in (429, 503):
                    # As a client should: wait as told (or a little) instead of spinning on
                    # errors while a worker restarts.
                    pause = min(MAX_BACKOFF_S, BUSY_BACKOFF_S if rec.retry_after is None else rec.retry_after)
                    await asyncio.sleep(max(0.0, min(pause, self.cfg.duration - self.now())))

        await asyncio.gather(*(user() for _ in range(self.cfg.concurrency)))

    async def _open_loop(self, client: httpx.AsyncClient, model: str) -> None:
        arrivals = random.Random(self.cfg.seed ^ 0x50A4)
        tasks: set[asyncio.Task] = set()
        due = 0.0
        while self._may_issue():
            due += arrivals.expovariate(self.cfg.request_rate)
            wait = min(due, self.cfg.duration) - self.now()
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._may_issue():
                break
            while len(tasks) >= MAX_OPEN_LOOP_IN_FLIGHT:
                await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            task = asyncio.create_task(self._send(client, self._next_plan(model)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    # ---- worker kills ----
    async def _kill_loop(self, client: httpx.AsyncClient, watchers: list[asyncio.Task]) -> None:
        every = self.cfg.kill_worker_every
        n = 0
        while True:
            n += 1
            if n * every >= self.cfg.duration:
                return
            await asyncio.sleep(max(0.0, n * every - self.now()))
            if not self.issuing:
                return
            await self._kill_one(client, watchers)

    def _skip(self, reason: str) -> None:
        self.kill_skips.append({"at_s": round(self.now(), 3), "reason": reason})
        self.log(f"soak {self.now():5.0f}s: no kill: {reason}")

    async def _kill_one(self, client: httpx.AsyncClient, watchers: list[asyncio.Task]) -> None:
        try:
            status = await self._status(client)
        except SoakError as e:
            self._skip(str(e))
            return
        workers = [w for w in status.get("workers") or [] if isinstance(w, dict)]
        up = [w for w in workers if w.get("state") == "up" and w.get("role") in self.cfg.kill_roles]
        if not up:
            self._skip(f"no worker up with role {'/'.join(self.cfg.kill_roles)}")
            return
        victim = self.kill_rng.choice(up)
        role, wid, pid = victim.get("role"), str(victim.get("id")), int(victim.get("pid") or 0)
        here = socket.gethostname()
        if victim.get("host") != here:
            self._skip(f"worker {wid} runs on {victim.get('host')!r}, not on this host ({here!r})")
            return
        if not _is_isoserve_process(pid):
            self._skip(f"pid {pid} of worker {wid} is not an isoserve process here")
            return
        up_before = sum(1 for w in workers if w.get("role") == role and w.get("state") == "up")
        at = self.now()
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError as e:
            self._skip(f"kill {pid} failed: {e}")
            return
        kill = Kill(round(at, 3), role, wid, pid)
        self.kills.append(kill)
        self.log(f"soak {at:5.0f}s: killed {role} worker {wid} (pid {pid})")
        watchers.append(asyncio.create_task(self._watch_recovery(client, kill, up_before)))

    async def _watch_recovery(self, client: httpx.AsyncClient, kill: Kill, up_before: int) -> None:
        """Back up: as many workers of its role up as before the kill, none of them the dead pid."""
        while True:
            await asyncio.sleep(STATUS_POLL_S)
            try:
                workers = (await self._status(client)).get("workers") or []
            except SoakError:
                continue
            up = [w for w in workers if w.get("role") == kill.role and w.get("state") == "up"
                  and w.get("pid") != kill.pid]
            if len(up) >= up_before:
                kill.back_up_after_s = round(self.now() - kill.at_s, 3)
                self.log(f"soak {self.now():5.0f}s: {kill.role} back up, "
                         f"{kill.back_up_after_s:.1f} s after the kill of {kill.worker_id}")
                return

    # ---- progress ----
    async def _progress(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.progress_every)
            c = self.counts.outcomes
            self.log(f"soak {self.now():5.0f}s: issued {self.counts.issued}, in flight {self.counts.in_flight}, "
                     f"ok {c['ok']}, error {c['error']}, aborted {c['aborted_by_client']}, "
                     f"lost {c['lost']}, hung {c['hung']}, kills {len(self.kills)}")

    # ---- the whole run ----
    async def run(self) -> SoakResult:
        cfg = self.cfg
        check_loopback(cfg.base_url)
        started_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        # No read timeout: the hang limit (per request, in _send) decides what "hung" is.
        timeout = httpx.Timeout(None, connect=10.0)
        async with httpx.AsyncClient(base_url=self.root, limits=limits, timeout=timeout) as client:
            model, max_model_len = await self._discover(client)
            if max_model_len:  # room for a chat template and calibration error
                self.length_cap = max(8, max_model_len - max(16, max_model_len // 16))
            headers = {"Authorization": f"Bearer {cfg.tenants[0].key}"}

            async def post(body: dict) -> tuple[int, str]:
                response = await client.post("/v1/completions", json=body, headers=headers)
                return response.status_code, response.text

            try:
                self.calibration = await calibrate(post, model, cfg.seed)
            except (RuntimeError, httpx.HTTPError, ValueError) as e:
                raise SoakError(f"calibration failed: {e}") from None
            if cfg.kill_worker_every:
                await self._status(client)  # the admin key works, before anything is issued
            load = (f"{cfg.request_rate:g} requests/s" if cfg.request_rate
                    else f"concurrency {cfg.concurrency}")
            self.log(f"soak: {model} at {self.root}, {len(cfg.tenants)} tenants, {load}, "
                     f"{cfg.duration:g} s" + (f" or {cfg.max_requests} requests" if cfg.max_requests else "")
                     + (f", a worker kill every {cfg.kill_worker_every:g} s" if cfg.kill_worker_every else ""))
            self.t0 = time.monotonic()
            self.issuing = True
            loop = asyncio.get_running_loop()
            # asyncio takes signal handlers only on Unix, in the main thread. Elsewhere (a soak
            # started from a test's worker thread, say) Ctrl-C keeps Python's default: the soak
            # stops without its report.
            handles_sigint = sys.platform != "win32" and threading.current_thread() is threading.main_thread()
            if handles_sigint:
                loop.add_signal_handler(signal.SIGINT, self._interrupt)
            watchers: list[asyncio.Task] = []
            helpers = [asyncio.create_task(self._progress())]
            if cfg.kill_worker_every:
                helpers.append(asyncio.create_task(self._kill_loop(client, watchers)))
            last_issue = 0.0
            try:
                load_task = asyncio.ensure_future(self._open_loop(client, model) if cfg.request_rate
                                                  else self._closed_loop(client, model))
                # Each request ends within hang_after of its start; this bound is only a backstop.
                done, _ = await asyncio.wait({load_task}, timeout=cfg.duration + cfg.hang_after + 30)
                if not done:
                    load_task.cancel()
                    await asyncio.gather(load_task, return_exceptions=True)
                else:
                    load_task.result()
            finally:
                if handles_sigint:
                    loop.remove_signal_handler(signal.SIGINT)
                self.issuing = False
                last_issue = max((r.start for r in self.records), default=0.0)
                for task in helpers:
                    task.cancel()
                await asyncio.gather(*helpers, return_exceptions=True)
            seconds = self.now()
            for rec in self.records:  # only if the backstop fired
                if not rec.outcome:
                    rec.finish("hung", detail="still outstanding when the soak gave up")
            if watchers:
                pending = [w for w in watchers if not w.done()]
                if pending:
                    self.log(f"soak: waiting up to {RECOVERY_WAIT_S:.0f} s for killed workers to come back")
                    await asyncio.wait(pending, timeout=RECOVERY_WAIT_S)
                for w in watchers:
                    w.cancel()
                await asyncio.gather(*watchers, return_exceptions=True)
            probe = await self._probe(client, model) if cfg.probe_after and not self.interrupted else None
        return SoakResult(cfg.describe() | {"interrupted": self.interrupted}, model, max_model_len, started_at, seconds, last_issue,
                          self.records, self.kills, self.kill_skips, probe)

    def _interrupt(self) -> None:
        """Ctrl-C: stop issuing, let the outstanding requests end, report. A second one quits."""
        self.interrupted = True
        self.log(f"soak {self.now():5.0f}s: interrupted; waiting for the outstanding requests "
                 f"(at most {self.cfg.hang_after:g} s; Ctrl-C again to quit without a report)")
        asyncio.get_running_loop().remove_signal_handler(signal.SIGINT)

    # ---- the leak probe ----
    async def _probe(self, client: httpx.AsyncClient, model: str) -> dict:
        from isoserve.probe.http import Endpoint, ProbeError
        from isoserve.probe.report import write_json as write_probe_json
        from isoserve.probe.runner import Options, Probe

        pools: list[int] = []
        if self.cfg.admin_key:
            try:
                workers = (await self._status(client)).get("workers") or []
                pools = sorted({int(w["pool_tokens"]) for w in workers if w.get("pool_tokens")})
            except (SoakError, KeyError, TypeError, ValueError):
                pass
        keys = [t.key for t in self.cfg.tenants]
        n_victims = max(1, len(keys) // 2)
        options = Options(pool_tokens=pools, seed=self.cfg.seed, timeout=min(self.cfg.hang_after, 120.0))
        self.log(f"soak: running the leak probe ({n_victims} victim and {len(keys) - n_victims} attacker "
                 f"keys, pools {pools or 'unknown'})")
        endpoint = Endpoint(self.root, model, timeout=options.timeout, top_logprobs=options.top_logprobs)
        try:
            result = await Probe(endpoint, keys, list(range(n_victims)), list(range(n_victims, len(keys))),
                                 options, log=self.log).run()
        except ProbeError as e:
            return {"error": str(e)}
        except Exception as e:  # the probe's own failure is a failed soak, not a crash of it
            return {"error": f"{type(e).__name__}: {e}"}
        finally:
            await endpoint.close()
        if self.cfg.probe_json:
            write_probe_json(self.cfg.probe_json, result, 1 if result.findings else 0)
        return {"findings": len(result.findings),
                "kinds": dict(Counter(f.kind for f in result.findings)),
                "requests": len(result.records),
                "first_findings": [f.to_json() for f in result.findings[:10]]}


def _is_isoserve_process(pid: int) -> bool:
    """Never signal ourselves, init, or a pid that is not an isoserve process (where /proc says)."""
    if pid <= 1 or pid == os.getpid():
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True  # nothing to check against; /status said it is a worker on this host
    try:
        cmdline = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return b"isoserve" in cmdline


def run_soak(args) -> int:
    import logging
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        cfg = config_from_args(args)
        check_loopback(cfg.base_url)
        result = event_loop.run(Soak(cfg).run())
    except SoakError as e:
        print(f"bench --soak: {e}", file=sys.stderr)
        return 2
    summary = summarize(result)
    print(render_table(result, summary), flush=True)
    if args.json:
        write_json(args.json, result, summary)
        print(f"wrote {args.json}")
    if result.config.get("interrupted"):
        return 130  # as a shell reports Ctrl-C: the soak did not run its course
    return exit_status(summary)
