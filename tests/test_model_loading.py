"""Model loading on real files: the packaged SmolLM2 GGUF, tiny HF folders and tiny GGUFs."""
from __future__ import annotations

import json
import logging
import os
import shutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers reads it: never touch the hub

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from isoserve.model import int4, q8_0
from isoserve.model.quantized import COMPANION_SUFFIXES
from isoserve.model.loader import default_cache_dir, load_checkpoint
from isoserve.model.registry import DEFAULT_MODEL, resolve_model
from isoserve.model.tokenizer import SAVED_CLASS_FILE, load_saved_tokenizer, save_tokenizer
from tiny_models import make_tiny_gguf, make_tiny_llama

TEXT = "Hello world! The invoice is due on 2026-09-15, Yusuf Okonkwo-Reyes.\n  Ünïcödé ✓"


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("isoserve-cache")  # never the user's ~/.cache/isoserve


@pytest.fixture(scope="session")
def smollm2(cache_dir):
    """The default model loaded twice in float32: a conversion, then a cache hit."""
    first = load_checkpoint(DEFAULT_MODEL, torch.float32, cache_dir)
    second = load_checkpoint(DEFAULT_MODEL, torch.float32, cache_dir)
    return first, second


@pytest.fixture(scope="module")
def transformers_smollm2_state(transformers_smollm2):
    # transformers' own GGUF loader is the reference for our reverse permutation.
    return transformers_smollm2.state_dict()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory, tiny_llama):
    return make_tiny_gguf(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf", tiny_llama)


def test_default_model_is_the_packaged_gguf():
    source = resolve_model(DEFAULT_MODEL)
    assert source.kind == "gguf" and source.name == DEFAULT_MODEL
    assert source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.path.is_file()


def test_unknown_models_are_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    no_safetensors = tmp_path / "bin-only"
    no_safetensors.mkdir()
    (no_safetensors / "config.json").write_text("{}")
    for name in ("no-such-model", str(tmp_path), str(tmp_path / "weights.bin"), str(no_safetensors)):
        with pytest.raises(ValueError):
            resolve_model(name)


def test_cache_dir_defaults_to_the_environment_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("ISOSERVE_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path


def test_smollm2_config_matches_known_facts(smollm2):
    cfg = smollm2[0].config
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 8192)
    assert cfg.tie_word_embeddings and not cfg.attention_bias and cfg.rope_scaling is None
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5  # as in its HF config
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,)  # <|im_start|>, <|im_end|>
    assert cfg.kv_bytes_per_token(2) == 23040  # the 22.5 KiB per token of the design notes


def _parameters(weights: dict) -> dict:
    return {n: w for n, w in weights.items() if not n.endswith(COMPANION_SUFFIXES)}


def test_weights_have_hf_names_and_requested_dtype(smollm2):
    weights = _parameters(smollm2[0].weights)
    assert "lm_head.weight" not in weights  # tied: the model reuses the embedding
    assert weights["model.embed_tokens.weight"].shape == (49152, 576)
    assert weights["model.layers.29.self_attn.k_proj.weight"].shape == (192, 576)
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_q4_1_projections_keep_their_blocks_and_they_give_the_same_weights(smollm2):
    # Every projection of the default model is Q4_1 in its GGUF (the embedding is Q8_0). Its
    # companions are the file's own codes, d and m: d * q + m is the dequantized weight, bit
    # for bit, Q/K rows in Hugging Face order included.
    weights = smollm2[0].weights
    projections = [n for n in _parameters(weights) if n.endswith("_proj.weight")]
    assert len(projections) == 30 * 7
    assert not int4.has_companions(weights, "model.embed_tokens.weight")
    for name in projections:
        assert int4.has_companions(weights, name), name
        assert torch.equal(int4.dequantize(weights, name), weights[name]), name


def test_the_q8_0_embedding_keeps_its_blocks_and_they_give_the_same_weights(smollm2):
    # The embedding (also the LM head: tied) is Q8_0 in the file: its companions are the file's
    # int8 codes and float16 d, and d * q is the dequantized embedding bit for bit.
    weights = smollm2[0].weights
    name = "model.embed_tokens.weight"
    assert q8_0.has_companions(weights, name)
    assert weights[name + q8_0.CODES].dtype == torch.int8 and weights[name + q8_0.SCALE].dtype == torch.float16
    assert torch.equal(q8_0.dequantize(weights, name), weights[name])
    assert [n for n in weights if n.endswith(q8_0.COMPANIONS)] == [name + s for s in q8_0.COMPANIONS]


