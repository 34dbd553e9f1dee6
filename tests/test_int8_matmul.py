"""The int8 block kernels (kernels/int8_matmul.cpp, model/int8_blocks.py): a GGUF's Q4_1 and
Q8_0 blocks times the step's activations quantized to int8 by blocks of 32, llama.cpp's
arithmetic for these files on AVX2 and AVX512-VNNI, where isoserve runs in float32. They must compute exactly
that arithmetic (model/int8_blocks.reference), give each row a result that does not depend on
the step's other rows, and refuse what they cannot read."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from isoserve.engine.llm import LLM
from isoserve.engine.sampling_params import SamplingParams
from isoserve.config import AutoInputs, native_bfloat16, parse_dtype, parse_kv_dtype
from isoserve.kernels import cpu_ops
from isoserve.model import int4, q8_0
from isoserve.model.int8_blocks import (Int8Q4SwigluWeight, Int8Q4Weight, Int8Q8Weight, interleave_pairs,
                                        q4_1_group_codes, q8_0_group_codes, quantize_activations, reference)
from isoserve.model.llama import LlamaModel
from isoserve.model.loader import has_q4_1_blocks, load_checkpoint
from isoserve.model.projection import Projection
from isoserve.model.quantized import EVERY_STEP
from isoserve.model.vector_blocks import PANEL
from tiny_models import HAS_AMX, HAS_AVX2, HAS_AVX512_VNNI, NEEDS_AVX2 as needs_avx2


def _q4_blocks(rows: int, cols: int, g: torch.Generator):
    """Random Q4_1 blocks as the loader keeps them: ((packed codes, d, m), codes, dense float32 weight)."""
    codes = torch.randint(0, 16, (rows, cols), generator=g)
    d = (torch.rand(rows, cols // 32, generator=g) * 0.02).half()
    m = (torch.randn(rows, cols // 32, generator=g) * 0.05).half()
    packed = int4._pack(codes.to(torch.uint8))
    dense = int4.dequantize({"w" + int4.CODES: packed, "w" + int4.SCALE: d, "w" + int4.MIN: m}, "w")
    return (packed, d, m), codes, dense


def _q4(rows: int, cols: int, seed: int):
    """(kernel weight, codes, d, m, dense float32 weight)"""
    (packed, d, m), codes, dense = _q4_blocks(rows, cols, torch.Generator().manual_seed(seed))
    return Int8Q4Weight.from_companions([(packed, d, m)], cpu_ops()), codes, d.float(), m.float(), dense


def _q8(rows: int, cols: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    codes[0, :32] = -128  # the one code whose magnitude is not an int8
    d = (torch.rand(rows, cols // 32, generator=g) * 0.02).half()
    dense = q8_0.dequantize({"w" + q8_0.CODES: codes, "w" + q8_0.SCALE: d}, "w")
    return Int8Q8Weight.from_companions(codes, d, cpu_ops()), codes, d.float(), None, dense


def test_the_kernels_run_exactly_where_the_cpu_has_avx2():
    assert (cpu_ops().int8_status() == "") == HAS_AVX2


def test_the_kernels_take_the_avx512_vnni_tiles_exactly_where_the_cpu_has_them():
    assert cpu_ops().int8_isa() == ("avx512-vnni" if HAS_AVX512_VNNI else "avx2" if HAS_AVX2 else "")


def test_q4_1_group_codes_put_four_inputs_of_eight_outputs_in_each_32_bytes():
    codes = torch.randint(0, 16, (16, 64), generator=torch.Generator().manual_seed(0))
    packed = q4_1_group_codes(codes)
    assert packed.shape == (2, 2, 4, 32)
    for n in range(16):
        for k in range(64):
            block, j = divmod(k, 32)
            chunk, i = divmod(j % 16, 4)
            byte = int(packed[n // PANEL, block, chunk, (n % PANEL) * 4 + i])
            assert (byte >> 4 if j >= 16 else byte & 15) == int(codes[n, k])


def test_q8_0_group_codes_put_four_inputs_of_eight_outputs_in_each_32_bytes():
    codes = torch.randint(-128, 128, (16, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int8)
    packed = q8_0_group_codes(codes).view(torch.int8)
    assert packed.shape == (2, 2, 8, 32)
    for n in range(16):
        for k in range(64):
            block, j = divmod(k, 32)
            assert packed[n // PANEL, block, j // 4, (n % PANEL) * 4 + j % 4] == codes[n, k]


def test_pairs_of_panels_are_interleaved_chunk_by_chunk_and_an_odd_last_panel_follows_them():
    # What the kernels read (int8_matmul.cpp's layout): H panels from panel p at p's offset, and
    # in them block b's chunk c of panel h at (b * H * chunks + c * H + h) * 32 bytes.
    codes = torch.randint(0, 16, (24, 64), generator=torch.Generator().manual_seed(0))  # 3 panels, 2 blocks
    apart, paired = q4_1_group_codes(codes), interleave_pairs(q4_1_group_codes(codes))
    assert paired.shape == apart.shape and paired.is_contiguous()
    flat = paired.flatten()
    for p, h_count in ((0, 2), (2, 1)):
        base = p * apart[0].numel()
        for h in range(h_count):
            for b in range(2):
                for c in range(4):
                    at = base + (b * h_count * 4 + c * h_count + h) * 32
                    assert torch.equal(flat[at:at + 32], apart[p + h, b, c])
    d = torch.arange(3 * 2 * 8).reshape(3, 2, 8)
    assert interleave_pairs(d).flatten().tolist()[:32] == [*range(0, 8), *range(16, 24), *range(8, 16), *range(24, 32)]
    assert torch.equal(interleave_pairs(d)[2], d[2])


def test_activations_are_quantized_by_blocks_of_32_to_their_largest_magnitude():
    x = torch.tensor([[0.5] * 16 + [-1.0] + [0.25] * 15 + [0.0] * 32])
    q, scale = quantize_activations(x)
    assert scale[0, 0] == pytest.approx(1 / 127) and scale[0, 1] == 0
    assert q[0, 0, 16] == -127 and q[0, 0, 0] == 64 and q[0, 0, 17] == 32  # 63.5 -> 64 (half to even), 31.75 -> 32
    assert (q[0, 1] == 0).all()


TILE_ROWS = 8 if HAS_AVX512_VNNI else 4  # the most rows of a tile: AVX-512's, or AVX2's


def _blocks_of_many_magnitudes(rows: int, k: int, seed: int) -> torch.Tensor:
    """x [rows, k]: each block of 32 at its own magnitude (1e-30 to 1e36), some blocks all zeros,
    some inputs -0.0, and a first block whose inputs fall exactly half a step apart (half to even)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k // 32, 32, generator=g)
    x = x * 10.0 ** torch.randint(-30, 37, (rows, k // 32, 1), generator=g).float()
    x[torch.rand(rows, k // 32, generator=g) < 0.1] = 0.0
    x[torch.rand(rows, k // 32, 32, generator=g) < 0.02] = -0.0
    x[:, 0, :] = torch.tensor([1.0] + [0.5 / 127 * (2 * i + 1) for i in range(31)])  # q = i + 0.5
    return x.reshape(rows, k)


def _quantize_like_the_kernels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """quantize_activations, plus the kernels' NaN rule and each block's sum a * sum(q). The rule:
    a block's scale is NaN where the float32 sum of its inputs is, summed in the kernels' order:
    (v0 + v1) + (v2 + v3) for its four vectors of 8, then lanes j + (j + 4), then 0 + 2 and
    1 + 3, then those two. For huge finite inputs that order decides whether the sum overflows
    to both infinities (NaN) or cancels."""
    q, scale = quantize_activations(x)
    v = x.float().reshape(x.shape[0], -1, 4, 8)
    lanes = (v[..., 0, :] + v[..., 1, :]) + (v[..., 2, :] + v[..., 3, :])
    half = lanes[..., :4] + lanes[..., 4:]
    pair = half[..., :2] + half[..., 2:]
    total = pair[..., 0] + pair[..., 1]
    scale = torch.where(total.isnan(), total, scale)
    return q, scale, scale * q.sum(-1)


@needs_avx2
@pytest.mark.parametrize("flipped", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 8, 13, 32])
@pytest.mark.parametrize("k", [32, 544, 1536])
def test_activations_are_quantized_to_the_bit_of_the_arithmetic(rows, k, flipped):
    # In every tile size, each row's blocks on their own: codes, scale and sum exactly as
    # quantize_activations computes them in float32 (a rewrite of the kernels' quantizing, such
    # as session 35's AVX-512 one in docs/benchmarks.md, must keep these bits).
    x = _blocks_of_many_magnitudes(rows, k, seed=rows * k)
    q, scale, total = _quantize_like_the_kernels(x)
    for tile_rows in range(1, TILE_ROWS + 1):
        codes, got_scale, got_sum = cpu_ops().quantize_rows_i8(x, tile_rows, flipped)
        assert torch.equal(codes, q.reshape(rows, k).to(torch.int8))
        assert torch.equal(got_scale, scale) and torch.equal(got_sum, total)


@needs_avx2
@pytest.mark.parametrize("flipped", [False, True])
def test_a_blocks_scale_is_nan_exactly_where_its_sum_is(flipped):
    # A NaN input, +inf with -inf, or huge finite inputs whose sum overflows to both infinities in
    # the kernels' order make the block's scale NaN (and its row's outputs NaN); huge inputs that
    # cancel in that order, or overflow to one infinity, quantize as any others. Other blocks
    # keep their bits.
    huge = 3e38
    x = _blocks_of_many_magnitudes(8, 8 * 32, seed=11)
    x[1, 32 + 5] = float("nan")
    x[2, 64 + 3], x[2, 64 + 30] = float("inf"), float("-inf")
    x[3, 96:128] = torch.tensor([huge] * 16 + [-huge] * 16)      # (v0 + v1) + (v2 + v3) = inf + -inf
    x[4, 128:160] = torch.tensor(([huge] * 8 + [-huge] * 8) * 2)  # v0 + v1 = 0: a sum of 0
    x[5, 160:192] = torch.tensor([2.0**121, -(2.0**121)] * 16)    # large, summing to 0
    x[6, 192:224] = torch.tensor([2.0**121] * 32)                 # a finite sum of 2^126
    x[7, 224:256] = torch.tensor([huge] * 8 + [-huge] * 24)       # 0 + -inf: one infinity, not NaN
    q, scale, total = _quantize_like_the_kernels(x)
    assert all(scale[r, r].isnan() for r in (1, 2, 3))
    assert not any(scale[r, r].isnan() for r in (4, 5, 6, 7))
    for tile_rows in range(1, TILE_ROWS + 1):
        codes, got_scale, got_sum = cpu_ops().quantize_rows_i8(x, tile_rows, flipped)
        assert torch.equal(got_scale.isnan(), scale.isnan()) and torch.equal(got_sum.isnan(), total.isnan())
        finite = ~scale.isnan() & ~scale.isinf()
        assert torch.equal(got_scale[finite], scale[finite]) and torch.equal(got_sum[finite], total[finite])
        blocks = finite.repeat_interleave(32, dim=1)
        assert torch.equal(codes[blocks], q.reshape(8, -1)[blocks].to(torch.int8))


@needs_avx2
def test_quantize_rows_i8_refuses_what_it_cannot_take():
    ops = cpu_ops()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quantize_rows_i8(torch.randn(2, 48), 4, False)
    with pytest.raises(RuntimeError, match="tiles of 1 to"):
        ops.quantize_rows_i8(torch.randn(2, 64), TILE_ROWS + 1, False)
    codes, scale, total = ops.quantize_rows_i8(torch.randn(0, 64), 4, False)
    assert codes.shape == (0, 64) and scale.shape == total.shape == (0, 2)


def test_weights_whose_outputs_do_not_fill_panels_keep_the_dense_path():
    packed = int4._pack(torch.zeros(12, 64, dtype=torch.uint8))
    d = torch.ones(12, 2, dtype=torch.float16)
    assert Int8Q4Weight.from_companions([(packed, d, d)], cpu_ops()) is None
    assert Int8Q8Weight.from_companions(torch.zeros(12, 64, dtype=torch.int8), d, cpu_ops()) is None


@needs_avx2
@pytest.mark.parametrize("make", [_q4, _q8], ids=["q4_1", "q8_0"])
@pytest.mark.parametrize("outputs", [96, 40])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 12, 17, 32, 33, 64])
def test_the_kernels_compute_llama_cpps_arithmetic(make, rows, outputs):
    # Rows in tiles of up to 4 on AVX2, 8 on AVX512-VNNI (9 is 3 + 3 + 3 or one of 4 and one of
    # 5, 17 is 4 + 4 + 4 + 5 or 5 + 6 + 6... of equal size), one tile reading the weights in
    # place, several a gathered copy; 40 outputs are 5 panels, so the last one goes alone (by
    # AVX2's tiles on both). Against the same arithmetic in float64 the error is float32's sum
    # over the blocks: a few ulps of the sum of |terms|.
    weight, codes, d, m, dense = make(outputs, 160, seed=rows)
    x = torch.randn(rows, 160, generator=torch.Generator().manual_seed(100 + rows))
    x[0, :32] = 0  # a block of zeros has scale 0
    y = weight.matmul(x)
    assert y.shape == (rows, outputs) and y.dtype == torch.float32
    q, scale = quantize_activations(x)
    terms = (x.abs().double() @ dense.abs().double().t()) + 1e-3
    assert ((y.double() - reference(x, codes, d, m)).abs() <= 1e-6 * terms).all()
    # And close to the float32 product: int8 activations round each input by at most half a
    # step of its block's scale.
    step = (scale.repeat_interleave(32, dim=1) / 2).double()
    assert ((y.double() - F.linear(x.double(), dense.double())).abs() <= step @ dense.abs().double().t() + 1e-5).all()
    wide = torch.randn(rows, 320, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(weight.matmul(wide[:, ::2]), weight.matmul(wide[:, ::2].contiguous()))


@needs_avx2
@pytest.mark.parametrize("make", [_q4, _q8], ids=["q4_1", "q8_0"])
def test_a_rows_result_does_not_depend_on_the_other_rows_of_its_step(make):
    # Bit for bit: the same row alone, among 4, 9 or 33 rows, first or last of its tile, and
    # with every thread count: no sequence's logits depend on what it was batched with.
    weight, *_ = make(96, 160, seed=3)
    g = torch.Generator().manual_seed(7)
    row = torch.randn(1, 160, generator=g)
    alone = weight.matmul(row)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for rows in (4, 9, 33):
                for at in (0, rows - 1):
                    batch = torch.randn(rows, 160, generator=g)
                    batch[at] = row[0]
                    assert torch.equal(weight.matmul(batch)[at], alone[0])
    finally:
        torch.set_num_threads(threads)


@needs_avx2
@pytest.mark.parametrize("make", [_q4, _q8], ids=["q4_1", "q8_0"])
def test_a_nan_input_makes_its_row_nan_and_no_other(make):
    # As float32's matmul would: a model whose activations blew up must not sample from
    # outputs that look finite, and other rows of the step must not notice.
    weight, *_ = make(96, 160, seed=5)
    x = torch.randn(6, 160, generator=torch.Generator().manual_seed(5))
    clean = weight.matmul(x)
    x[2, 40] = float("nan")
    y = weight.matmul(x)
    assert y[2].isnan().all()
    assert torch.equal(torch.cat([y[:2], y[3:]]), torch.cat([clean[:2], clean[3:]]))


@needs_avx2
def test_the_kernels_refuse_what_they_cannot_read():
    weight, *_ = _q4(32, 64, seed=1)
    ops = cpu_ops()
    with pytest.raises(RuntimeError, match="float32"):
        ops.q4_1_linear_i8(torch.randn(2, 64).to(torch.bfloat16), weight.codes, weight.d, weight.m)
    with pytest.raises(RuntimeError, match="blocks of 32"):
        ops.q4_1_linear_i8(torch.randn(2, 96), weight.codes, weight.d, weight.m)
    with pytest.raises(RuntimeError, match="code bytes"):
        ops.q4_1_linear_i8(torch.randn(2, 64), weight.codes[:2], weight.d, weight.m)
    with pytest.raises(RuntimeError, match="shaped as d"):
        ops.q4_1_linear_i8(torch.randn(2, 64), weight.codes, weight.d, weight.m[:2])
    assert ops.q4_1_linear_i8(torch.randn(0, 64), weight.codes, weight.d, weight.m).shape == (0, 32)


def _gate_up_parts(outputs: int, cols: int, seed: int):
    """The Q4_1 (packed codes, d, m) of a gate and an up projection, and their dense [gate; up]."""
    g = torch.Generator().manual_seed(seed)
    gate, up = (_q4_blocks(outputs, cols, g) for _ in range(2))
    return [gate[0], up[0]], torch.cat([gate[2], up[2]])


@needs_avx2
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 32, 37])
def test_the_gate_up_kernel_gives_silu_mul_of_the_projection_bit_for_bit(rows):
    # One call, silu(x G^T) * (x U^T) from the kernel's two accumulators: exactly what the
    # projection then silu_mul compute, for a step of one tile (registers) and of several (buffer).
    ops = cpu_ops()
    parts, dense = _gate_up_parts(48, 96, seed=rows)
    fused, plain = Int8Q4SwigluWeight.from_companions(parts, ops), Int8Q4Weight.from_companions(parts, ops)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(100 + rows)) * 3
    expected = ops.silu_mul(plain.matmul(x))
    assert expected.shape == (rows, 48)
    assert torch.equal(fused.swiglu(x), expected)
    # Through a Projection: swiglu takes the kernel; a plain call multiplies by the dense weight.
    projection = Projection(dense, None, [(EVERY_STEP, fused)])
    assert torch.equal(projection.swiglu(x, ops.silu_mul), expected)
    torch.testing.assert_close(projection(x), F.linear(x, dense), rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="not x W"):
        fused.matmul(x)


@needs_avx2
def test_the_gate_up_kernel_takes_only_pairs_of_gate_and_up_panels():
    ops = cpu_ops()
    parts, _ = _gate_up_parts(12, 64, seed=1)  # 24 outputs: whole panels, but 12 a half
    assert Int8Q4SwigluWeight.from_companions(parts, ops) is None
    assert Int8Q4Weight.from_companions(parts, ops) is not None  # the plain kernel and silu_mul instead
    assert Int8Q4SwigluWeight.from_companions(parts[:1], ops) is None  # not a gate and an up
    three_panels = Int8Q4Weight.from_companions(parts, ops)
    with pytest.raises(RuntimeError, match="pairs of gate and up panels"):
        ops.q4_1_swiglu_i8(torch.randn(2, 64), three_panels.codes, three_panels.d, three_panels.m)


def test_float32_takes_the_int8_kernels_for_every_step_unless_told_not_to(tiny_q4_1, tiny_cache):
    ckpt = load_checkpoint(str(tiny_q4_1), torch.float32, tiny_cache)

    def model(**options):
        return LlamaModel(ckpt.config, ckpt.weights, torch.float32, **options)

    if HAS_AVX2:
        assert dict(model().quantized_paths) == {"int8 x 4-bit for every step": 6,  # qkv, o, down
                                                 "int8 x 4-bit with SwiGLU for every step": 2}  # gate_up
        assert dict(model(int8_activations=True, int4_max_rows=64).quantized_paths) == {
            "int8 x 4-bit for steps of <= 64 tokens": 6, "int8 x 4-bit with SwiGLU for steps of <= 64 tokens": 2}
        assert dict(model(int8_activations=False).quantized_paths) == {"float32 4-bit for steps of <= 512 tokens": 8}
    else:
        with pytest.raises(ValueError, match="int8 activations cannot run here"):
            model(int8_activations=True)
    with pytest.raises(ValueError, match="int8 activations cannot run here: they are for float32 runs"):
        LlamaModel(ckpt.config, load_checkpoint(str(tiny_q4_1), torch.bfloat16, tiny_cache).weights,
                   torch.bfloat16, int8_activations=True)
    with pytest.raises(ValueError, match="quantized forms are off"):
        model(int8_activations=True, int4_max_rows=0)


PROMPTS = ["The capital of France is", "def f(x):", "Hello", "1, 2, 3,", "Rain", "Once upon a time"]


@needs_avx2
def test_a_sequence_decodes_the_same_alone_and_batched_with_int8_activations(tiny_q4_1, tiny_cache):
    # Bit for bit, tokens and logprobs: each row's matmuls depend on that row alone, so what a
    # sequence generates cannot depend on the other tenants' sequences in its steps.
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    llm = LLM(model=str(tiny_q4_1), dtype="float32", int8_activations=True, cache_dir=str(tiny_cache))
    together = llm.generate(PROMPTS, params)
    for prompt, batched in zip(PROMPTS, together):
        alone = llm.generate([prompt], params)[0]
        assert alone.token_ids == batched.token_ids
        assert [(a.token_id, a.logprob, a.top) for a in alone.logprobs] == \
               [(b.token_id, b.logprob, b.top) for b in batched.logprobs]


@needs_avx2
def test_int8_activations_stay_close_to_float32(tiny_q4_1, tiny_cache):
    # The first token's distribution of each prompt, with int8 activations and with float32
    # ones: the rounding of each matmul input by at most half its block's step moves a logprob
    # by a few hundredths on this unit-scale random model.
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    runs = {}
    for int8 in (True, False):
        llm = LLM(model=str(tiny_q4_1), dtype="float32", int8_activations=int8, cache_dir=str(tiny_cache))
        runs[int8] = llm.generate(PROMPTS, params)
    for a, b in zip(runs[True], runs[False]):
        int8, float32 = dict(a.logprobs[0].top), dict(b.logprobs[0].top)
        assert a.token_ids == b.token_ids  # the most likely token: 0.05 or more ahead on these prompts
        assert all(abs(int8[t] - float32[t]) < 0.1 for t in int8.keys() & float32.keys())
        assert len(int8.keys() & float32.keys()) >= 4


def test_dtype_auto_runs_a_q4_1_gguf_in_float32_where_the_avx512_vnni_tiles_beat_bfloat16(
        tiny_q4_1, tiny_llama_dir, tiny_cache, tmp_path):
    # On a CPU with native bfloat16, no AMX and the int8 kernels' AVX512-VNNI tiles (a Zen 4),
    # a GGUF of Q4_1 projections runs in float32 with int8 activations and a bfloat16 KV cache;
    # a checkpoint without those blocks, or a run that may not take the int8 kernels, keeps
    # bfloat16; a CPU without native bfloat16 runs float32 as always.
    native = native_bfloat16()
    preferred = native and HAS_AVX512_VNNI and not HAS_AMX
    assert has_q4_1_blocks(str(tiny_q4_1), tiny_cache) and not has_q4_1_blocks(str(tiny_llama_dir))
    assert has_q4_1_blocks(str(tiny_q4_1), tmp_path)  # no converted weights there: from the GGUF's header
    gguf = AutoInputs(str(tiny_q4_1), str(tiny_cache))
    expected = torch.float32 if preferred or not native else torch.bfloat16
    assert parse_dtype("auto", auto=gguf) == expected
    assert parse_kv_dtype("auto", "auto", auto=gguf) == torch.bfloat16  # float32 computes, bfloat16 KV
    plain = torch.bfloat16 if native else torch.float32
    assert parse_dtype("auto", auto=AutoInputs(str(tiny_llama_dir))) == plain
    assert parse_dtype("auto", auto=AutoInputs(str(tiny_q4_1), str(tiny_cache), int8_activations=False)) == plain
    assert parse_dtype("auto") == plain  # no model: the device's own choice, as the benchmarks' peers run
    assert parse_dtype("auto", auto=AutoInputs("no-such-model")) == plain  # loading it says what is wrong
    llm = LLM(model=str(tiny_q4_1), cache_dir=str(tiny_cache), max_num_seqs=4)
    assert llm.engine.model.dtype == expected and llm.engine.pool.kv.dtype == torch.bfloat16
