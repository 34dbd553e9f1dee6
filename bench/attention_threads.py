"""The fused decode attention kernel alone, at batch 32 over SmolLM2's heads (9 query, 3 KV, 64
dims), 30 layers a step, with 1 and with 2 threads: with a pool that fits in L3 (the step's own
pages, shuffled), and with the default worker's pool (736 pages a layer), whose KV comes from
memory, its pages scattered over the pool (a server after hours of traffic) or in order (a
fresh engine), and with the page tables kv/allocator.py hands a decode worker's batch after
`--churn-requests` requests have come and gone (the pages a long-running server reads). The
gap to the L3 case is what fewer KV bytes could save. `--kv-dtype both`
times a float32 pool and a bfloat16 one (float32 queries: `--kv-dtype bfloat16` under
`--dtype float32`), alternating, on the same page tables.

    python bench/attention_threads.py --keys 135 --rounds 3 --kv-dtype both
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from isoserve.kernels import cpu_ops
from isoserve.kv.allocator import PageAllocator
from isoserve.kv.pool import KVPool
from isoserve.model.config import ModelConfig

HEADS, KV_HEADS, DIM, PAGE, LAYERS = 9, 3, 64, 16, 30


def churned_tables(pool_pages: int, batch: int, per_seq: int, requests: int, seed: int = 0) -> torch.Tensor:
    """[batch, per_seq] page tables as the allocator hands them to a decode worker after
    `requests` requests of ~100-token prompts and 128 new tokens, `batch` at a time: each
    prompt's pages reserved at once, then one page per 16 tokens as it grows, as the engine
    asks for them (engine.py's reservation, scheduler.py's _grow)."""
    g = torch.Generator().manual_seed(seed)
    shape = ModelConfig(architecture="llama", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=1, num_kv_heads=1, head_dim=2, rms_norm_eps=1e-5, rope_theta=1e4,
                        max_position_embeddings=8, tie_word_embeddings=True)
    alloc = PageAllocator(KVPool(shape, pool_pages, PAGE, torch.float32, "meta"))

    def admit(prompt: int, left: int) -> dict:
        return {"tokens": prompt, "left": left, "pages": alloc.allocate(-(-prompt // PAGE))[0]}

    def step(seqs: list[dict]) -> None:
        for s in seqs:
            s["tokens"] += 1
            s["left"] -= 1
            if -(-s["tokens"] // PAGE) > len(s["pages"]):
                s["pages"] += alloc.allocate(1, after=s["pages"][-1])[0]

    # Requests at staggered stages of their lives, as a closed loop of `batch` settles into.
    seqs = [admit(90 + int(torch.randint(21, (1,), generator=g)), 1 + i * 128 // batch) for i in range(batch)]
    done = 0
    while done < requests:
        step(seqs)
        for i, s in enumerate(seqs):
            if s["left"] <= 0:
                alloc.free(s["pages"])
                seqs[i] = admit(90 + int(torch.randint(21, (1,), generator=g)), 128)
                done += 1
    # The measured batch: `batch` new prompts, grown together to per_seq pages.
    for s in seqs:
        alloc.free(s["pages"])
    fresh = [admit(100, 10 ** 9) for _ in range(batch)]
    while min(len(s["pages"]) for s in fresh) < per_seq:
        step(fresh)
    return torch.tensor([s["pages"][:per_seq] for s in fresh], dtype=torch.int64)


def step_time(ops, layers, q, pages, lens, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for k, v in layers:
            ops.decode_attention(q, k, v, pages, lens, DIM ** -0.5)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--keys", type=int, default=135)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--pool-pages", type=int, default=736, help="a layer's pages in the memory-resident case")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-dtype", choices=["float32", "bfloat16", "both"], default="float32")
    p.add_argument("--churn-requests", type=int, default=1000,
                   help="requests through the allocator before its tables are measured (default 1000)")
    args = p.parse_args()
    kv_dtypes = ["float32", "bfloat16"] if args.kv_dtype == "both" else [args.kv_dtype]
    ops, g = cpu_ops(), torch.Generator().manual_seed(0)
    per_seq = -(-args.keys // PAGE)
    q = torch.randn(args.batch, HEADS, DIM, generator=g)
    lens = torch.full((args.batch,), args.keys, dtype=torch.int64)
    kv_elements = LAYERS * args.batch * args.keys * KV_HEADS * DIM * 2
    cases = {}
    shape = (KV_HEADS, args.pool_pages, PAGE, DIM)
    # One layer's cache reused 30 times stays in L3; 30 of the worker's size do not.
    small = (KV_HEADS, args.batch * per_seq, PAGE, DIM)
    in_l3 = [(torch.randn(*small, generator=g), torch.randn(*small, generator=g))] * LAYERS
    worker = [(torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)) for _ in range(LAYERS)]
    scattered = torch.randperm(args.pool_pages, generator=g)[:args.batch * per_seq]
    # A fresh engine's allocator hands pages out in order (kv/allocator.py), one sequence's after another's.
    cases["pool in L3"] = (in_l3, torch.randperm(args.batch * per_seq, generator=g).view(args.batch, per_seq))
    cases["worker's pool, pages scattered"] = (worker, scattered.view(args.batch, per_seq).contiguous())
    cases["worker's pool, pages in order"] = (worker, torch.arange(args.batch * per_seq).view(args.batch, per_seq))
    churned = churned_tables(args.pool_pages, args.batch, per_seq, args.churn_requests)
    adjacent = (churned[:, 1:] == churned[:, :-1] + 1).float().mean().item()
    print(f"after {args.churn_requests} requests, {adjacent:.0%} of each sequence's next pages follow its last")
    cases["worker's pool, the allocator's"] = (worker, churned)
    narrow = {id(kv): kv.to(torch.bfloat16) for layers, _ in cases.values() for pair in layers for kv in pair}
    as_dtype = {"float32": lambda layers: layers,
                "bfloat16": lambda layers: [(narrow[id(k)], narrow[id(v)]) for k, v in layers]}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (layers, pages) in cases.items():
            for kv_dtype in kv_dtypes:
                pool = as_dtype[kv_dtype](layers)
                step_time(ops, pool, q, pages, lens, 1)  # warm
                t = step_time(ops, pool, q, pages, lens, args.rounds)
                kv_bytes = kv_elements * pool[0][0].element_size()
                print(f"threads {threads}, {name:30s} {kv_dtype:8s}: {t * 1e3:6.2f} ms for 30 layers, "
                      f"{kv_bytes / t / 1e9:5.1f} GB/s of KV")


if __name__ == "__main__":
    main()
