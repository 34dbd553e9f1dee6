"""Roofline: this machine's matmul FLOP/s (in the model's dtype) and memory bandwidth, the ideal
decode step they imply for a model at each batch size, and isoserve's measured step against it.

    measure peak FLOP/s (torch.matmul on the model's decode shapes and one large square)
    measure int8 ops/s (torch._int_mm on the same shapes: int8 arithmetic with no scales)
    measure memory bandwidth (sum over, and copy of, a large tensor), before and after the
        steps below: the better of the two sets the floors
    for each batch size:
        bytes a decode step must read:  every weight matrix once (embedding rows are gathered,
                                        unless the embedding is also the LM head) + the KV cache
        FLOPs of a decode step:         2 x matmul parameters x batch + attention (QK and PV)
        memory floor = bytes / bandwidth; compute floor = FLOPs / FLOP/s; ideal = the larger
        measured: the engine decodes `batch` prompts of --prompt-tokens with --output-tokens new
                  tokens each (ignore_eos, greedy, guards on); each step timed; the median over
                  the steps in which every sequence decodes one token (no prefill in them)

KV and attention are counted at the mean context of those steps (prompt + about half the
output). The FLOP/s and that floor are the CPU's native dtype's, whatever isoserve runs in
(bfloat16 where the CPU computes in it natively, as on the machine the issue that set the target
was written for; float32 elsewhere): on AVX512-VNNI without AMX isoserve's `--dtype auto` runs
float32 with int8 activations, and a floor of float32 weights would be twice as lenient. A
second floor counts the weights the step actually reads, which are the GGUF's 4- or 8-bit
blocks where a quantized tier takes the batch (model/quantized.py). A third, the int8 compute
floor, puts the matmuls at torch._int_mm's best rate and attention at the float one: how fast a
step's arithmetic could go in int8 on this CPU, before the GGUF formats' per-block scales (where
the step runs int8 tiles, that floor is the one its matmuls answer to once the batch makes them
compute-bound). It is left out (n/a) on a CPU with no byte dot product for torch to use
(int8_matmul_unavailable): there torch._int_mm is a plain loop, 1/40 of float32's matmul on a Zen 3,
the floor of nothing. The measured step is everything engine.step() does: scheduling, the guard, the
forward, sampling and detokenization.
"""
from __future__ import annotations

import os
import statistics
import time

import torch

from isoserve.bench.machine import layers_note, run_header
from isoserve.kernels import cpu_features
from isoserve.model.quantized import COMPANION_SUFFIXES

SQUARE = 2048          # the large square matmul (n x n @ n x n)
MATMUL_SECONDS = 0.2   # each shape is timed for at least this long
BANDWIDTH_REPEATS = 5
# The CPU instructions torch's int8 matmul multiplies bytes with (oneDNN's VNNI and AMX kernels).
INT8_DOT_FLAGS = ("avx512_vnni", "amx_int8")


# ---- the machine -------------------------------------------------------------------------------

def _best_seconds(fn, min_seconds: float, min_repeats: int = 3) -> float:
    fn()  # warm-up: first call allocates and picks kernels
    best, spent, repeats = float("inf"), 0.0, 0
    while repeats < min_repeats or spent < min_seconds:
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        best, spent, repeats = min(best, dt), spent + dt, repeats + 1
    return best


def measure_flops(shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.bfloat16,
                  seconds: float = MATMUL_SECONDS) -> list[dict]:
    """Best FLOP/s of torch.matmul for each (m, k, n): [m, k] @ [k, n]."""
    results = []
    with torch.inference_mode():
        for m, k, n in shapes:
            a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
            out = torch.empty(m, n, dtype=dtype)
            best = _best_seconds(lambda: torch.matmul(a, b, out=out), seconds)
            results.append({"shape": [m, k, n], "seconds": best, "flops": 2 * m * k * n / best})
    return results


def int8_matmul_unavailable(flags: str | None = None) -> str:
    """'' where torch._int_mm runs on int8 dot-product instructions here, else why the roofline
    leaves the int8 floor out. flags: the CPU's instruction flags (isoserve.kernels.cpu_features).
    Without them torch multiplies int8 in a plain loop: 0.005 TOP/s on a Zen 3 (AVX2), where its
    float32 matmul reached 0.18 TFLOP/s, which made isoserve's batch-32 step "0.02x" an int8
    floor that nothing could reach (docs/benchmarks.md, session 39)."""
    have = set((cpu_features() if flags is None else flags).split())
    if have & set(INT8_DOT_FLAGS):
        return ""
    return ("torch's int8 matmul has no fast path on this CPU (neither AVX512-VNNI nor AMX: "
            "torch._int_mm runs a plain loop)")


