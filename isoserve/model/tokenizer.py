"""The model's tokenizer and chat template, read from local files only."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from isoserve.model.registry import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def load_tokenizer(source: ModelSource, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer from `cache_dir` when that folder holds one written by save_pretrained (a
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


def load_saved_tokenizer(folder: Path) -> PreTrainedTokenizerFast:
    """The tokenizer that save_pretrained wrote to `folder`, through the class it names there.

    AutoTokenizer would choose the class again from tokenizer_config.json and the model's
    config, and reading that config imports the model's configuration module, which in
    transformers 5 imports its model-loading and distributed code (torch.distributed.tensor,
    sympy): ~1.6 s of CPU in each process that loads a tokenizer, the server and each worker
    alike, all at once when a server starts. The class saved is that of the tokenizer written,
    the one AutoTokenizer chose for the source. A folder naming no tokenizer class that
    transformers exports goes through AutoTokenizer."""
    import transformers

    name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase):
        return cls.from_pretrained(folder, local_files_only=True)
    return transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