def test_second_load_is_served_from_cache_with_identical_tensors(smollm2):
    first, second = smollm2
    assert not first.from_cache and second.from_cache
    assert second.config == first.config
    assert second.weights.keys() == first.weights.keys()
    for name, tensor in first.weights.items():
        assert torch.equal(second.weights[name], tensor), name


def test_each_load_logs_one_line(smollm2, cache_dir, caplog):
    with caplog.at_level(logging.INFO, logger="isoserve.model"):
        load_checkpoint(DEFAULT_MODEL, torch.float32, cache_dir)
    [record] = [r for r in caplog.records if r.name == "isoserve.model"]
    assert "cache=hit" in record.message and "dtype=float32" in record.message


def test_tokenizer_round_trips_text_and_has_chat_template(smollm2):
    for checkpoint in smollm2:  # built from the GGUF, then read back from the cache
        tok = checkpoint.tokenizer
        ids = tok.encode(TEXT, add_special_tokens=False)
        assert tok.decode(ids) == TEXT
        assert tok.eos_token_id == 2 and tok.eos_token_id in checkpoint.config.eos_token_ids
        prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
        assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert_same_tokenizer(smollm2[1].tokenizer, smollm2[0].tokenizer)


def assert_same_tokenizer(tok, reference) -> None:
    """The same class, vocabulary, special tokens and chat template, and the same ids and text."""
    assert type(tok) is type(reference)
    assert tok.get_vocab() == reference.get_vocab()
    assert tok.all_special_tokens == reference.all_special_tokens
    assert ([tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id] ==
            [reference.bos_token_id, reference.eos_token_id, reference.pad_token_id, reference.unk_token_id])
    assert tok.chat_template == reference.chat_template
    for text in (TEXT, "<|im_start|>user\nhi<|im_end|>\n", ""):
        assert tok.encode(text) == reference.encode(text), text
        assert tok.decode(tok.encode(text)) == reference.decode(reference.encode(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]
    assert (tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) ==
            reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("layer", [0, 14, 29])
def test_gguf_weights_match_transformers_gguf_loader(smollm2, transformers_smollm2_state, layer):
    ours, theirs = smollm2[0].weights, transformers_smollm2_state
    names = [n for n in _parameters(ours) if n.startswith(f"model.layers.{layer}.")]
    assert len(names) == 9
    for name in names + ["model.embed_tokens.weight", "model.norm.weight"]:
        torch.testing.assert_close(ours[name], theirs[name], msg=name)


def test_bfloat16_is_cached_separately_and_matches_float32(smollm2, cache_dir):
    first = load_checkpoint(DEFAULT_MODEL, torch.bfloat16, cache_dir)
    second = load_checkpoint(DEFAULT_MODEL, torch.bfloat16, cache_dir)
    assert not first.from_cache and second.from_cache
    for name, tensor in smollm2[0].weights.items():
        if name.endswith(COMPANION_SUFFIXES):  # the file's blocks, whatever the compute dtype
            assert torch.equal(first.weights[name], tensor), name
        else:
            assert first.weights[name].dtype == torch.bfloat16
            assert torch.equal(first.weights[name], tensor.to(torch.bfloat16)), name
        assert torch.equal(second.weights[name], first.weights[name]), name


def test_a_second_dtype_takes_the_tokenizer_its_sibling_entry_saved(tiny_q4_1, tiny_checkpoint, tiny_cache,
                                                                     tmp_path, monkeypatch):
    """Converting a GGUF in a second dtype reads the tokenizer the first dtype's entry saved
    instead of building it from the file again (seconds); it is the same tokenizer. The first
    entry here is the session's bfloat16 conversion of the tiny GGUF (tiny_checkpoint)."""
    from isoserve.model import loader
    [entry] = [p for p in tiny_cache.iterdir() if p.name.startswith(tiny_q4_1.stem + "-bfloat16-")]
    shutil.copytree(entry, tmp_path / entry.name)
    read = []
    real = loader.load_tokenizer
    monkeypatch.setattr(loader, "load_tokenizer", lambda source, folder=None: read.append(folder) or real(source, folder))
    converted = load_checkpoint(str(tiny_q4_1), torch.float32, tmp_path)
    assert not converted.from_cache and read == [tmp_path / entry.name / "tokenizer"]  # never the GGUF
    assert converted.tokenizer.encode(TEXT) == tiny_checkpoint.tokenizer.encode(TEXT)
    assert converted.tokenizer.chat_template == tiny_checkpoint.tokenizer.chat_template


def test_hf_folder_loads_identical_tensors(tiny_llama, smollm2, cache_dir):
    checkpoint = load_checkpoint(str(tiny_llama), torch.float32, cache_dir)
    assert checkpoint.source.kind == "hf" and not checkpoint.from_cache
    cfg = checkpoint.config
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (2, 64, 128)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.vocab_size, cfg.max_position_embeddings) == (49152, 2048)
    assert not cfg.tie_word_embeddings and cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    reference = AutoModelForCausalLM.from_pretrained(tiny_llama, local_files_only=True).state_dict()
    assert checkpoint.weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(checkpoint.weights[name], tensor), name
    assert checkpoint.tokenizer.encode(TEXT) == smollm2[0].tokenizer.encode(TEXT)
    assert checkpoint.tokenizer.chat_template == smollm2[0].tokenizer.chat_template


