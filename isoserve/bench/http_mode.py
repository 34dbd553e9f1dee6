"""HTTP mode: load an OpenAI-compatible /v1/completions endpoint and report each setting.

    ask /v1/models (model name, max_model_len) -> calibrate prompt words -> warm up ->
    for each concurrency or request rate: run the same seeded requests -> summarize
    -> table, JSON, plot
"""
from __future__ import annotations

import json
import random
import time
from datetime import datetime, timezone

import aiohttp
from tqdm.auto import tqdm

from isoserve import event_loop
from isoserve.bench import load, report
from isoserve.bench.calibrate import calibrate
from isoserve.bench.client import RequestRecord, completion_body, stream_completion
from isoserve.bench.stats import summarize
from isoserve.bench.workload import build_requests, lengths

DEFAULT_OPEN_LOOP_REQUESTS = 64


def api_root(base_url: str) -> str:
    """Accept both http://host:port and OpenAI-style http://host:port/v1."""
    root = base_url.rstrip("/")
    return root[:-3] if root.endswith("/v1") else root


def settings_from(args) -> list[dict]:
    if args.request_rate:
        return [{"mode": "open", "request_rate": r, "concurrency": None} for r in args.request_rate]
    return [{"mode": "closed", "request_rate": None, "concurrency": c} for c in args.concurrency]


def requests_for(setting: dict, num_requests: int | None) -> int:
    if num_requests:
        return num_requests
    if setting["mode"] == "open":
        return DEFAULT_OPEN_LOOP_REQUESTS
    return max(16, 4 * setting["concurrency"])


def run_http(args) -> dict:
    return event_loop.run(_run(args))


async def _run(args) -> dict:
    root = api_root(args.base_url)
    headers = {"Authorization": f"Bearer {args.key}"} if args.key else {}
    settings = settings_from(args)
    # --request-timeout bounds each request, 30 s of it to connect; no bound on connections, so a
    # setting's concurrency is what reaches the server. A connection per request (force_close):
    # aiohttp sends a request on a kept-alive connection the server may have closed meanwhile,
    # and fails it instead of retrying (llama-server's keep-alive limits failed 59 of 144 that
    # way); a loopback connect costs far less than a failed request skews the result.
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=30.0)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as client:
        model, max_model_len = await _model_card(client, root, headers, args.model)
        completions = root + "/v1/completions"

        async def post(body: dict) -> tuple[int, str]:
            async with client.post(completions, json=body, headers=headers) as response:
                return response.status, await response.text()

        cal = await calibrate(post, model, args.seed)
        most = max(requests_for(s, args.num_requests) for s in settings)
        pairs = lengths(args.dataset, most, random.Random(args.seed), args.prompt_tokens, args.output_tokens,
                        max_model_len)
        specs = build_requests(pairs, cal.words_for, args.seed)

        async def send(spec) -> RequestRecord:
            body = completion_body(model, spec.prompt, spec.output_tokens, ignore_eos=args.ignore_eos,
                                   temperature=args.temperature, top_p=args.top_p,
                                   seed=args.seed if args.temperature > 0 else None)
            return await stream_completion(client, completions, headers, body, spec.index)

        if args.warmup:
            warm = build_requests(pairs[:args.warmup], cal.words_for, args.seed + 1)
            for r in await load.closed_loop(warm, len(warm), send, lambda: None):
                if not r.ok:
                    print(f"warm-up request failed: {r.outcome}")

        summaries, per_request = [], []
        for setting in settings:
            batch = specs[:requests_for(setting, args.num_requests)]
            records, started, seconds = await _run_setting(setting, batch, send, args.seed)
            summaries.append(summarize(setting, records, seconds))
            per_request.append([_compact(r, started) for r in sorted(records, key=lambda r: r.index)])
    return {
        "label": args.label or "",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "model": model,
        "max_model_len": max_model_len,
        "workload": {"dataset": args.dataset, "prompt_tokens": args.prompt_tokens,
                     "output_tokens": args.output_tokens, "ignore_eos": args.ignore_eos,
                     "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed,
                     "warmup": args.warmup},
        "calibration": {"offset_tokens": cal.offset, "tokens_per_word": cal.per_word,
                        "measured": cal.measured},
        "summaries": summaries,
        "requests": per_request,
    }


async def _run_setting(setting: dict, specs, send, seed: int) -> tuple[list[RequestRecord], float, float]:
    name = report.setting_name(setting)
    with tqdm(total=len(specs), desc=name, unit="req") as bar:
        started = time.perf_counter()
        if setting["mode"] == "open":
            records = await load.open_loop(specs, setting["request_rate"], send, bar.update, seed)
        else:
            records = await load.closed_loop(specs, setting["concurrency"], send, bar.update)
        seconds = time.perf_counter() - started
    return records, started, seconds


async def _model_card(client: aiohttp.ClientSession, root: str, headers: dict,
                      wanted: str | None) -> tuple[str, int | None]:
    """The model to ask for (the first served one unless named) and its max_model_len, if told."""
    try:
        async with client.get(root + "/v1/models", headers=headers) as response:
            status, text = response.status, await response.text()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise SystemExit(f"bench: cannot reach {root}: {type(e).__name__}: {e}") from None
    try:
        cards = json.loads(text).get("data", []) if status == 200 else []
    except ValueError:
        cards = []
    if wanted is None:
        if not cards:
            raise SystemExit(f"bench: GET /v1/models answered HTTP {status} with no "
                             f"model ({text[:200]!r}); check --key, or pass --model")
        wanted = cards[0]["id"]
    card = next((c for c in cards if c.get("id") == wanted), {})
    return wanted, card.get("max_model_len")


def _compact(r: RequestRecord, setting_started: float) -> dict:
    """One request's record; sent_ms places it on the setting's timeline (how full the server
    was kept, request by request)."""
    return {"index": r.index, "outcome": r.outcome,
            "sent_ms": round((r.start - setting_started) * 1000, 3),
            "ttft_ms": None if r.ttft is None else round(r.ttft * 1000, 3),
            "e2e_ms": round((r.end - r.start) * 1000, 3),
            "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens}
