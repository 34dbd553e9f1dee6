"""The float32 block kernels (kernels/vector_matmul.cpp, model/vector_blocks.py): a GGUF's Q4_1
and Q8_0 blocks widened to float32 on AVX2, for steps of a few rows where isoserve runs in
float32 (a CPU without a native bfloat16 path). They must multiply by the float32 path's very
weights: the results differ from float32's matmul only by the order of the sums."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isoserve.engine.llm import LLM
from isoserve.engine.sampling_params import SamplingParams
from isoserve.kernels import cpu_ops
from isoserve.model import int4, q8_0
from isoserve.model.llama import LlamaModel
from isoserve.model.loader import load_checkpoint
from isoserve.model.vector_blocks import PANEL, VectorQ4Weight, VectorQ8Weight, q4_1_panel_codes
from tiny_models import HAS_AVX2

needs_avx2 = pytest.mark.skipif(not HAS_AVX2, reason="the float32 block kernels are built for AVX2 and FMA")


def _q4(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.02).half()
    m = (torch.randn(rows, cols // 32, generator=g) * 0.05).half()
    packed = int4._pack(codes.to(torch.uint8))
    dense = int4.dequantize({"w" + int4.CODES: packed, "w" + int4.SCALE: d, "w" + int4.MIN: m}, "w")
    return VectorQ4Weight.from_companions([(packed, d, m)], cpu_ops()), dense


def _q8(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.02).half()
    dense = q8_0.dequantize({"w" + q8_0.CODES: codes, "w" + q8_0.SCALE: d}, "w")
    return VectorQ8Weight.from_companions(codes, d, cpu_ops()), dense


def test_the_kernels_run_exactly_where_the_cpu_has_avx2():
    assert (cpu_ops().vector_status() == "") == HAS_AVX2


def test_q4_1_panel_codes_hold_eight_outputs_side_by_side_two_inputs_a_byte():
    codes = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(0))
    packed = q4_1_panel_codes(codes)
    assert packed.shape == (16 // PANEL, 32, PANEL)
    for n in range(16):
        for k in range(0, 64, 2):
            byte = int(packed[n // PANEL, k // 2, n % PANEL])
            assert (byte & 15, byte >> 4) == (int(codes[n, k]), int(codes[n, k + 1]))


def test_weights_whose_outputs_do_not_fill_panels_keep_the_dense_path():
    packed = int4._pack(torch.zeros(12, 64, dtype=torch.uint8))
    d = torch.ones(12, 2, dtype=torch.float16)
    assert VectorQ4Weight.from_companions([(packed, d, d)], cpu_ops()) is None  # 12 outputs: not 8 per panel
    assert VectorQ8Weight.from_companions(torch.zeros(12, 64, dtype=torch.int8), d, cpu_ops()) is None


@needs_avx2
@pytest.mark.parametrize("make", [_q4, _q8], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("outputs", [96, 40])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 17, 32])
def test_the_kernels_multiply_by_the_float32_weights(make, rows, outputs):
    # Up to 8 rows: one register tile of that size. From 9: pairs of panels widened into a
    # buffer, rows in tiles of up to 6 (9 is 4 + 5, 17 is 5 + 6 + 6); 40 outputs are 5 panels,
    # an odd count, which keeps the register tiles (9 is 4 + 5 again, 17 is 5 + 6 + 6 of those).
    # Against the exact product (float64) the error is float32 summation error: a few ulps of
    # sum |x| |w|.
    weight, dense = make(outputs, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(100 + rows))
    y = weight.matmul(x)
    exact = F.linear(x.double(), dense.double())
    bound = (x.abs().double() @ dense.abs().double().t())
    assert ((y.double() - exact).abs() <= 1e-6 * bound).all()
    assert torch.allclose(y, F.linear(x, dense), rtol=0, atol=1e-5 * bound.max().item())
    # A strided x gives what its contiguous copy gives.
    wide = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(weight.matmul(wide[:, ::2]), weight.matmul(wide[:, ::2].contiguous()))


@needs_avx2
@pytest.mark.parametrize("make", [_q4, _q8], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("outputs", [96, 40])
@pytest.mark.parametrize("rows", [3, 8, 9, 32])
def test_the_kernels_multiply_by_exactly_the_loaders_weights(make, rows, outputs):
    # Each row of an identity block picks one input, so the product is the weights themselves:
    # bit for bit what the loader's float32 dequantization gives, in registers (up to 8 rows),
    # through the buffer (from 9, an even panel count) or register tiles again (an odd one).
    weight, dense = make(outputs, 160, seed=rows + outputs)
    for first in range(0, 160, rows):
        eye = torch.eye(160)[first:first + rows].contiguous()
        assert torch.equal(weight.matmul(eye), dense.t()[first:first + rows])


@needs_avx2
def test_the_kernels_refuse_what_they_cannot_read():
    weight, _ = _q4(32, 64, seed=1)
    ops = cpu_ops()
    with pytest.raises(RuntimeError, match="float32"):
        ops.q4_1_linear_f32(torch.randn(2, 64).to(torch.bfloat16), weight.codes, weight.d, weight.m)
    with pytest.raises(RuntimeError, match="blocks of 32"):
        ops.q4_1_linear_f32(torch.randn(2, 96), weight.codes, weight.d, weight.m)
    with pytest.raises(RuntimeError, match="code bytes"):
        ops.q4_1_linear_f32(torch.randn(2, 64), weight.codes[:2], weight.d, weight.m)
    with pytest.raises(RuntimeError, match="shaped as d"):
        ops.q4_1_linear_f32(torch.randn(2, 64), weight.codes, weight.d, weight.m[:2])


def test_float32_takes_the_block_kernels_for_small_steps_only(tiny_q4_1, tiny_cache):
    ckpt = load_checkpoint(str(tiny_q4_1), torch.float32, tiny_cache)

    def model(rows=None):
        return LlamaModel(ckpt.config, ckpt.weights, torch.float32, int4_max_rows=rows, int8_activations=False)

    default = model()
    assert default.quantized_projections == (2 * 4 if HAS_AVX2 else 0)  # qkv, o, gate_up, down
    assert model(rows=0).quantized_projections == 0
    if HAS_AVX2:
        assert dict(default.quantized_paths) == {"float32 4-bit for steps of <= 512 tokens": 8}
        assert dict(model(rows=4).quantized_paths) == {"float32 4-bit for steps of <= 4 tokens": 8}


def test_float32_with_the_block_kernels_decodes_as_the_dense_weights_do(tiny_q4_1, tiny_cache):
    # The same weights, so the same greedy tokens and logprobs to float32 summation error:
    # one prompt alone and six together (steps of 1 and 6 rows through the kernels), with the
    # block kernels off as the reference.
    prompts = ["The capital of France is", "def f(x):", "Hello", "1, 2, 3,", "Rain", "Once upon a time"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for rows in (None, 0):
        llm = LLM(model=str(tiny_q4_1), dtype="float32", int4_max_rows=rows, int8_activations=False,
                  cache_dir=str(tiny_cache))
        assert (llm.engine.model.quantized_projections > 0) == (rows is None and HAS_AVX2)
        runs[rows] = [llm.generate([prompts[0]], params)[0]] + llm.generate(prompts, params)
    for blocks, dense in zip(runs[None], runs[0]):
        assert blocks.token_ids == dense.token_ids
        for a, b in zip(blocks.logprobs, dense.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-4
