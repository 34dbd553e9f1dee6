"""Facts about the machine and the code a benchmark ran on, for the record next to its numbers."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _git_commit() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, text=True,
                                capture_output=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               text=True, capture_output=True).stdout.strip()
        return commit + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_facts() -> dict:
    import torch
    import transformers
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": _cpu_model(),
        "memory_gib": _memory_gib(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "isoserve_commit": _git_commit(),
    }


def describe(facts: dict) -> str:
    memory = f", {facts['memory_gib']:.0f} GiB" if facts.get("memory_gib") else ""
    return (f"{facts['nproc']} cores ({facts['cpu_model']}){memory}; Python {facts['python']}, "
            f"torch {facts['torch']}, transformers {facts['transformers']}; "
            f"isoserve {facts['isoserve_commit']}")


def layers_note(run: dict) -> str:
    """For a table's title: said only when isoserve ran without its fused kernels."""
    return "" if run.get("fused_kernels", True) else ", isoserve's layers as torch ops"


def dtypes(run: dict) -> str:
    """For a title: isoserve's dtype, and its KV cache's and transformers' where they differ."""
    dtype = run["dtype"]
    kv, peers = run.get("kv_dtype") or dtype, run.get("peer_dtype") or dtype
    text = dtype if kv == dtype else f"{dtype} (isoserve's KV cache {kv})"
    return text if peers == dtype else f"{text}; transformers in {peers}"


def where(run: dict) -> str:
    """For a table's title: the GPU a run used, or the CPU threads it had."""
    if run.get("device", "cpu").startswith("cuda"):
        return f"on {run['gpu']}"
    return f"{run['torch_threads']} threads"


def run_header(args, model: str) -> dict:
    """What every offline run's JSON starts with: which run, when, what, where, with which sizes."""
    import torch
    from datetime import datetime, timezone
    return {"label": args.label or "",
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "model": model, "dtype": args.dtype, "kv_dtype": args.kv_dtype,
            "peer_dtype": getattr(args, "peer_dtype", args.dtype), "torch_threads": torch.get_num_threads(),
            "device": args.device,
            "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
            "fused_kernels": args.fused_kernels, "int8_activations": args.int8_activations,
            "machine": machine_facts(),
            "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
            "seed": args.seed}
