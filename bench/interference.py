"""How another process's short bursts of CPU slow a kernel that runs on every core: SmolLM2's
gate-up (30 layers of the AMX SwiGLU kernel, or the int8 one in float32) timed alone and beside
a process that sleeps `period` us and then spins `burst` us, round after round.

Why: through HTTP the router and the bench client run on the same 2 cores as the decode
worker's two kernel threads. A step's parallel loops end at a barrier, so a thread preempted
for a burst holds up both; and each wake-up costs more than the burst itself. This measures
that cost apart from the server: the slowdown of the kernel against the share of a core the
bursts took (docs/benchmarks.md, "On the AMX Xeon, session 28").

    python bench/interference.py --bursts 1000:130,4000:520,1000:10,250:30 --rounds 3
"""
from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time

import torch

from swiglu_kernel import KERNELS, layers


def spin_in_bursts(period_us: float, burst_us: float, started) -> None:
    """Forever: sleep `period_us`, then keep the CPU busy for `burst_us` (as the router does after
    each decode step's outputs arrive)."""
    started.set()
    clock = time.perf_counter
    while True:
        time.sleep(period_us / 1e6)
        start = clock()
        while clock() - start < burst_us / 1e6:
            pass


def cpu_seconds(pid: int) -> float:
    """CPU time of a live process so far, from the scheduler's own count (nanoseconds; /proc's
    stat counts in ticks of 10 ms, coarser than a measurement)."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def time_kernel(weights, x, repeats: int) -> float:
    """Median ms of one pass over the 30 layers."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for fused, _plain in weights:
            fused.swiglu(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bursts", default="1000:130,4000:520,1000:10,250:30",
                   help="comma-separated period_us:burst_us settings of the interfering process")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--repeats", type=int, default=30, help="passes over the 30 layers per measurement")
    p.add_argument("--kernel", choices=sorted(KERNELS), default="amx")
    args = p.parse_args()
    torch.set_num_threads(2)
    weights = layers(30, args.kernel)
    x = torch.randn(args.rows, 576).to(KERNELS[args.kernel][2])
    time_kernel(weights, x, 5)  # warm-up
    spawn = multiprocessing.get_context("spawn")
    print(f"{args.kernel} SwiGLU gate-up, {args.rows} rows, 30 layers, 2 threads; medians of {args.rounds} rounds")
    for setting in args.bursts.split(","):
        period, burst = (float(v) for v in setting.split(":"))
        alone, beside, shares = [], [], []
        for _ in range(args.rounds):
            alone.append(time_kernel(weights, x, args.repeats))
            started = spawn.Event()
            child = spawn.Process(target=spin_in_bursts, args=(period, burst, started), daemon=True)
            child.start()
            started.wait()  # its imports done: from here on it only sleeps and spins
            cpu0, wall0 = cpu_seconds(child.pid), time.perf_counter()
            beside.append(time_kernel(weights, x, args.repeats))
            shares.append((cpu_seconds(child.pid) - cpu0) / (time.perf_counter() - wall0))
            child.terminate()
            child.join()
        a, b, share = statistics.median(alone), statistics.median(beside), statistics.median(shares)
        print(f"  every {period:6.0f} us a {burst:4.0f} us burst: {share * 100:5.1f}% of a core; "
              f"{a:.2f} -> {b:.2f} ms ({(b / a - 1) * 100:+.1f}%, {(b / a - 1) / share if share else 0:.1f}x the share)")


if __name__ == "__main__":
    main()
