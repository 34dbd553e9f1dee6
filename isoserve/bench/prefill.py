"""Prefill mode: how fast each engine processes one long prompt (default 2,000 tokens).

    isoserve      LLM.generate of the prompt with max_tokens=1 (its chunked prefill, as it serves,
                  plus sampling one token)
    transformers  one forward of the prompt, inference mode, logits of the last position only
    llama.cpp     (--llama-url) llama-server's POST /completion with the same token ids,
                  n_predict=1, cache_prompt off; its own timings.prompt_ms

Each peer is warmed up once, then timed --repeats times, each time on a different seeded prompt
of exactly --prompt-tokens token ids (so no prefix cache can help), the peers taking turns on
each prompt; the median counts.
"""
from __future__ import annotations

import os
import statistics
import time

from isoserve.bench.machine import dtypes, layers_note, run_header

DEFAULT_PROMPT_TOKENS = 2000


def _time_isoserve(llm, prompt: list[int]) -> float:
    from isoserve import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    result = llm.generate([prompt], params)[0]
    seconds = time.perf_counter() - t0
    if result.error is not None:
        raise RuntimeError(f"isoserve failed the prompt: {result.error}")
    return seconds


def _time_transformers(model, prompt: list[int]) -> float:
    import torch
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        try:
            model(input_ids=ids, logits_to_keep=1, use_cache=False)
        except TypeError:  # an older transformers: all positions' logits
            model(input_ids=ids, use_cache=False)
        return time.perf_counter() - t0


def _time_llama_cpp(url: str, prompt: list[int]) -> dict:
    import httpx
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": False, "temperature": 0}
    t0 = time.perf_counter()
    response = httpx.post(url.rstrip("/") + "/completion", json=body, timeout=600)
    wall = time.perf_counter() - t0
    response.raise_for_status()
    timings = response.json().get("timings") or {}
    if timings.get("prompt_n") not in (None, len(prompt)):
        print(f"llama.cpp processed {timings['prompt_n']} prompt tokens of {len(prompt)}")
    seconds = timings["prompt_ms"] / 1000 if timings.get("prompt_ms") else wall
    return {"seconds": seconds, "wall_seconds": wall, "prompt_n": timings.get("prompt_n")}


def run_prefill(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm.auto import tqdm

    from isoserve import LLM
    from isoserve.bench.offline import prompt_ids
    from isoserve.bench.peers import load_reference_model
    from isoserve.config import parse_dtype

    model = args.model or "smollm2-135m-instruct"
    n = args.prompt_tokens
    llm = LLM(model=model, dtype=args.dtype, kv_dtype=args.kv_dtype, fused_kernels=args.fused_kernels,
              int8_activations=args.int8_activations)
    prompts = prompt_ids(llm.tokenizer, args.repeats + 1, n, args.seed)  # [0] warms up
    peers = {"isoserve": lambda p: _time_isoserve(llm, p)}
    if "transformers" in args.peers:
        print(f"loading transformers' model for {model} ({args.peer_dtype}) ...", flush=True)
        reference = load_reference_model(model, parse_dtype(args.peer_dtype))
        peers["transformers"] = lambda p: _time_transformers(reference, p)
    llama_wall = []
    if args.llama_url:
        def llama(p):
            timed = _time_llama_cpp(args.llama_url, p)
            llama_wall.append(timed["wall_seconds"])
            return timed["seconds"]
        peers["llama.cpp"] = llama

    # Round robin, the first engine rotating: this VM's speed drifts over minutes, and timing
    # one engine's prompts after the other's would put the drift into the ratio.
    bar = tqdm(total=len(peers) * (args.repeats + 1), desc="prefill", unit="prompt")
    for name, timed in peers.items():
        bar.set_postfix_str(f"{name} warm-up")
        timed(prompts[0])
        bar.update()
    llama_wall.clear()
    seconds = {name: [] for name in peers}
    names = list(peers)
    for i, prompt in enumerate(prompts[1:]):
        for name in names[i % len(names):] + names[:i % len(names)]:
            bar.set_postfix_str(name)
            seconds[name].append(peers[name](prompt))
            bar.update()
    results = {}
    for name in names:
        median = statistics.median(seconds[name])
        results[name] = {"seconds": seconds[name], "median_seconds": median, "tokens_per_s": n / median}
        if name == "llama.cpp":
            results[name]["wall_seconds"] = list(llama_wall)
        bar.write(f"{name:>12}: {n / median:8.1f} prompt tok/s ({median * 1e3:.1f} ms median of "
                  f"{len(seconds[name])})")
    bar.close()
    base = results["isoserve"]["tokens_per_s"]
    return {
        **run_header(args, model), "prompt_tokens": n, "repeats": args.repeats,
        "llama_url": args.llama_url,
        "peers": list(results),
        "results": results,
        "ratios": {f"isoserve/{name}": base / r["tokens_per_s"] for name, r in results.items()
                   if name != "isoserve"},
    }


def table(run: dict) -> str:
    lines = [f"== prefill: {run['model']} {dtypes(run)}, one {run['prompt_tokens']}-token prompt, "
             f"{run['torch_threads']} threads{layers_note(run)}, median of {run['repeats']} ==",
             f"{'engine':>12} {'prompt tok/s':>13} {'ms':>9} {'isoserve / it':>14}"]
    for name, r in run["results"].items():
        ratio = "" if name == "isoserve" else f"{run['ratios']['isoserve/' + name]:.2f}x"
        lines.append(f"{name:>12} {r['tokens_per_s']:>13.1f} {r['median_seconds'] * 1e3:>9.1f} {ratio:>14}")
    return "\n".join(lines)
