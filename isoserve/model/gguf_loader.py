"""Read a llama.cpp GGUF file into a ModelConfig and dequantized tensors with Hugging Face names.

Our model code is written against the Hugging Face Llama layout, so everything GGUF-specific
(metadata keys, tensor names, the Q/K row order of llama.cpp's RoPE) is undone here.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from tqdm import tqdm

from isoserve.model import int4, q8_0
from isoserve.model.config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")

# llama.cpp's converter reorders Q/K rows for its interleaved RoPE only for these architectures;
# Qwen2 is converted as is because llama.cpp runs it with the rotate_half ("NeoX") RoPE.
_QK_PERMUTED = ("llama",)

_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {  # blk.{i}.<key>.{weight,bias} -> model.layers.{i}.<value>.{weight,bias}
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_REQUIRED = object()
# Q8_0 tensors whose blocks the model multiplies by (the LM head, which a tied model takes from
# the embedding); other Q8_0 tensors are only dequantized.
_Q8_0_KEPT = ("model.embed_tokens.weight", "lm_head.weight")


def read_gguf(path: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Dequantized weights in `dtype`; a Q4_1 projection also keeps its blocks as int4 companions,
    and a Q8_0 embedding or LM head its blocks as Q8_0 companions (model/q8_0.py)."""
    reader = GGUFReader(path)
    config = _read_config(reader)
    weights = {}
    for tensor in tqdm(reader.tensors, desc=f"Dequantizing {path.name}", unit="tensor"):
        name = _hf_name(tensor.name)
        tensors = {name: _dequantize(tensor).to(dtype)}
        if tensor.tensor_type == GGMLQuantizationType.Q4_1 and ".layers." in name:
            rows, cols = tensors[name].shape
            parts = int4.split_q4_1(tensor.data, rows, cols)
            tensors |= {name + suffix: part for suffix, part in zip(int4.COMPANIONS, parts)}
        elif tensor.tensor_type == GGMLQuantizationType.Q8_0 and name in _Q8_0_KEPT:
            rows, cols = tensors[name].shape
            parts = q8_0.split_q8_0(tensor.data, rows, cols)
            tensors |= {name + suffix: part for suffix, part in zip(q8_0.COMPANIONS, parts)}
        for key, value in tensors.items():
            weights[key] = _hf_row_order(config, name, value)
    return config, weights


def has_q4_1_projections(path: Path) -> bool:
    """Whether the file's layers hold Q4_1 projections (which keep their blocks: read_gguf).
    Reads the whole header: ~2 s for the default model, most of it the tokenizer's arrays."""
    return any(t.tensor_type == GGMLQuantizationType.Q4_1 and t.name.startswith("blk.")
               for t in GGUFReader(path).tensors)


def _hf_row_order(config: ModelConfig, name: str, rows: torch.Tensor) -> torch.Tensor:
    """Q and K rows (of a weight, a bias or a weight's int4 companions) in Hugging Face order."""
    if config.architecture in _QK_PERMUTED:
        if ".self_attn.q_proj." in name:
            return _undo_rope_permutation(rows, config.num_heads)
        if ".self_attn.k_proj." in name:
            return _undo_rope_permutation(rows, config.num_kv_heads)
    return rows


def _read_config(reader: GGUFReader) -> ModelConfig:
    def get(key: str, default=_REQUIRED):
        field = reader.get_field(key)
        if field is None:
            if default is _REQUIRED:
                raise ValueError(f"GGUF metadata has no {key!r}")
            return default
        return field.contents()

    arch = get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        # Llama 3.1-style RoPE scaling is stored as per-frequency factors, not as HF parameters.
        raise ValueError("GGUF files with a rope_freqs tensor (llama3 RoPE scaling) are not "
                         "supported; use the Hugging Face checkpoint folder instead")
    hidden = int(get(f"{arch}.embedding_length"))
    heads = int(get(f"{arch}.attention.head_count"))
    head_dim = int(get(f"{arch}.attention.key_length", hidden // heads))
    rope_dims = int(get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise ValueError(f"partial rotary embeddings ({rope_dims} of {head_dim} dims) are not supported")
    # llama.cpp treats eos, end-of-turn and end-of-message alike as "end of generation".
    eos = (get(f"tokenizer.ggml.{kind}_token_id", None) for kind in ("eos", "eot", "eom"))
    return ModelConfig(
        architecture=arch,
        # Rows of the embedding are authoritative: the token list may be shorter than a padded vocab.
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # ggml lists dims fastest-first
        hidden_size=hidden,
        intermediate_size=int(get(f"{arch}.feed_forward_length")),
        num_layers=int(get(f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_float(get(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=_float(get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(get(f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        rope_scaling=_rope_scaling(arch, get),
        bos_token_id=get("tokenizer.ggml.bos_token_id", None),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
    )


def _rope_scaling(arch: str, get) -> dict | None:
    """GGUF rope.scaling.* keys as the Hugging Face rope_scaling dict our RoPE code reads."""
    kind = get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": _float(get(f"{arch}.rope.scaling.factor"))}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(
            get(f"{arch}.rope.scaling.original_context_length"))
    elif kind != "linear":
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
    return scaling


def _float(value: float) -> float:
    # GGUF stores float32: recover the decimal it was written from (1e-05, not 9.99999974e-06).
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a Llama-family model")


def _dequantize(tensor) -> torch.Tensor:
    array = dequantize(tensor.data, tensor.tensor_type)
    # F32 tensors come back as read-only views of the memory-mapped file; torch needs its own copy.
    array = np.require(array, dtype=np.float32, requirements=["C", "W"])
    return torch.from_numpy(array.reshape([int(n) for n in reversed(tensor.shape)]))


def _undo_rope_permutation(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Return Q or K rows (weight or bias) to the Hugging Face rotate_half order.

    Within each head, HF keeps the rotary pairs (i, i + d/2) in two halves; llama.cpp's
    converter interleaves them as rows (0, d/2, 1, d/2+1, ...) for its adjacent-pair RoPE:
    gguf = hf.reshape(n_heads, 2, d/2, ...).swapaxes(1, 2). The inverse reads the rows as
    (n_heads, d/2, 2) and swaps back.
    """
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
