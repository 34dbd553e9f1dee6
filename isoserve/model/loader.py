"""load_checkpoint: from a model name to config, weights and tokenizer in one call.

Converting a GGUF (parsing it, dequantizing, building the tokenizer) takes seconds, so the
result is cached as safetensors + JSON + a saved tokenizer and later loads read only those.
Hugging Face folders are safetensors already and are read directly.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from isoserve.config import default_cache_dir, dtype_name
from isoserve.model import int4, q8_0
from isoserve.model.config import ModelConfig
from isoserve.model.gguf_loader import has_q4_1_projections, read_gguf
from isoserve.model.hf_loader import read_hf_checkpoint
from isoserve.model.registry import ModelSource, resolve_model
from isoserve.model.tokenizer import load_saved_tokenizer, load_tokenizer, save_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

log = logging.getLogger("isoserve.model")

# Part of every cache key: bump it when the conversion changes so old entries are never read.
CACHE_FORMAT = 3  # 2: Q4_1 projections keep int4 companions; 3: a Q8_0 LM head its Q8_0 companions
# A temp folder this old was left by a crashed writer (a conversion takes seconds).
_STALE_TEMP_SECONDS = 3600


@dataclass
class Checkpoint:
    name: str
    source: ModelSource
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # Hugging Face Llama names; no lm_head when tied; int4
                                      # companions (model/int4.py) of a GGUF's Q4_1 projections,
                                      # Q8_0 ones (model/q8_0.py) of its Q8_0 embedding/LM head
    tokenizer: PreTrainedTokenizerFast
    from_cache: bool = False  # True when a GGUF's converted weights came from the cache


def load_checkpoint(model: str, dtype: torch.dtype, cache_dir: Path | None = None) -> Checkpoint:
    start = time.perf_counter()
    source = resolve_model(model)
    from_cache = False
    if source.kind == "hf":
        config, weights = read_hf_checkpoint(source.path, dtype)
        tokenizer = _hf_tokenizer(source, Path(cache_dir or default_cache_dir()))
        cache_state = "unused"
    else:
        entry = Path(cache_dir or default_cache_dir()) / _cache_key(source.path, dtype)
        cached = _read_cache_entry(entry, source) if entry.is_dir() else None
        from_cache = cached is not None
        config, weights, tokenizer = cached or _convert_gguf(source, dtype, entry)
        cache_state = "hit" if from_cache else "miss"
    _check_weights(config, weights)
    log.info("loaded model=%s source=%s dtype=%s cache=%s seconds=%.2f", source.name, source.path,
             dtype_name(dtype), cache_state, time.perf_counter() - start)
    return Checkpoint(source.name, source, config, weights, tokenizer, from_cache)


def conversion_needed(model: str, dtype: torch.dtype, cache_dir: Path | None = None) -> bool:
    """Whether load_checkpoint would convert `model` (a GGUF with no cache entry in `dtype`
    yet). `serve` then loads it once itself before it starts its workers, so that they read the
    cache instead of each converting the file at once. An unknown model raises ValueError."""
    source = resolve_model(model)
    return source.kind == "gguf" and not (Path(cache_dir or default_cache_dir()) / _cache_key(source.path, dtype)).is_dir()


def has_q4_1_blocks(model: str, cache_dir: Path | None = None) -> bool:
    """Whether `model` is a GGUF whose projections keep Q4_1 blocks. From the header of its
    converted weights in any dtype where there are some (milliseconds), else from the GGUF's
    own header (seconds: a first start, which converts the file anyway; remembered for this
    process). An unknown model raises ValueError."""
    source = resolve_model(model)
    if source.kind != "gguf":
        return False
    stat = source.path.stat()
    return _has_q4_1_blocks(source, stat.st_size, stat.st_mtime_ns, str(cache_dir or default_cache_dir()))


@functools.lru_cache(maxsize=16)
def _has_q4_1_blocks(source: ModelSource, size: int, mtime_ns: int, cache_dir: str) -> bool:
    """has_q4_1_blocks for one version of the file (its size and mtime are part of the key)."""
    for dtype in _ENTRY_DTYPES:
        weights = Path(cache_dir) / _cache_key(source.path, dtype) / "model.safetensors"
        try:
            with safe_open(weights, "pt") as entry:
                return any(".layers." in name and name.endswith(int4.CODES) for name in entry.keys())
        except Exception:  # no entry in this dtype, or an unreadable one: the next, or the file
            continue
    return has_q4_1_projections(source.path)


def _cache_key(gguf: Path, dtype: torch.dtype) -> str:
    # File identity from stat, not a content hash: hashing 100 MB+ would cost more than we save.
    stat = gguf.stat()
    ident = f"{CACHE_FORMAT}|{gguf.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{dtype}"
    return f"{gguf.stem}-{dtype_name(dtype)}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _read_cache_entry(entry: Path, source: ModelSource):
    def read():
        raw = json.loads((entry / "config.json").read_text())
        config = ModelConfig(**{**raw, "eos_token_ids": tuple(raw["eos_token_ids"])})  # JSON has lists
        return config, load_file(entry / "model.safetensors"), load_tokenizer(source, entry / "tokenizer")
    return _read_entry(entry, read, "cache entry")


# The dtypes a GGUF is converted to; entries of the same file in another one hold its tokenizer.
_ENTRY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _convert_gguf(source: ModelSource, dtype: torch.dtype, entry: Path):
    config, weights = read_gguf(source.path, dtype)
    tokenizer = _sibling_tokenizer(source, dtype, entry.parent) or load_tokenizer(source)

    def fill(temp: Path) -> None:
        save_file({k: v.contiguous() for k, v in weights.items()}, temp / "model.safetensors")
        (temp / "config.json").write_text(json.dumps(asdict(config), indent=1))
        save_tokenizer(tokenizer, temp / "tokenizer")
    _keep(entry, fill, "the converted weights")
    return config, weights, tokenizer


def _sibling_tokenizer(source: ModelSource, dtype: torch.dtype, cache: Path) -> PreTrainedTokenizerFast | None:
    """The tokenizer an entry of the same GGUF (the same path, size and mtime) in another dtype
    saved, or None: building it from the GGUF takes seconds (~13 s on a 2-core Zen 3), reading
    a saved one a fraction of that, and the dtype does not change it."""
    for other in _ENTRY_DTYPES:
        folder = cache / _cache_key(source.path, other) / "tokenizer"
        if other != dtype and (folder / "tokenizer.json").is_file():
            try:
                return load_tokenizer(source, folder)
            except Exception as e:  # unreadable: build it from the GGUF instead
                log.warning("tokenizer saved at %s is unreadable (%s); building it from the GGUF", folder, e)
    return None


def _read_entry(entry: Path, read, what: str):
    """read(), or None where the cache folder `entry` cannot be read (e.g. files truncated by a
    power loss after the rename): it is removed then, to be written again."""
    try:
        return read()
    except Exception as e:
        log.warning("%s at %s is unreadable (%s); building it again", what, entry, e)
        shutil.rmtree(entry, ignore_errors=True)
        return None


def _keep(entry: Path, fill, what: str) -> None:
    """Writes a cache folder: fill(temp) writes its files into a hidden temp folder beside it,
    renamed into place in one step, so a crash mid-write leaves a temp folder but never a
    half-written entry (temp folders a crashed writer left are removed once stale). Failing
    costs the next load speed, not this one (a full disk, a read-only cache folder, something
    that cannot be saved): a warning."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        for stale in entry.parent.glob(f".{entry.name}.*"):
            if time.time() - stale.stat().st_mtime > _STALE_TEMP_SECONDS:
                shutil.rmtree(stale, ignore_errors=True)
        temp = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            fill(temp)
            try:
                temp.rename(entry)
            except OSError:
                if not entry.is_dir():
                    raise  # otherwise a concurrent loader wrote the same entry first: keep theirs
        finally:
            shutil.rmtree(temp, ignore_errors=True)  # nothing left there after a successful rename
    except Exception as e:
        log.warning("could not keep %s at %s (%s)", what, entry, e)


