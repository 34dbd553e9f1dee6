"""The fused CPU kernels compile for an AVX2-only CPU, whatever CPU runs the tests.

`make install` builds them with -march=native, so a machine compiles only its own CPU's paths:
a path for AVX2-only CPUs (AMD Zen 3, where isoserve runs float32 with int8 tiles) that does not
compile goes unnoticed on an AVX-512 machine, and on a Zen 3 host the build then fails and
every layer falls back to torch ops, several times slower (session 32's float32 prefill
attention kernel did so, found in session 33: an AVX-512-only type used outside its guard).
Each source is compiled here, syntax only, for x86-64-v3 (AVX2 and FMA, no AVX-512) with the
build's other flags, on every core. tensors.h, the part of ATen the kernel sources include
first and most of their parse, is precompiled once for those flags and included first. Where the
precompiled header cannot be built or used, gcc parses the header itself, so the check is the
same either way.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from torch.utils.cpp_extension import include_paths

from isoserve.kernels import CFLAGS, HEADERS, SOURCES

LEVEL = "x86-64-v3"


def _compiler() -> list[str]:
    """The compiler and the build's flags, -march=native replaced by LEVEL."""
    flags = [f"-march={LEVEL}" if flag == "-march=native" else flag for flag in CFLAGS]
    includes = [arg for path in include_paths() + [sysconfig.get_paths()["include"]] for arg in ("-isystem", path)]
    return [shutil.which("c++") or "c++", "-std=c++20", *flags, *includes,
            "-DTORCH_EXTENSION_NAME=portability_check", "-DTORCH_API_INCLUDE_EXTENSION_H"]


def _precompile_tensors_header(compiler: list[str], folder: Path) -> Path:
    """A header that includes the kernels' tensors.h, with its precompiled form beside it (gcc
    uses header.h.gch for `-include header.h` when the flags match, else parses header.h)."""
    (tensors,) = [path for path in HEADERS if path.name == "tensors.h"]
    header = folder / "kernel_tensors.h"
    header.write_text(f'#include "{tensors}"\n')
    subprocess.run([*compiler, "-x", "c++-header", str(header), "-o", str(header) + ".gch"],
                   capture_output=True, text=True)
    return header


def _check(compiler: list[str], header: Path, source) -> tuple[str, subprocess.CompletedProcess]:
    command = [*compiler, "-fsyntax-only", "-include", str(header), str(source)]
    return source.name, subprocess.run(command, capture_output=True, text=True)


def test_kernels_compile_for_an_avx2_cpu_without_avx512(tmp_path):
    assert "-march=native" in CFLAGS  # the flag replaced above
    compiler = _compiler()
    header = _precompile_tensors_header(compiler, tmp_path)
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(partial(_check, compiler, header), SOURCES))
    failed = {name: result.stderr[-3000:] for name, result in results if result.returncode != 0}
    assert not failed, f"kernel sources that do not compile for -march={LEVEL}: {failed}"