def test_hf_folder_casts_to_requested_dtype(tiny_llama, cache_dir):
    checkpoint = load_checkpoint(str(tiny_llama), torch.bfloat16, cache_dir)  # HF weights are read as they are
    assert all(w.dtype == torch.bfloat16 for w in checkpoint.weights.values())


def test_an_hf_folders_tokenizer_is_kept_and_read_back_as_autotokenizer_gives_it(tiny_llama, tmp_path, monkeypatch):
    """The first load keeps the tokenizer, saved, in the cache (tokenizers/<digest>); later loads
    read it through the class it names, never AutoTokenizer (whose read of the model's config
    costs every process ~1.6 s), and get what AutoTokenizer gives for the folder."""
    reference = AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)
    first = load_checkpoint(str(tiny_llama), torch.float32, tmp_path).tokenizer
    [entry] = (tmp_path / "tokenizers").iterdir()
    assert (entry / "tokenizer.json").is_file() and (entry / "tokenizer_config.json").is_file()

    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer read a tokenizer the cache keeps")
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", refuse)
    second = load_checkpoint(str(tiny_llama), torch.float32, tmp_path).tokenizer
    assert_same_tokenizer(first, reference)
    assert_same_tokenizer(second, reference)


def test_a_changed_tokenizer_file_gets_a_kept_tokenizer_of_its_own(tiny_llama, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    cache = tmp_path / "cache"
    load_checkpoint(str(folder), torch.float32, cache)
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    tokenizer = load_checkpoint(str(folder), torch.float32, cache).tokenizer
    assert len(list((cache / "tokenizers").iterdir())) == 2
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
    # So is a file in a subfolder that AutoTokenizer reads (its additional chat templates).
    extra = folder / "additional_chat_templates" / "tool_use.jinja"
    extra.parent.mkdir()
    for version, entries in (("old", 3), ("new", 4)):
        extra.write_text(version + "{% for m in messages %}{{ m['content'] }}{% endfor %}")
        tokenizer = load_checkpoint(str(folder), torch.float32, cache).tokenizer
        assert len(list((cache / "tokenizers").iterdir())) == entries
        assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="tool_use",
                                             tokenize=False) == version + "hi"
    # Weights are not part of the digest: new weights, the same kept tokenizer.
    save_file({k: v + 1 for k, v in load_file(folder / "model.safetensors").items()}, folder / "model.safetensors")
    load_checkpoint(str(folder), torch.float32, cache)
    assert len(list((cache / "tokenizers").iterdir())) == 4


def test_a_saved_tokenizer_isoserve_did_not_record_goes_through_autotokenizer(tiny_llama, tmp_path, monkeypatch):
    """tokenizer_config.json's class is not always the class saved: transformers 4 saved a
    LlamaTokenizerFast as "LlamaTokenizer", and that class read by name over SmolLM2's ByteLevel
    tokenizer.json gives other ids. Only the class isoserve recorded, under the transformers
    version that saved it, is read by name; anything else goes through AutoTokenizer."""
    reference = AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)
    recorded = tmp_path / "recorded"
    save_tokenizer(reference, recorded)
    as_transformers_4_saved = tmp_path / "unrecorded"
    reference.save_pretrained(as_transformers_4_saved)
    config = json.loads((as_transformers_4_saved / "tokenizer_config.json").read_text())
    (as_transformers_4_saved / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "LlamaTokenizer"}))
    other_version = tmp_path / "other-version"
    shutil.copytree(recorded, other_version)
    saved = json.loads((other_version / SAVED_CLASS_FILE).read_text())
    (other_version / SAVED_CLASS_FILE).write_text(json.dumps({**saved, "transformers": "4.57.1"}))

    calls = []
    real = AutoTokenizer.from_pretrained.__func__
    monkeypatch.setattr(AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, *a, **k: calls.append(a[0]) or real(cls, *a, **k)))
    assert_same_tokenizer(load_saved_tokenizer(recorded), reference)
    assert calls == []
    for folder in (as_transformers_4_saved, other_version):
        assert_same_tokenizer(load_saved_tokenizer(folder), reference)
    assert calls == [as_transformers_4_saved, other_version]


