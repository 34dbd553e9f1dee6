"""SwiGLU over SmolLM2's gate-up shape (2 x 1536 outputs, 576 inputs), 30 layers of random Q4_1
weights: a kernel that computes SwiGLU from its accumulators against the projection then
silu_mul, alternating in one process; medians over the rounds. `--kernel int8` (float32 x int8
activations: q4_1_swiglu_i8) or `--kernel amx` (bfloat16 on the tile unit: q4_1_swiglu, which
takes steps of up to 32 rows).

    python bench/swiglu_kernel.py --rows 1,32,512,3200 --rounds 7
    python bench/swiglu_kernel.py --kernel amx --rows 8,32 --rounds 8
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from isoserve.heap import keep_freed_memory
from isoserve.kernels import cpu_ops
from isoserve.model import amx, int4
from isoserve.model.int8_blocks import Int8Q4SwigluWeight, Int8Q4Weight


KERNELS = {  # name: (fused weight, plain weight, input dtype)
    "int8": (Int8Q4SwigluWeight, Int8Q4Weight, torch.float32),
    "amx": (amx.AmxQ4SwigluWeight, amx.AmxQ4Weight, torch.bfloat16),
}


def layers(count: int, kernel: str = "int8", outputs: int = 1536, inputs: int = 576):
    fused_kind, plain_kind, _ = KERNELS[kernel]
    ops, g = cpu_ops(), torch.Generator().manual_seed(0)
    built = []
    for _ in range(count):
        parts = [(int4._pack(torch.randint(0, 16, (outputs, inputs), generator=g).to(torch.uint8)),
                  (torch.rand(outputs, inputs // 32, generator=g) * 0.05).half(),
                  (torch.randn(outputs, inputs // 32, generator=g) * 0.1).half()) for _ in range(2)]
        built.append((fused_kind.from_companions(parts, ops), plain_kind.from_companions(parts, ops)))
    return built


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,32,512,3200")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kernel", choices=sorted(KERNELS), default="int8")
    args = p.parse_args()
    keep_freed_memory()  # as a worker does: a 3,200-row output is not mapped anew each call
    torch.set_num_threads(args.threads)
    ops, weights = cpu_ops(), layers(30, args.kernel)
    fused_name, plain_name = {"int8": ("q4_1_swiglu_i8", "q4_1_linear_i8"), "amx": ("q4_1_swiglu", "q4_1_linear")}[args.kernel]
    for rows in (int(r) for r in args.rows.split(",")):
        x = torch.randn(rows, 576).to(KERNELS[args.kernel][2])
        times = {"fused": [], "unfused": []}
        for _ in range(args.rounds):
            for way in times:
                start = time.perf_counter()
                for fused, plain in weights:
                    fused.swiglu(x) if way == "fused" else ops.silu_mul(plain.matmul(x))
                times[way].append(time.perf_counter() - start)
        fused, unfused = (statistics.median(times[w]) for w in ("fused", "unfused"))
        print(f"rows {rows:5d}: {fused_name} {fused * 1e3:8.2f} ms, {plain_name} + silu_mul "
              f"{unfused * 1e3:8.2f} ms, ratio {fused / unfused:.3f}")


if __name__ == "__main__":
    main()
