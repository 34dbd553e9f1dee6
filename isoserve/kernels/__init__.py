"""Fused CPU kernels (cpu_ops.cpp, amx_matmul.cpp, amx_attention.cpp, vector_matmul.cpp,
vector_attention.cpp, int8_matmul.cpp, f32_prefill_attention.cpp, decoder_stack.cpp,
nucleus.cpp, draw.cpp), bound to Python by module.cpp, built with torch's C++ extension builder.

`make install` builds them once (`python -m isoserve.kernels`: ninja and the system C++
compiler) into a folder named after a hash of the source, the flags and the torch version.
A worker then imports the built library directly: torch's own `load()` takes a lock file and
runs ninja in every process, and a worker killed in that window (a restart, a kill -9) would
leave the lock behind and hang every later start. Only a process that finds no library for
this source builds one. Where the kernels do not apply (CUDA, float16) or cannot be built, the
model runs the same steps as torch ops (model/layer_ops.py); the engine's startup log says which.
The sampler's top-p kernel (nucleus.cpp) runs on the CPU whatever the model's device, wherever
a library is already built (built_cpu_ops).
"""
from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import re
import sys
from pathlib import Path
from types import ModuleType

from isoserve.config import default_cache_dir

log = logging.getLogger("isoserve.kernels")

# module.cpp first: its Python bindings make it the slowest source to compile, and ninja starts
# the sources in this order.
SOURCES = [Path(__file__).with_name(name) for name in ("module.cpp", "cpu_ops.cpp", "amx_matmul.cpp", "amx_attention.cpp",
                                                         "vector_matmul.cpp", "vector_attention.cpp", "int8_matmul.cpp",
                                                         "f32_prefill_attention.cpp", "decoder_stack.cpp",
                                                         "nucleus.cpp", "draw.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("amx.h", "bf16x16.h", "block_linear.h", "decoder_stack.h",
                                                         "entry_points.h", "f32x8.h", "fp8.h", "line_prefetch.h",
                                                         "page_reads.h", "prefill_chunks.h", "tensors.h")]
# Native code for the CPU it is built on, minus AMX: a process must ask Linux for the tile state
# before its first AMX instruction, or that instruction faults (as llama.cpp's does on these VMs:
# bench/build_llama_server.sh). amx_matmul.cpp enables AMX for its own functions only, and runs
# them after that request succeeded. OpenMP is torch's own runtime (same soname, already
# loaded), so at::parallel_for follows torch.set_num_threads.
CFLAGS = ["-O3", "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


class KernelsUnavailable(RuntimeError):
    pass


def build_root() -> Path:
    return Path(os.environ.get("ISOSERVE_KERNELS_DIR") or default_cache_dir() / "kernels")


def module_name() -> str:
    """Names the build: a changed source, flag, torch version or CPU is a different library.
    -march=native compiles for the instructions of the CPU it builds on (AVX-512 here, AVX2
    there), so a cache folder shared by two kinds of machine must hold one build for each: one
    built on the other would fault on its first instruction this CPU lacks."""
    import torch
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES + HEADERS), " ".join(CFLAGS + LDFLAGS).encode(),
                 torch.__version__.encode(), sys.version.encode(), cpu_features().encode()):
        digest.update(part)
    return f"isoserve_cpu_ops_{digest.hexdigest()[:12]}"


# The flags of /proc/cpuinfo that name instructions a compiler may emit; the rest (mitigations
# such as ibpb, virtualization features) can change with a kernel or microcode update, and
# would cost a rebuild for nothing.
_INSTRUCTION_FLAGS = re.compile(r"^(avx|amx|sse|ssse|fma|f16c|bmi|adx|aes|pclmul|vpclmul|vaes|gfni|sha|"
                                r"movbe|popcnt|abm|lzcnt|rdrand|rdseed|xsave|clflush|clwb|serialize|cx16)")


def cpu_features() -> str:
    """The CPU's instruction set extensions as Linux lists them (the first "flags" line of
    /proc/cpuinfo, those a compiler may emit), else the processor's name."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return " ".join(f for f in line.split(":", 1)[1].split() if _INSTRUCTION_FLAGS.match(f))
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


def _library(name: str) -> Path:
    return build_root() / name / f"{name}.so"


@functools.cache
def cpu_ops() -> ModuleType:
    """The compiled module: imported when built, built first otherwise."""
    name = module_name()
    library = _library(name)
    folder = library.parent
    if not library.exists():
        _build(name, folder)
    loader = importlib.machinery.ExtensionFileLoader(name, str(library))
    spec = importlib.util.spec_from_file_location(name, library, loader=loader)
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:  # e.g. a library left half-written by an interrupted build
        raise KernelsUnavailable(f"the fused CPU kernels at {library} do not load ({e}); "
                                 f"remove {folder} and run `python -m isoserve.kernels`") from e
    return module


def _build(name: str, folder: Path) -> None:
    from torch.utils.cpp_extension import load
    folder.mkdir(parents=True, exist_ok=True)
    try:
        load(name=name, sources=[str(source) for source in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
             build_directory=str(folder), verbose=False)
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, a failed build
        raise KernelsUnavailable(f"the fused CPU kernels could not be built: {e}") from e


def built_cpu_ops() -> ModuleType | None:
    """The compiled module where this source's library is already built, else None: for a
    caller that may use the kernels but must not wait minutes for a build (the CPU sampler of
    a model on another device)."""
    if not _library(module_name()).exists():
        return None
    try:
        return cpu_ops()
    except KernelsUnavailable:
        return None


def try_cpu_ops() -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why not)."""
    try:
        return cpu_ops(), ""
    except KernelsUnavailable as e:
        return None, str(e).splitlines()[0]


def main() -> int:
    """`python -m isoserve.kernels`: build the kernels now (make install runs this)."""
    ops, why = try_cpu_ops()
    if ops is None:
        print(f"isoserve: {why}; the model will use torch ops instead", file=sys.stderr)
        return 1
    print(f"isoserve: fused CPU kernels ready ({ops.__file__})")
    return 0
