"""The model's tokenizer and chat template, read from local files only."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from isoserve.model.registry import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def load_tokenizer(source: ModelSource, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer from `cache_dir` when that folder holds a saved one (save_tokenizer: a
    GGUF's converted-weights cache entry keeps one, isoserve's cache one for each Hugging Face
    folder's tokenizer: model/loader.py), otherwise built from the source.

    Building one from a GGUF re-reads the whole file and converts its vocabulary (seconds);
    a saved tokenizer.json loads in a fraction of that.
    """
    # Imported here: `serve` checks the model's cache before it starts its workers, and that
    # need not wait for transformers' import (~1 s).
    from transformers import AutoTokenizer

    if cache_dir is not None and (cache_dir / "tokenizer.json").is_file():
        return load_saved_tokenizer(cache_dir)
    if source.kind == "gguf":
        # The GGUF carries the vocabulary, merges, special tokens and the chat template.
        return AutoTokenizer.from_pretrained(
            source.path.parent, gguf_file=source.path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)


# Written beside a tokenizer isoserve saved (save_tokenizer): its class's module and name, and
# the transformers version that saved it. save_pretrained's tokenizer_config.json names a class
# too, but not always the class saved: transformers 4 dropped "Fast", and a LlamaTokenizer read
# over a ByteLevel tokenizer.json by transformers 5 gives other ids than AutoTokenizer's choice.
SAVED_CLASS_FILE = "isoserve_tokenizer.json"


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, folder: Path) -> None:
    """save_pretrained, and the class it saved (SAVED_CLASS_FILE), for load_saved_tokenizer."""
    import transformers

    tokenizer.save_pretrained(folder)
    cls = type(tokenizer)
    (Path(folder) / SAVED_CLASS_FILE).write_text(json.dumps(
        {"module": cls.__module__, "class": cls.__qualname__, "transformers": transformers.__version__}))


def load_saved_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The tokenizer save_tokenizer wrote to `folder`: through the class it was, where this
    transformers version saved it, else through AutoTokenizer.

    AutoTokenizer chooses the class again from tokenizer_config.json and the model's config,
    and reading that config imports the model's configuration module, which in transformers 5
    imports its model-loading and distributed code (torch.distributed.tensor, sympy): ~1.6 s of
    CPU in each process that loads a tokenizer, the server and each worker alike, all at once
    when a server starts. The class saved is the one AutoTokenizer chose for the source."""
    import importlib

    import transformers

    try:
        saved = json.loads((folder / SAVED_CLASS_FILE).read_text())
    except (OSError, ValueError):  # written by an isoserve before SAVED_CLASS_FILE, or damaged
        saved = {}
    cls = None
    if (isinstance(saved, dict) and saved.get("transformers") == transformers.__version__
            and str(saved.get("module")).startswith("transformers.")):
        try:
            cls = getattr(importlib.import_module(saved["module"]), str(saved.get("class")), None)
        except ImportError:
            cls = None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cls.from_pretrained(folder, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
