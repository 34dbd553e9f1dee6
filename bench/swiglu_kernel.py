"""SwiGLU over SmolLM2's gate-up shape (2 x 1536 outputs, 576 inputs), 30 layers of random Q4_1
weights: the int8 kernel that computes SwiGLU from its accumulators (q4_1_swiglu_i8) against the
projection then silu_mul, alternating in one process; medians over the rounds.

    python bench/swiglu_kernel.py --rows 1,32,512,3200 --rounds 7
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from isoserve.heap import keep_freed_memory
from isoserve.kernels import cpu_ops
from isoserve.model import int4
from isoserve.model.int8_blocks import Int8Q4SwigluWeight, Int8Q4Weight


def layers(count: int, outputs: int = 1536, inputs: int = 576):
    ops, g = cpu_ops(), torch.Generator().manual_seed(0)
    built = []
    for _ in range(count):
        parts = [(int4._pack(torch.randint(0, 16, (outputs, inputs), generator=g).to(torch.uint8)),
                  (torch.rand(outputs, inputs // 32, generator=g) * 0.05).half(),
                  (torch.randn(outputs, inputs // 32, generator=g) * 0.1).half()) for _ in range(2)]
        built.append((Int8Q4SwigluWeight.from_companions(parts, ops), Int8Q4Weight.from_companions(parts, ops)))
    return built


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32,512,3200")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    keep_freed_memory()  # as a worker does: a 3,200-row output is not mapped anew each call
    torch.set_num_threads(args.threads)
    ops, weights = cpu_ops(), layers(30)
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 576)
        times = {"fused": [], "unfused": []}
        for _ in range(args.rounds):
            for way in times:
                start = time.perf_counter()
                for fused, plain in weights:
                    fused.swiglu(x) if way == "fused" else ops.silu_mul(plain.matmul(x))
                times[way].append(time.perf_counter() - start)
        fused, unfused = (statistics.median(times[w]) for w in ("fused", "unfused"))
        print(f"rows {rows:5d}: q4_1_swiglu_i8 {fused * 1e3:8.2f} ms, q4_1_linear_i8 + silu_mul "
              f"{unfused * 1e3:8.2f} ms, ratio {fused / unfused:.3f}")


if __name__ == "__main__":
    main()