def measure_int8_ops(shapes: list[tuple[int, int, int]], seconds: float = MATMUL_SECONDS) -> list[dict]:
    """Best int8 x int8 -> int32 multiply-adds/s (as 2 ops each) of torch._int_mm for each
    (m, k, n), with no scales at all: torch's own int8 matmul (oneDNN's VNNI or AMX kernels
    where they take the shape). A measured reference for a step's matmuls in int8 arithmetic,
    which the GGUF formats' per-block scales (float work every 32 products) add to, not a bound
    of the hardware. (torch >= 2.4, as pyproject.toml asks, has it on the CPU; where the CPU has
    neither AVX512-VNNI nor AMX, torch runs it as a plain loop, pytorch#136942, and the roofline
    does not call this: int8_matmul_unavailable.)"""
    results = []
    with torch.inference_mode():
        for m, k, n in shapes:
            a = torch.randint(-128, 128, (m, k), dtype=torch.int8)
            b = torch.randint(-128, 128, (k, n), dtype=torch.int8)
            out = torch.empty(m, n, dtype=torch.int32)  # as measure_flops: no allocation timed
            best = _best_seconds(lambda: torch._int_mm(a, b, out=out), seconds)
            results.append({"shape": [m, k, n], "seconds": best, "ops": 2 * m * k * n / best})
    return results


def measure_bandwidth(nbytes: int, repeats: int = BANDWIDTH_REPEATS) -> dict:
    """Memory bandwidth in bytes/s: the best of reading a float32 tensor of `nbytes` (.sum()) and
    copying it into another (read + write counted)."""
    with torch.inference_mode():
        src = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
        dst = torch.empty_like(src)
        read = _best_seconds(lambda: src.sum(), 0.0, repeats)
        copy = _best_seconds(lambda: dst.copy_(src), 0.0, repeats)
    size = src.numel() * 4
    return {"bytes": size, "read_bytes_per_s": size / read, "copy_bytes_per_s": 2 * size / copy,
            "bytes_per_s": max(size / read, 2 * size / copy)}


def best_bandwidth(*runs: dict) -> dict:
    """The best of several measure_bandwidth runs (each figure its own best), with the runs."""
    best = {key: max(run[key] for run in runs) for key in ("read_bytes_per_s", "copy_bytes_per_s", "bytes_per_s")}
    return {"bytes": runs[0]["bytes"], **best, "runs": list(runs)}


def _write_bandwidth(bar, when: str, bw: dict) -> None:
    bar.write(f"memory, {when}: {bw['bytes_per_s'] / 1e9:.1f} GB/s (read {bw['read_bytes_per_s'] / 1e9:.1f}, "
              f"copy {bw['copy_bytes_per_s'] / 1e9:.1f}; {bw['bytes'] / 2**20:.0f} MiB tensor)")


# ---- the model ---------------------------------------------------------------------------------

