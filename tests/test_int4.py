"""The 4-bit path for decode steps: a GGUF's Q4_1 blocks multiplied by torch's int4 kernel and,
where the CPU has AMX, by isoserve's AMX kernel (its own tests: test_amx_matmul.py).

Real files throughout: a tiny random Llama written as a Q4_1 GGUF (as llama.cpp's converter
would quantize it) and the packaged SmolLM2 GGUF.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isoserve.config import native_bfloat16
from isoserve.engine.llm import LLM
from isoserve.kernels import cpu_ops
from isoserve.engine.sampling_params import SamplingParams
from isoserve.model import int4
from isoserve.model.quantized import q4_tiers
from isoserve.model.llama import LlamaModel
from isoserve.model.projection import Projection
from isoserve.model.loader import load_checkpoint
from tiny_models import HAS_AMX, HAS_AVX2

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def test_every_q4_1_projection_gets_companions_that_give_its_weights(tiny_q4_1, tiny_cache):
    # In float32 the dequantized weight is exact, so the companions must reproduce it bit for bit,
    # Q and K rows (4 query heads, 2 KV heads, permuted by the converter) included.
    weights = load_checkpoint(str(tiny_q4_1), torch.float32, tiny_cache).weights
    for layer in range(2):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.{proj}.weight"
            assert torch.equal(int4.dequantize(weights, name), weights[name]), name
    assert not int4.has_companions(weights, "model.embed_tokens.weight")  # F32 in this file


def test_int4_matmul_is_as_close_to_the_exact_product_as_bfloat16(tiny_checkpoint):
    weights = tiny_checkpoint.weights
    name = "model.layers.1.mlp.down_proj.weight"
    packed = int4.Int4Weight.from_companions([tuple(weights[name + s] for s in int4.COMPANIONS)], torch.bfloat16)
    x = torch.randn(6, weights[name].shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    exact = x.float() @ int4.dequantize(weights, name).t()
    err_int4 = (packed.matmul(x).float() - exact).abs().max()
    err_bf16 = (F.linear(x, weights[name]).float() - exact).abs().max()
    # Both round to bfloat16 (the output; int4 also its scale and zero): the same order of error.
    assert err_int4 <= 4 * err_bf16 + 1e-3, (err_int4, err_bf16)
    assert err_int4 < 0.02 * exact.abs().max()


def _gate_up(weights):
    names = [f"model.layers.0.mlp.{p}.weight" for p in ("gate_proj", "up_proj")]  # merged, like the model
    return [tuple(weights[n + s] for s in int4.COMPANIONS) for n in names], torch.cat([weights[n] for n in names])


def test_projection_takes_the_first_tier_within_its_rows_and_packed_bfloat16_above(tiny_checkpoint):
    parts, full = _gate_up(tiny_checkpoint.weights)
    packed = int4.Int4Weight.from_companions(parts, torch.bfloat16)
    proj = Projection(full, None, [(4, packed)])
    # oneDNN's blocked copy of the weight, where oneDNN has a bfloat16 path; else torch's matmul
    assert (proj.packed is not None) == native_bfloat16()
    x = torch.randn(5, full.shape[1]).to(torch.bfloat16)
    assert torch.equal(proj(x[:4]), packed.matmul(x[:4]))
    reference = F.linear(x, full)
    torch.testing.assert_close(proj(x), reference, rtol=1e-2, atol=1e-2 * reference.abs().max().item())
    off = Projection(full, None, [(0, packed)])
    assert off.tiers == []
    torch.testing.assert_close(off(x[:1]), reference[:1], rtol=1e-2, atol=1e-2 * reference.abs().max().item())
    # Tiers apply in order of their row limits, whatever order they come in.
    other = int4.Int4Weight.from_companions(parts, torch.bfloat16)
    two = Projection(full, None, [(4, other), (1, packed)])
    assert [rows for rows, _ in two.tiers] == [1, 4]
    assert torch.equal(two(x[:1]), packed.matmul(x[:1])) and torch.equal(two(x[:3]), other.matmul(x[:3]))


def test_four_bit_tiers_follow_the_cpu(tiny_checkpoint):
    # With AMX: torch's int4 kernel for one or two rows, then AMX up to 32; elsewhere torch's up
    # to 4. An explicit limit moves the top tier's, and 0 turns 4-bit off.
    parts, _ = _gate_up(tiny_checkpoint.weights)
    kernels = cpu_ops()

    def kinds(**options):
        return [(rows, type(q4).__name__) for rows, q4 in q4_tiers(parts, torch.bfloat16, kernels, **options)]

    if HAS_AMX:
        assert kinds() == [(2, "Int4Weight"), (32, "AmxQ4Weight")]
        assert kinds(max_rows=8) == [(2, "Int4Weight"), (8, "AmxQ4Weight")]
        assert kinds(max_rows=1) == [(1, "Int4Weight")]
    else:
        assert kinds() == [(4, "Int4Weight")]
        assert kinds(max_rows=8) == [(8, "Int4Weight")]
    assert kinds(max_rows=0) == []
    # float32: the int8 block kernels for every step (tests/test_int8_matmul.py), with int8
    # activations off the float32 block kernels up to 512 (tests/test_vector_matmul.py), and
    # none without the fused kernels.
    f32 = [(r, type(q).__name__) for r, q in q4_tiers(parts, torch.float32, kernels)]
    assert f32 == ([(2**62, "Int8Q4Weight")] if HAS_AVX2 else [])
    f32 = [(r, type(q).__name__) for r, q in q4_tiers(parts, torch.float32, kernels, int8_activations=False)]
    assert f32 == ([(512, "VectorQ4Weight")] if HAS_AVX2 else [])
    assert q4_tiers(parts, torch.float32, None) == []
    # Without the fused kernels there is no AMX kernel: torch's int4 kernel alone.
    assert [(r, type(q).__name__) for r, q in q4_tiers(parts, torch.bfloat16, None)] == [(4, "Int4Weight")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_packed_projection_matches_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=g).to(dtype), torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    proj = Projection(weight, bias)
    prepacked = dtype == torch.float32 or native_bfloat16()  # else oneDNN refuses it: F.linear
    assert (proj.packed is not None) == prepacked and (proj.weight is None) == prepacked
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(proj(x), F.linear(x, weight, bias), rtol=tol, atol=tol * 8)


def test_model_takes_the_int4_path_only_in_bfloat16_on_cpu_with_companions(tiny_checkpoint, tiny_q4_1,
                                                                           tiny_llama_dir, tiny_cache):
    def model(ckpt, dtype, rows=None):
        return LlamaModel(ckpt.config, ckpt.weights, dtype, int4_max_rows=rows)

    assert model(tiny_checkpoint, torch.bfloat16).quantized_projections == 2 * 4  # qkv, o, gate_up, down
    # (the tiny file's LM head is F32: no Q8_0 blocks to multiply by)
    assert model(tiny_checkpoint, torch.bfloat16, rows=0).quantized_projections == 0
    f32 = load_checkpoint(str(tiny_q4_1), torch.float32, tiny_cache)
    # (float32 has its own block kernels on AVX2: tests/test_vector_matmul.py)
    assert model(f32, torch.float32).quantized_projections == (2 * 4 if HAS_AVX2 else 0)
    hf = load_checkpoint(str(tiny_llama_dir), torch.bfloat16)  # safetensors: nothing to take blocks from
    assert model(hf, torch.bfloat16).quantized_projections == 0


def _agreement(run, reference) -> tuple[int, float]:
    """Greedy tokens `run` shares with `reference` from the start, and the largest chosen-token
    logprob difference over them."""
    same, worst = 0, 0.0
    for a, b in zip(run.logprobs, reference.logprobs):
        if a.token_id != b.token_id:
            break
        same, worst = same + 1, max(worst, abs(a.logprob - b.logprob))
    return same, worst


def test_default_model_with_int4_is_as_faithful_as_bfloat16(isoserve_cache):
    # The 4-bit path multiplies by the file's own weights; the bfloat16 path rounds every
    # weight. Against the exact weights (float32), 4-bit must be no less faithful than bfloat16:
    # as many greedy tokens in common, and logprob errors of the same size (both ~0.1 nat at
    # worst on this model). Each prompt alone (one row: torch's int4 kernel) and the four
    # together (four rows: the AMX kernel where the CPU has it, else torch's int4 kernel).
    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about rain.",
               "List three prime numbers:"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = {}
    for name, options in {"float32": {"dtype": "float32", "int4_max_rows": 0},
                          "int4": {"dtype": "bfloat16"},
                          "bfloat16": {"dtype": "bfloat16", "int4_max_rows": 0}}.items():
        llm = LLM(cache_dir=str(isoserve_cache), **options)
        assert (llm.engine.model.quantized_projections > 0) == (name == "int4")
        runs[name] = [llm.generate([p], params)[0] for p in prompts]
        if name == "int4":  # the references run alone; only the 4-bit path changes with the batch
            runs[name + " together"] = llm.generate(prompts, params)
    bf16 = [_agreement(r, ref) for r, ref in zip(runs["bfloat16"], runs["float32"])]
    for run in ("int4", "int4 together"):
        int4_agreement = [_agreement(r, ref) for r, ref in zip(runs[run], runs["float32"])]
        assert sum(s for s, _ in int4_agreement) >= sum(s for s, _ in bf16) - params.max_tokens // 2, \
            (run, int4_agreement, bf16)
        assert max(w for _, w in int4_agreement) <= 1.5 * max(w for _, w in bf16) + 0.05, (run, int4_agreement, bf16)
