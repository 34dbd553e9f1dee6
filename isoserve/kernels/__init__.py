"""Fused CPU kernels (cpu_ops.cpp), built with torch's C++ extension builder.

`make install` builds them once into torch's extension cache (ninja and the system C++
compiler); a worker then only loads the built library. Where they cannot be built (no
compiler, not a CPU model), the model runs the same steps as torch ops (model/layer_ops.py);
the engine's startup log says which.
"""
from __future__ import annotations

import functools
import logging
import sys
from pathlib import Path
from types import ModuleType

log = logging.getLogger("isoserve.kernels")

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
# Native code for the CPU it is built on, minus AMX: these VMs advertise AMX but fault on it
# (the same flags bench/build_llama_server.sh needs for llama.cpp). OpenMP is torch's own
# runtime (same soname, already loaded), so at::parallel_for follows torch.set_num_threads.
CFLAGS = ["-O3", "-march=native", "-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


class KernelsUnavailable(RuntimeError):
    pass


@functools.cache
def cpu_ops() -> ModuleType:
    """The compiled module; built on first use if `make install` has not built it yet."""
    from torch.utils.cpp_extension import load
    try:
        return load(name="isoserve_cpu_ops", sources=[str(SOURCE)], extra_cflags=CFLAGS,
                    extra_ldflags=LDFLAGS, verbose=False)
    except (OSError, RuntimeError, ImportError) as e:  # no compiler, no ninja, a failed build
        raise KernelsUnavailable(f"the fused CPU kernels could not be built: {e}") from e


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
    print(f"isoserve: fused CPU kernels built ({ops.__file__})")
    return 0
