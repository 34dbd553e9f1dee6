"""Read a Hugging Face checkpoint folder (config.json + *.safetensors) into a ModelConfig and tensors."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from isoserve.model.config import ModelConfig

# HF class name -> ModelConfig.architecture; all three are the same decoder for our model code.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


def read_hf_checkpoint(folder: Path, dtype: torch.dtype) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = read_hf_config(folder)
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):  # one file, or the shards of a large model
        try:
            weights.update(load_file(file))
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file ({e})") from None
    # Old checkpoints carry the RoPE frequencies as buffers; we compute our own.
    weights = {k: v.to(dtype) for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some tied checkpoints store a copy; the embedding rules
    return config, weights


def read_hf_config(folder: Path) -> ModelConfig:
    raw = json.loads((folder / "config.json").read_text())  # bad JSON: a ValueError already
    try:
        return _model_config(folder, raw)
    except KeyError as e:
        raise ValueError(f"{folder / 'config.json'} has no {e.args[0]!r}") from None


def _model_config(folder: Path, raw: dict) -> ModelConfig:
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if not archs and raw.get("model_type") in SUPPORTED_ARCHITECTURES.values():
        arch = raw["model_type"]  # a config saved without its model class still names its family
    if arch is None:
        raise ValueError(f"{folder}: architecture {archs} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if raw.get("mlp_bias"):
        raise ValueError(f"{folder}: MLP biases are not supported")
    heads = raw["num_attention_heads"]
    max_positions = raw["max_position_embeddings"]
    if raw.get("sliding_window") and (arch == "mistral" or raw.get("use_sliding_window")):
        # We attend to the full context; within the window that is exactly sliding attention.
        max_positions = min(max_positions, raw["sliding_window"])
    theta, scaling = _rope(raw)
    return ModelConfig(
        architecture=arch,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=theta,
        max_position_embeddings=max_positions,
        # Llama, Mistral and Qwen2 configs all default to untied embeddings.
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
        rope_scaling=scaling,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(folder, raw),
    )


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either the transformers 5 `rope_parameters` dict or the older
    top-level `rope_theta` + `rope_scaling` keys."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if "type" in params:  # the pre-4.45 spelling of rope_type
        params["rope_type"] = params.pop("type")
    return theta, params if params.get("rope_type", "default") != "default" else None


def _eos_ids(folder: Path, raw: dict) -> tuple[int, ...]:
    """Stop tokens from config.json and generation_config.json (chat models often list their
    end-of-turn token only in the latter); each may be an int or a list."""
    ids = []
    gen_path = folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    for value in (raw.get("eos_token_id"), gen.get("eos_token_id")):
        ids.extend([value] if isinstance(value, int) else value or [])
    return tuple(dict.fromkeys(int(i) for i in ids))