# Files of a Hugging Face folder that no tokenizer reads: left out of its tokenizer's digest.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".h5", ".msgpack", ".onnx", ".ot",
                    ".tflite", ".npz")


def _hf_tokenizer(source: ModelSource, cache: Path) -> PreTrainedTokenizerFast:
    """A Hugging Face folder's tokenizer: from the copy save_tokenizer wrote in isoserve's cache
    when it was first loaded (tokenizers/<digest>), which loads through its own class
    (tokenizer.load_saved_tokenizer), else from the folder through AutoTokenizer, then kept
    there. The digest covers the path and bytes of every file under the folder but its weights,
    and the versions of transformers and tokenizers: whatever AutoTokenizer reads, changed, is a
    new entry."""
    import tokenizers
    import transformers

    digest = hashlib.sha256(f"transformers {transformers.__version__} tokenizers {tokenizers.__version__}".encode())
    for path in sorted(source.path.rglob("*")):
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            content = path.read_bytes()
            digest.update(f"\0{path.relative_to(source.path).as_posix()}\0{len(content)}\0".encode())
            digest.update(content)
    entry = cache / "tokenizers" / digest.hexdigest()[:16]
    # As for the converted weights: _keep renames an entry into place whole, so one that exists
    # is read, and one that cannot be is removed (to be kept again below).
    kept = _read_entry(entry, lambda: load_saved_tokenizer(entry), "kept tokenizer") if entry.is_dir() else None
    if kept is not None:
        return kept
    tokenizer = load_tokenizer(source)
    _keep(entry, lambda temp: save_tokenizer(tokenizer, temp), f"the tokenizer of {source.path}")
    return tokenizer


def _check_weights(config: ModelConfig, weights: dict[str, torch.Tensor]) -> None:
    """Fail at load time, naming the tensors, rather than deep inside the first forward pass."""
    expected = _expected_shapes(config)
    for name, shape in list(expected.items()):
        if ".layers." in name and len(shape) == 2 and any(name + s in weights for s in int4.COMPANIONS):
            expected |= {name + suffix: s for suffix, s in int4.companion_shapes(*shape).items()}
        if ".layers." not in name and len(shape) == 2 and any(name + s in weights for s in q8_0.COMPANIONS):
            expected |= {name + suffix: s for suffix, s in q8_0.companion_shapes(*shape).items()}
    problems = [f"missing {n}" for n in expected if n not in weights]
    problems += [f"unexpected {n}" for n in weights if n not in expected]
    problems += [f"{n} has shape {tuple(weights[n].shape)}, expected {shape}"
                 for n, shape in expected.items() if n in weights and tuple(weights[n].shape) != shape]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise ValueError(f"checkpoint does not match its config: {'; '.join(problems[:5])}{more}")


def _expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, inter, q, kv = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "post_attention_layernorm.weight": (h,),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        }
        if c.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                       p + "self_attn.v_proj.bias": (kv,)}
    return shapes