def model_costs(config, weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict:
    """Parameters a decode step multiplies by and the weight bytes it reads, from a checkpoint,
    in `dtype`: the floor of a step that reads every weight in that dtype. (The quantized paths
    read the GGUF's blocks instead, which are left out here; see weight_bytes_read.)"""
    weights = {n: t for n, t in weights.items() if not n.endswith(COMPANION_SUFFIXES)}
    elem = torch.empty((), dtype=dtype).element_size()
    embed = weights["model.embed_tokens.weight"].numel()
    matmul = sum(t.numel() for name, t in weights.items() if t.dim() == 2 and name != "model.embed_tokens.weight")
    if config.tie_word_embeddings:
        matmul += embed  # the embedding is the LM head too: read in full every step
    small = sum(t.numel() for t in weights.values() if t.dim() < 2)  # norms, biases
    return {"parameters": sum(t.numel() for t in weights.values()),
            "matmul_parameters": matmul, "weight_bytes": (matmul + small) * elem,
            "tied_embeddings": bool(config.tie_word_embeddings),
            "kv_bytes_per_token": config.kv_bytes_per_token(elem)}


def weight_bytes_read(model, rows: int) -> int:
    """Weight bytes a decode step of `rows` sequences reads: each projection's form for that many
    rows (the GGUF's blocks where a quantized tier takes them, model/quantized.py; else the
    dense weight in the model's dtype), plus the norms."""
    projections = [model.lm_head] + [p for layer in model.layers for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    norms = [model.final_norm] + [n for layer in model.layers for n in (layer.input_norm, layer.post_norm)]
    return sum(p.bytes_read(rows) for p in projections) + sum(n.numel() * n.element_size() for n in norms)


def step_costs(config, costs: dict, batch: int, context: float) -> tuple[float, float]:
    """(bytes read, FLOPs) of one decode step of `batch` sequences at `context` tokens each."""
    attention = 2 * 2 * config.num_layers * config.num_heads * config.head_dim * context  # QK^T, PV
    flops = batch * (2 * costs["matmul_parameters"] + attention)
    nbytes = costs["weight_bytes"] + batch * context * costs["kv_bytes_per_token"]
    return nbytes, flops


def decode_shapes(config, batch: int) -> list[tuple[int, int, int]]:
    """The model's decode matmuls at `batch` tokens: QKV, O, gate-up, down, LM head."""
    h, d = config.hidden_size, config.head_dim
    qkv = (config.num_heads + 2 * config.num_kv_heads) * d
    return [(batch, h, qkv), (batch, config.num_heads * d, h), (batch, h, 2 * config.intermediate_size),
            (batch, config.intermediate_size, h), (batch, h, config.vocab_size)]


# ---- isoserve ----------------------------------------------------------------------------------

def measure_decode_steps(engine, prompts: list[list[int]], output_tokens: int) -> dict:
    """Run the prompts to exactly output_tokens new tokens each; time every engine.step() and keep
    the steps in which all of them decoded one token. The read guard's own time within each
    step is timed too: its share of the step is what the guard costs."""
    from isoserve import SamplingParams

    scheduled: list[list[int]] = []
    guard_times: list[float] = []
    schedule, guard = engine.scheduler.schedule, engine.runner.guard

    def recording_schedule():
        chunks = schedule()
        scheduled.append([c.num_tokens for c in chunks])
        return chunks

    def timed_guard(chunks):
        t0 = time.perf_counter()
        try:
            return guard(chunks)
        finally:
            guard_times.append(time.perf_counter() - t0)

    # This engine only, and only while we measure.
    engine.scheduler.schedule, engine.runner.guard = recording_schedule, timed_guard
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"roofline-{len(prompts)}-{i}" for i in range(len(prompts))]
    try:
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        decode_times, decode_guard_times, all_times, finished, errors = [], [], [], 0, []
        started = time.perf_counter()
        while finished < len(prompts):
            before, guards_before = len(scheduled), len(guard_times)
            t0 = time.perf_counter()
            outputs = engine.step()
            dt = time.perf_counter() - t0
            chunks = scheduled[before] if len(scheduled) > before else []
            if chunks:
                all_times.append(dt)
                if len(chunks) == len(prompts) and all(n == 1 for n in chunks):
                    decode_times.append(dt)
                    decode_guard_times.append(sum(guard_times[guards_before:]))
            for out in outputs:
                if out.finished:
                    finished += 1
                    if out.error is not None:
                        errors.append(str(out.error))
        total = time.perf_counter() - started
    finally:
        engine.scheduler.schedule, engine.runner.guard = schedule, guard
    if errors:
        raise RuntimeError(f"isoserve failed {len(errors)} request(s): {errors[0]}")
    if not decode_times:
        raise RuntimeError("no step decoded the whole batch at once; raise --output-tokens")
    return {"steps": len(all_times), "decode_steps": len(decode_times),
            "step_seconds_median": statistics.median(decode_times),
            "step_seconds_mean": statistics.fmean(decode_times),
            "step_seconds_min": min(decode_times), "total_seconds": total,
            "guard_seconds_median": statistics.median(decode_guard_times),
            "guard_share": sum(decode_guard_times) / sum(decode_times)}


# ---- the command -------------------------------------------------------------------------------

def run_roofline(args) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from tqdm.auto import tqdm

    from isoserve.bench.offline import prompt_ids
    from isoserve.config import EngineConfig, dtype_name, parse_dtype
    from isoserve.engine.engine import Engine
    from isoserve.model.loader import load_checkpoint

    model = args.model or "smollm2-135m-instruct"
    dtype = parse_dtype(args.dtype)
    floor_dtype = parse_dtype("auto")  # the CPU's native dtype, without the model's say (see above)
    batches = sorted(set(args.batch))
    square = args.roofline_square
    total = 4 + len(batches)
    bar = tqdm(total=total, desc="roofline", unit="part")

    bar.set_postfix_str("matmul FLOP/s")
    print(f"loading {model} ({args.dtype}) ...", flush=True)
    ckpt = load_checkpoint(model, dtype)
    cfg = ckpt.config
    shapes = decode_shapes(cfg, max(batches))  # the largest batch: the best FLOP/s of these shapes
    shapes.append((square, square, square))
    matmuls = measure_flops(shapes, floor_dtype)
    peak = max(m["flops"] for m in matmuls)
    bar.write(f"matmul: best {peak / 1e12:.3f} TFLOP/s ({dtype_name(floor_dtype)}); "
              + ", ".join(f"{'x'.join(map(str, m['shape']))} {m['flops'] / 1e9:.0f} GFLOP/s" for m in matmuls))
    bar.update()

    bar.set_postfix_str("int8 matmul ops/s")
    int8_missing = int8_matmul_unavailable()
    int8_matmuls = [] if int8_missing else measure_int8_ops(shapes)
    int8_peak = max(m["ops"] for m in int8_matmuls) if int8_matmuls else None
    if int8_peak is None:
        bar.write(f"int8 matmul: not measured, no int8 floor: {int8_missing}")
    else:
        bar.write(f"int8 matmul (torch._int_mm): best {int8_peak / 1e12:.3f} TOP/s; "
                  + ", ".join(f"{'x'.join(map(str, m['shape']))} {m['ops'] / 1e9:.0f} GOP/s" for m in int8_matmuls))
    bar.update()

    bar.set_postfix_str("memory bandwidth")
    before = measure_bandwidth(args.roofline_mib * 2**20)
    _write_bandwidth(bar, "before isoserve's steps", before)
    bar.update()

    costs = model_costs(cfg, ckpt.weights, floor_dtype)
    engine = Engine(EngineConfig(model=model, dtype=args.dtype, kv_dtype=args.kv_dtype, max_num_seqs=max(64, max(batches)),
                                 fused_kernels=args.fused_kernels, int8_activations=args.int8_activations),
                    checkpoint=ckpt)
    costs["kv_bytes_per_token"] = engine.pool.slot_bytes  # in the pool's dtype, which may be narrower
    prompts = prompt_ids(engine.tokenizer, max(batches), args.prompt_tokens, args.seed)
    measure_decode_steps(engine, prompts[:2], 3)  # warm-up
    # The measured steps run from prompt + 1 to prompt + output - 1 tokens of context.
    context = args.prompt_tokens + args.output_tokens / 2
    steps = {}
    for batch in batches:
        bar.set_postfix_str(f"isoserve batch {batch}")
        steps[batch] = measure_decode_steps(engine, prompts[:batch], args.output_tokens)
        bar.write(f"batch {batch:>3}: isoserve {steps[batch]['step_seconds_median'] * 1e3:.2f} ms a step "
                  f"({steps[batch]['decode_steps']} steps)")
        bar.update()

    # This host's bandwidth moved from ~30 to ~50 GB/s and back within minutes (docs/benchmarks.md,
    # session 38): measured again after the steps, the better of the two sets the floors, so a
    # slow moment at the start does not make them lenient.
    bar.set_postfix_str("memory bandwidth again")
    after = measure_bandwidth(args.roofline_mib * 2**20)
    _write_bandwidth(bar, "after isoserve's steps", after)
    bw = best_bandwidth(before, after)
    bar.update()

    rows = []
    for batch in batches:
        nbytes, flops = step_costs(cfg, costs, batch, context)
        memory_floor, compute_floor = nbytes / bw["bytes_per_s"], flops / peak
        ideal = max(memory_floor, compute_floor)
        # The matmuls at the int8 rate, attention (float) at the float one.
        matmul_flops = batch * 2 * costs["matmul_parameters"]
        int8_floor = None if int8_peak is None else matmul_flops / int8_peak + (flops - matmul_flops) / peak
        measured = steps[batch]
        step = measured["step_seconds_median"]
        kv_bytes = nbytes - costs["weight_bytes"]
        read = weight_bytes_read(engine.model, batch)
        read_floor = (read + kv_bytes) / bw["bytes_per_s"]
        row = {"batch": batch, "weight_bytes": costs["weight_bytes"],
               "kv_bytes": kv_bytes, "bytes": nbytes, "flops": flops,
               "memory_floor_s": memory_floor, "compute_floor_s": compute_floor, "ideal_s": ideal,
               "bound": "memory" if memory_floor >= compute_floor else "compute",
               "measured_s": step, "measured_over_ideal": step / ideal,
               "measured_over_memory_floor": step / memory_floor,
               "read_weight_bytes": read, "read_floor_s": read_floor,
               "measured_over_read_floor": step / read_floor,
               "int8_compute_floor_s": int8_floor,
               "measured_over_int8_floor": None if int8_floor is None else step / int8_floor,
               "measured_tokens_per_s": batch / step, "ideal_tokens_per_s": batch / ideal,
               "isoserve": measured}
        rows.append(row)
        bar.write(f"batch {batch:>3}: ideal {ideal * 1e3:.2f} ms ({row['bound']}-bound), isoserve "
                  f"{step * 1e3:.2f} ms = {step / ideal:.2f}x ideal, {step / memory_floor:.2f}x the memory floor")
    bar.close()
    return {**run_header(args, model), "floor_dtype": dtype_name(floor_dtype), "context_tokens": context,
            "peak_flops": peak, "matmuls": matmuls, "int8_peak_ops": int8_peak,
            "int8_matmuls": int8_matmuls, "int8_unavailable": int8_missing, "bandwidth": bw, "model_costs": costs,
            "results": rows}


HEADERS = ["batch", "weight MB", "KV MB", "GFLOP/step", "memory floor ms", "compute floor ms",
           "ideal ms", "isoserve ms", "isoserve / ideal", "isoserve / memory floor",
           "weights it reads MB", "their floor ms", "isoserve / their floor",
           "int8 compute floor ms", "isoserve / int8 floor", "read guard ms", "read guard share"]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1e3:.2f}"