def test_an_unreadable_kept_tokenizer_is_replaced(tiny_llama, tmp_path, caplog):
    load_checkpoint(str(tiny_llama), torch.float32, tmp_path)
    [entry] = (tmp_path / "tokenizers").iterdir()
    (entry / "tokenizer.json").write_text('{"version": "1.0", "trunc')  # a tail lost after the rename
    with caplog.at_level(logging.WARNING, logger="isoserve.model"):
        tokenizer = load_checkpoint(str(tiny_llama), torch.float32, tmp_path).tokenizer
    assert "is unreadable" in caplog.text
    reference = AutoTokenizer.from_pretrained(tiny_llama, local_files_only=True)
    assert_same_tokenizer(tokenizer, reference)
    assert_same_tokenizer(load_checkpoint(str(tiny_llama), torch.float32, tmp_path).tokenizer, reference)


def test_tiny_llama_is_deterministic(tmp_path):
    a = make_tiny_llama(tmp_path / "a", seed=3)
    b = make_tiny_llama(tmp_path / "b", seed=3)
    c = make_tiny_llama(tmp_path / "c", seed=4)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_gguf_round_trip_undoes_llama_cpp_permutation_exactly(tiny_gguf, tiny_llama, cache_dir):
    # llama.cpp's converter permuted Q/K of the tiny model (4 query heads, 2 KV heads); loading
    # must give back exactly the Hugging Face tensors it started from.
    checkpoint = load_checkpoint(str(tiny_gguf), torch.float32, cache_dir)
    reference = load_file(tiny_llama / "model.safetensors")
    assert checkpoint.weights.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(checkpoint.weights[name], tensor), name


def test_broken_cache_entry_is_rebuilt(tiny_gguf, tiny_llama, cache_dir, tmp_path):
    # The entry comes from the session's cache (one conversion, shared with the round trip
    # above: each builds the tokenizer from the GGUF, ~10 s), copied here to be broken.
    load_checkpoint(str(tiny_gguf), torch.float32, cache_dir)
    [source] = [p for p in cache_dir.iterdir() if p.name.startswith(tiny_gguf.stem + "-float32-")]
    entry = tmp_path / source.name
    shutil.copytree(source, entry)
    assert load_checkpoint(str(tiny_gguf), torch.float32, tmp_path).from_cache  # the copy is a valid entry
    # What crashes could leave: a half-written temp folder beside the entry (ignored), and an
    # entry whose file lost its tail after the rename (detected and converted again).
    (tmp_path / f".{entry.name}.crashed").mkdir()
    weights_file = entry / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    rebuilt = load_checkpoint(str(tiny_gguf), torch.float32, tmp_path)
    again = load_checkpoint(str(tiny_gguf), torch.float32, tmp_path)
    assert not rebuilt.from_cache and again.from_cache
    reference = load_file(tiny_llama / "model.safetensors")
    for name, tensor in reference.items():
        assert torch.equal(again.weights[name], tensor), name


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    path = tmp_path / "gemma.gguf"
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gemma3' is not supported"):
        load_checkpoint(str(path), torch.float32, tmp_path / "cache")


def test_unsupported_hf_architecture_is_refused(tiny_llama, tmp_path):
    folder = tmp_path / "gpt2"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_checkpoint(str(folder), torch.float32)


def test_hf_folder_with_an_incomplete_config_or_unreadable_weights_is_refused_by_name(tiny_llama, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rms_norm_eps"}))
    with pytest.raises(ValueError, match=r"config\.json has no 'rms_norm_eps'"):
        load_checkpoint(str(folder), torch.float32)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=r"model\.safetensors is not a readable safetensors file"):
        load_checkpoint(str(folder), torch.float32)


def test_checkpoint_missing_a_tensor_is_refused(tiny_llama, tmp_path):
    folder = tmp_path / "incomplete"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing model.layers.1.mlp.up_proj.weight"):
        load_checkpoint(str(folder), torch.float32)
