#!/usr/bin/env bash
# Wheels of isoserve's requirements that the lent GPU machine's image lacks (it holds torch,
# transformers, tokenizers, numpy, httpx, aiohttp, uvloop, prometheus-client, matplotlib,
# pytest and hypothesis), for its python 3.12, into DIR (default .devcarry/whl). That machine
# reaches no package registry, so they travel with the working tree: ignore DIR in
# .git/info/exclude, name it in the run's carry, and install there with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site
# The versions are this machine's (.venv) where it has the package, so both run the same code. fastapi pulls in
# opentelemetry-api; openai pulls in jiter and distro.
set -euo pipefail
dir=${1:-.devcarry/whl}
py=${PY:-.venv/bin/python}
mkdir -p "$dir"
packages=(fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection
          typing_extensions opentelemetry-api uvicorn httptools pyzmq gguf crc32c openai jiter distro
          sniffio pytest-timeout)
platforms=()
for p in manylinux1 manylinux2014 manylinux_2_17 manylinux_2_24 manylinux_2_27 manylinux_2_28 manylinux_2_31 manylinux_2_34; do
    platforms+=(--platform "${p}_x86_64")
done
for name in "${packages[@]}"; do
    version=$("$py" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}' || true)
    spec=$name${version:+==$version}
    "$py" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d "$dir" "$spec" 2>&1 | grep -v "is ignored" || true
    compgen -G "$dir/$(echo "$name" | tr - _)-*.whl" > /dev/null || { echo "no wheel for $spec" >&2; exit 1; }
done
ls "$dir"
