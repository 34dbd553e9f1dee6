"""The model's tokenizer and chat template, read from local files only."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isoserve.model.registry import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def load_tokenizer(source: ModelSource, cache_dir: Path | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer from `cache_dir` when that folder holds one written by save_pretrained (the
    converted-weights cache keeps one), otherwise built from the source.

    Building one from a GGUF re-reads the whole file and converts its vocabulary (seconds);
    a saved tokenizer.json loads in a fraction of that.
    """
    # Imported here: `serve` checks the model's cache before it starts its workers, and that
    # need not wait for transformers' import (~1 s).
    from transformers import AutoTokenizer

    if cache_dir is not None and (cache_dir / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
    if source.kind == "gguf":
        # The GGUF carries the vocabulary, merges, special tokens and the chat template.
        return AutoTokenizer.from_pretrained(
            source.path.parent, gguf_file=source.path.name, local_files_only=True)
    return AutoTokenizer.from_pretrained(source.path, local_files_only=True)