def _times(ratio: float | None) -> str:
    return "n/a" if ratio is None else f"{ratio:.2f}x"


def cells(row: dict) -> list[str]:
    return [str(row["batch"]), f"{row['weight_bytes'] / 1e6:.1f}", f"{row['kv_bytes'] / 1e6:.1f}",
            f"{row['flops'] / 1e9:.2f}", f"{row['memory_floor_s'] * 1e3:.2f}",
            f"{row['compute_floor_s'] * 1e3:.2f}", f"{row['ideal_s'] * 1e3:.2f}",
            f"{row['measured_s'] * 1e3:.2f}", f"{row['measured_over_ideal']:.2f}x",
            f"{row['measured_over_memory_floor']:.2f}x", f"{row['read_weight_bytes'] / 1e6:.1f}",
            f"{row['read_floor_s'] * 1e3:.2f}", f"{row['measured_over_read_floor']:.2f}x",
            _ms(row["int8_compute_floor_s"]), _times(row["measured_over_int8_floor"]),
            f"{row['isoserve']['guard_seconds_median'] * 1e3:.3f}", f"{row['isoserve']['guard_share']:.2%}"]


def table(run: dict) -> str:
    widths = [max(len(h), 8) for h in HEADERS]
    floors = run.get("floor_dtype", run["dtype"])
    int8 = "n/a" if run["int8_peak_ops"] is None else f"{run['int8_peak_ops'] / 1e12:.3f} TOP/s"
    lines = [f"== roofline: {run['model']} {run['dtype']}, {run['torch_threads']} threads{layers_note(run)}; "
             f"floors in {floors}: {run['peak_flops'] / 1e12:.3f} TFLOP/s, "
             f"{run['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s; int8 {int8}; "
             f"context {run['context_tokens']:.0f} tokens ==",
             " ".join(h.rjust(w) for h, w in zip(HEADERS, widths))]
    lines += [" ".join(c.rjust(w) for c, w in zip(cells(r), widths)) for r in run["results"]]
    return "\n".join(lines)
