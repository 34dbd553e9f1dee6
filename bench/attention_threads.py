"""The fused decode attention kernel alone, at batch 32 over SmolLM2's heads (9 query, 3 KV, 64
dims), 30 layers a step, with 1 and with 2 threads: with a pool that fits in L3 (the step's own
pages, shuffled), and with the default worker's pool (736 pages a layer), whose KV comes from
memory, its pages scattered over the pool (a server after hours of traffic) or in order (a
fresh engine). The gap to the L3 case is what fewer KV bytes could save. `--kv-dtype both`
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

HEADS, KV_HEADS, DIM, PAGE, LAYERS = 9, 3, 64, 16, 30


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
