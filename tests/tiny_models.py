"""Tiny random-weight checkpoints with SmolLM2's real tokenizer and chat template, for fast tests.

make_tiny_llama writes a Hugging Face LlamaForCausalLM folder; make_tiny_gguf converts such a
folder to a GGUF exactly as llama.cpp's converter would, so GGUF code can be checked against
known weights. Both are deterministic for a given seed.
"""
from __future__ import annotations

import functools
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the hub

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from isoserve.model.registry import DEFAULT_MODEL, resolve_model
from isoserve.model.tokenizer import load_tokenizer

SMOLLM2_VOCAB_SIZE = 49152
SMOLLM2_BOS, SMOLLM2_EOS = 1, 2  # <|im_start|>, <|im_end|>
# Where engine tests run: the CPU always, and a GPU where this machine has one (the CUDA path is
# checked on such a machine by bench/device_check.sh; CI has none).
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


# The CPU's flags, by which these decide which of isoserve's kernels must run here (-march=native).
_FLAGS = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
# Whether isoserve's AMX kernels (kernels/amx_matmul.cpp) must run here.
HAS_AMX = {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"} <= _FLAGS
# Whether the float32 block kernels (kernels/vector_matmul.cpp) must run here.
HAS_AVX2 = {"avx2", "fma"} <= _FLAGS
# Whether the float32 prefill attention kernel (kernels/f32_prefill_attention.cpp) must run here.
HAS_AVX512 = {"avx512f", "avx512bw"} <= _FLAGS
# Whether the int8 block kernels (kernels/int8_matmul.cpp) take their AVX512-VNNI tiles here.
HAS_AVX512_VNNI = HAS_AVX2 and {"avx512f", "avx512bw", "avx512_vnni"} <= _FLAGS
# For the tests of the int8 path, which only a CPU with AVX2 and FMA takes.
NEEDS_AVX2 = pytest.mark.skipif(not HAS_AVX2, reason="int8 activations run only on CPUs with AVX2 and FMA, which "
                                "this one lacks: float32 never takes that path here")


def make_tiny_llama(path: Path, *, num_heads: int = 4, num_kv_heads: int = 2, hidden_size: int = 64,
                    num_layers: int = 2, intermediate_size: int = 128, seed: int = 0,
                    tokenizer_dir: Path | None = None) -> Path:
    """tokenizer_dir (default: $ISOSERVE_TEST_TOKENIZER_DIR): SmolLM2's tokenizer files saved
    there, for a machine without the default model's package (bench/device_check.sh); without
    it they come from that package."""
    tokenizer_dir = tokenizer_dir or os.environ.get("ISOSERVE_TEST_TOKENIZER_DIR")
    path.mkdir(parents=True, exist_ok=True)
    config = LlamaConfig(
        vocab_size=SMOLLM2_VOCAB_SIZE, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-5, bos_token_id=SMOLLM2_BOS,
        eos_token_id=SMOLLM2_EOS, tie_word_embeddings=False,
        # Unit-scale activations instead of HF's 0.02: with tiny weights every output is close to
        # uniform and barely depends on the context, which would hide attention and KV bugs.
        initializer_range=hidden_size ** -0.5,
        architectures=["LlamaForCausalLM"],  # model.save_pretrained would add it; we save by hand
    )
    with torch.random.fork_rng(devices=[]):  # deterministic without disturbing the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
        with torch.no_grad():  # norms start at exactly 1; random ones catch a dropped norm weight
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.copy_(1 + 0.2 * torch.randn_like(param))
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    files = (_smollm2_tokenizer_files() if tokenizer_dir is None
             else {p.name: p.read_bytes() for p in Path(tokenizer_dir).iterdir()})
    for name, data in files.items():
        (path / name).write_bytes(data)
    return path


def make_tiny_gguf(path: Path, hf_folder: Path, *, q4_1: bool = False) -> Path:
    """An F32 GGUF of a make_tiny_llama folder, written as llama.cpp's convert_hf_to_gguf.py does:
    its metadata keys, gguf's own tensor name map, and Q/K rows permuted for llama.cpp's RoPE.
    With q4_1, the layers' projections are quantized to Q4_1 as in the default model's GGUF."""
    cfg = json.loads((hf_folder / "config.json").read_text())
    heads, kv_heads, layers = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_hidden_layers"]
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_vocab_size(cfg["vocab_size"])
    for key, (value, vtype, sub_type) in _smollm2_tokenizer_metadata().items():
        writer.add_key_value(key, value, vtype, sub_type)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        base, suffix = name.rsplit(".", 1)
        array = tensor.float().numpy()
        if base.endswith("q_proj"):
            array = _llama_cpp_permute(array, heads, heads)
        elif base.endswith("k_proj"):
            array = _llama_cpp_permute(array, heads, kv_heads)
        if q4_1 and ".layers." in base and base.endswith("_proj") and suffix == "weight":
            writer.add_tensor(f"{names.get_name(base)}.{suffix}",
                              gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q4_1),
                              raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    # LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py, verbatim in behaviour.
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


@functools.cache
def _smollm2_tokenizer_files() -> dict[str, bytes]:
    """SmolLM2's saved tokenizer files; converting them from the GGUF takes seconds, so once per process."""
    tokenizer = load_tokenizer(resolve_model(DEFAULT_MODEL))
    with tempfile.TemporaryDirectory() as folder:
        tokenizer.save_pretrained(folder)
        return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


@functools.cache
def _smollm2_tokenizer_metadata() -> dict[str, tuple]:
    """The tokenizer.* GGUF keys of SmolLM2 as (value, type, array element type)."""
    reader = gguf.GGUFReader(resolve_model(DEFAULT_MODEL).path)
    return {key: (field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
            for key, field in reader.fields.items() if key.startswith("tokenizer.")}
