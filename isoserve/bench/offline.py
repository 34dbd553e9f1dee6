"""Offline mode: LLM.generate against transformers (in --peer-dtype), in one process, on the same prompts.

    load isoserve's LLM and transformers' model (same weights) -> seeded prompts as token ids
    -> warm each peer up once -> for each batch size, time each peer -> tokens/s and ratios
"""
from __future__ import annotations

import os
import random
import time

from isoserve.bench.machine import dtypes, layers_note, run_header, where
from isoserve.bench.workload import random_words

WARMUP_PROMPTS, WARMUP_TOKENS = 2, 4
OPTIONAL_PEERS = ("transformers", "generate_batch")


def prompt_ids(tokenizer, count: int, length: int, seed: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` token ids, from seeded random words."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            ids = tokenizer.encode(" ".join(random_words(rng, length + 8)))
        prompts.append(ids[:length])
    return prompts


def build_peers(names: list[str], model: str, dtype: str, llm):
    """isoserve's LLM, then the peers named, in `dtype` (the peers' own: --peer-dtype)."""
    from isoserve.bench import peers
    from isoserve.config import parse_dtype

    chosen = [peers.IsoservePeer(llm)]
    unknown = set(names) - set(OPTIONAL_PEERS)
    if unknown:
        raise SystemExit(f"bench: unknown peer(s) {sorted(unknown)}; choose from {', '.join(OPTIONAL_PEERS)}")
    if not names:
        return chosen
    print(f"loading transformers' model for {model} ({dtype}) ...", flush=True)
    reference = peers.load_reference_model(model, parse_dtype(dtype)).to(llm.engine.model.device)
    tok = llm.tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if "transformers" in names:
        chosen.append(peers.TransformersPeer(reference, pad))
    if "generate_batch" in names:
        if hasattr(reference, "generate_batch"):
            chosen.append(peers.GenerateBatchPeer(reference, pad))
        else:
            import transformers
            print(f"skipping generate_batch: transformers {transformers.__version__} does not have it")
    return chosen


def run_offline(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it
    from tqdm.auto import tqdm

    from isoserve import LLM
    from isoserve.config import EngineConfig

    model = args.model or "smollm2-135m-instruct"
    # Like transformers' static batch, the largest batch runs whole: a pool that holds every
    # sequence to its last token and a sequence limit no smaller than the batch. With the
    # defaults (64 sequences, a pool of twice the context) a short-context model would preempt
    # and recompute, and the benchmark would time that instead of the engine.
    largest, page = max(args.batch), EngineConfig.page_size
    per_sequence = -(-(args.prompt_tokens + args.output_tokens) // page) * page
    llm = LLM(model=model, dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device,
              fused_kernels=args.fused_kernels,
              int8_activations=args.int8_activations,
              kv_tokens=largest * per_sequence, max_num_seqs=max(EngineConfig.max_num_seqs, largest))
    chosen = build_peers(args.peers, model, args.peer_dtype, llm)
    prompts = prompt_ids(llm.tokenizer, max(args.batch), args.prompt_tokens, args.seed)
    for peer in chosen:
        print(f"warming up {peer.name} ...", flush=True)
        peer.generate(prompts[:WARMUP_PROMPTS], WARMUP_TOKENS)
    rows = []
    bar = tqdm(total=len(args.batch) * len(chosen), desc="offline", unit="run")
    for batch in args.batch:
        row = {"batch": batch}
        for peer in chosen:
            bar.set_postfix_str(f"{peer.name} batch {batch}")
            started = time.perf_counter()
            tokens = peer.generate(prompts[:batch], args.output_tokens)
            seconds = time.perf_counter() - started
            row[peer.name] = {"output_tokens": tokens, "seconds": seconds,
                              "output_tokens_per_s": tokens / seconds}
            bar.write(f"batch {batch:>3} {peer.name:>15}: {tokens / seconds:8.1f} output tok/s "
                      f"({tokens} tokens in {seconds:.2f} s)")
            bar.update()
        row["ratios"] = {f"isoserve/{p.name}": row["isoserve"]["output_tokens_per_s"]
                         / row[p.name]["output_tokens_per_s"] for p in chosen[1:]}
        rows.append(row)
    bar.close()
    return {**run_header(args, model), "peers": [p.name for p in chosen], "results": rows}


def table(run: dict) -> str:
    others = run["peers"][1:]
    header = f"{'batch':>5} {'isoserve tok/s':>15}" + "".join(
        f" {p + ' tok/s':>20} {'ratio':>6}" for p in others)
    lines = [f"== offline: {run['model']} {dtypes(run)}, {run['prompt_tokens']}-token prompts, "
             f"{run['output_tokens']} new tokens, {where(run)}{layers_note(run)} ==", header]
    for row in run["results"]:
        line = f"{row['batch']:>5} {row['isoserve']['output_tokens_per_s']:>15.1f}"
        for p in others:
            line += (f" {row[p]['output_tokens_per_s']:>20.1f}"
                     f" {row['ratios']['isoserve/' + p]:>5.2f}x")
        lines.append(line)
    return "\n".join(lines)
