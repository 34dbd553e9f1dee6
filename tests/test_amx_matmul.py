"""isoserve's AMX matmuls over a GGUF's Q4_1 and Q8_0 blocks (kernels/amx_matmul.cpp,
model/amx.py).

They must give the very bfloat16 weights the bfloat16 path multiplies by (so one-hot rows read
them back bit for bit), products as close to exact as a bfloat16 matmul, the same result on any
number of threads, and refuse inputs they cannot take. They run only where the CPU has AMX; on
other machines these tests check that the kernels say so and refuse every call, and that the
model then takes torch's int4 kernel and the bfloat16 LM head (test_int4.py, below).
"""
from __future__ import annotations

import pytest
import torch

from isoserve.engine.llm import LLM
from isoserve.kernels import cpu_ops
from isoserve.model import amx, int4, q8_0
from isoserve.model.loader import load_checkpoint
from isoserve.model.projection import Projection
from tiny_models import HAS_AMX

BF16_ULP = 2.0 ** -7
FORMATS = ["q4_1", "q8_0"]


def _random_blocks(fmt: str, rows: int, cols: int, seed: int):
    """(AMX weight, the bfloat16 weight the bfloat16 path makes of the same blocks, raw parts).

    Codes, d and m as a file holds them (d, m float16); the bfloat16 weight is float32 d * q (+ m),
    gguf-py's dequantizer, rounded to bfloat16 as the loader rounds it."""
    g = torch.Generator().manual_seed(seed)
    d = (torch.randn(rows, cols // 32, generator=g) * 0.05).half()
    d[0, 0], d[1, 0] = 6.0e-8, -1000.0  # a float16 subnormal scale and a negative one
    spread = lambda x: x.float().repeat_interleave(32, 1)  # noqa: E731
    if fmt == "q4_1":
        codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
        m = (torch.randn(rows, cols // 32, generator=g) * 0.2).half()
        m[0, 0] = -65504.0  # the most negative float16
        weight = spread(d) * codes.float() + spread(m)
        return amx.AmxQ4Weight.from_companions([(int4._pack(codes), d, m)], cpu_ops()), weight.to(torch.bfloat16), (codes, d, m)
    codes = torch.randint(-128, 128, (rows, cols), generator=g, dtype=torch.int8)
    codes[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    weight = spread(d) * codes.float()
    return amx.AmxQ8Weight.from_companions(codes, d, cpu_ops()), weight.to(torch.bfloat16), (codes, d)


def _run_or_refusal(call):
    """The call's result where the CPU has AMX; elsewhere, checks that it is refused."""
    if HAS_AMX:
        return call()
    with pytest.raises(RuntimeError, match="needs AMX"):
        call()
    return None


def test_amx_is_available_exactly_where_the_cpu_has_it():
    status = cpu_ops().amx_status()
    assert (status == "") == HAS_AMX, status
    assert (amx.amx_unavailable(cpu_ops()) == "") == HAS_AMX
    assert amx.amx_unavailable(None) != ""  # no kernels, no AMX path


@pytest.mark.parametrize("fmt", FORMATS)
def test_blocks_follow_the_documented_layout(fmt):
    # Decode the blocks by the layout model/amx.py documents and get the inputs back.
    rows, cols = 64, 96
    weight, _, parts = _random_blocks(fmt, rows, cols, seed=1)
    codes, d = parts[0], parts[1]
    size = amx.Q4_1_BLOCK_BYTES if fmt == "q4_1" else amx.Q8_0_BLOCK_BYTES
    assert weight.blocks.dtype == torch.uint8 and weight.blocks.numel() == rows // 16 * cols // 32 * size
    k_blocks = cols // 32
    b = weight.blocks.view(rows // 32, k_blocks, 2, size)
    for pair in range(rows // 32):
        for kb in range(k_blocks):
            for which in range(2):
                block, first = b[pair, kb, which], 32 * pair + 16 * which
                scales = 256 if fmt == "q4_1" else 512
                assert torch.equal(block[scales:scales + 32].view(torch.float16), d[first:first + 16, kb])
                if fmt == "q4_1":
                    assert torch.equal(block[288:320].view(torch.float16), parts[2][first:first + 16, kb])
                for line in range(16):
                    for i in range(16):
                        k = 32 * kb + 2 * line + i % 2
                        low, high = codes[first + i // 2, k], codes[first + 8 + i // 2, k]
                        if fmt == "q4_1":
                            byte = int(block[16 * line + i])
                            assert (byte & 15, byte >> 4) == (low, high)
                        else:
                            run = block[32 * line:32 * line + 32].view(torch.int8)
                            assert (run[i], run[16 + i]) == (low, high)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("shape", [(64, 96), (160, 64), (96, 1536 // 16)])
def test_one_hot_rows_read_back_the_bfloat16_weights_bit_for_bit(fmt, shape):
    # x = e_k gives y = W[:, k] with no sum to round: the kernel's widening of the blocks must
    # equal the bfloat16 path's weights exactly, extreme scales and codes included.
    rows, cols = shape
    weight, bf16, _ = _random_blocks(fmt, rows, cols, seed=2)
    eye = torch.eye(cols, dtype=torch.bfloat16)
    for start in range(0, cols, 32):
        y = _run_or_refusal(lambda: weight.matmul(eye[start:start + 32].contiguous()))
        if y is not None:
            assert torch.equal(y, bf16[:, start:start + 32].t()), start


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 70])
def test_products_are_as_exact_as_a_bfloat16_matmul(fmt, rows):
    # Against the exact product of the same bfloat16 numbers: at most one rounding of the output
    # (float32 accumulation, then bfloat16), as the bfloat16 path.
    weight, bf16, _ = _random_blocks(fmt, 96, 128, seed=3)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    y = _run_or_refusal(lambda: weight.matmul(x))
    if y is None:
        return
    exact = x.double() @ bf16.double().t()
    scale = exact.abs().amax(dim=0, keepdim=True)  # per output: the extreme blocks' outputs are huge
    torch.testing.assert_close(y.double() / scale, exact / scale, rtol=BF16_ULP, atol=1e-6)
    bf16_path = torch.nn.functional.linear(x, bf16).double()
    torch.testing.assert_close(y.double() / scale, bf16_path / scale, rtol=2 * BF16_ULP, atol=1e-5)


def test_the_tiny_model_file_weights_through_the_kernel(tiny_checkpoint):
    # The companions the loader takes from a real Q4_1 GGUF, merged as the model merges them.
    weights = tiny_checkpoint.weights
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    qkv = amx.AmxQ4Weight.from_companions([tuple(weights[n + s] for s in int4.COMPANIONS) for n in names],
                                          cpu_ops())
    full = torch.cat([weights[n] for n in names])
    eye = torch.eye(full.shape[1], dtype=torch.bfloat16)
    y = _run_or_refusal(lambda: torch.cat([qkv.matmul(eye[s:s + 32].contiguous()) for s in range(0, full.shape[1], 32)]))
    if y is not None:
        assert torch.equal(y, full.t())


@pytest.mark.parametrize("fmt", FORMATS)
def test_any_number_of_threads_gives_the_same_bits(fmt):
    # Each output column is one thread's whole sum, in one order: threads change nothing.
    weight, _, _ = _random_blocks(fmt, 256, 128, seed=4)
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(_run_or_refusal(lambda: weight.matmul(x)))
    finally:
        torch.set_num_threads(before)
    if HAS_AMX:
        assert all(torch.equal(r, results[0]) for r in results)


@pytest.mark.parametrize("fmt", FORMATS)
def test_zero_rows_give_an_empty_result(fmt):
    weight, _, _ = _random_blocks(fmt, 64, 64, seed=6)
    y = _run_or_refusal(lambda: weight.matmul(torch.empty(0, 64, dtype=torch.bfloat16)))
    if y is not None:
        assert y.shape == (0, 64)


@pytest.mark.parametrize("fmt", FORMATS)
def test_refuses_inputs_it_cannot_take(fmt):
    weight, _, parts = _random_blocks(fmt, 64, 64, seed=7)
    kernel = getattr(cpu_ops(), f"{fmt}_linear")
    blocks = weight.blocks
    x = torch.randn(4, 64).to(torch.bfloat16)
    bad = {
        "float32 input": (x.float(), blocks, 64),
        "strided input": (torch.randn(4, 128).to(torch.bfloat16)[:, ::2], blocks, 64),
        "3-d input": (x.view(2, 2, 64), blocks, 64),
        "blocks of another shape": (torch.randn(4, 96).to(torch.bfloat16), blocks, 64),
        "outputs not in 32s": (x, blocks, 48),
        "blocks not bytes": (x, blocks.to(torch.int32), 64),
    }
    expected = f"{fmt}_linear" if HAS_AMX else "needs AMX"
    for what, args in bad.items():
        with pytest.raises(RuntimeError, match=expected):
            kernel(*args)
    # Shapes the kernels cannot take never reach them: from_companions declines them.
    codes, d = parts[0][:48], parts[1][:48]
    if fmt == "q4_1":
        assert amx.AmxQ4Weight.from_companions([(int4._pack(codes), d, parts[2][:48])], cpu_ops()) is None
    else:
        assert amx.AmxQ8Weight.from_companions(codes, d, cpu_ops()) is None


def test_the_default_model_lm_head_takes_its_q8_0_blocks_where_amx_runs(isoserve_cache):
    # The packaged model's LM head is its Q8_0 embedding: on AMX a step of up to 32 rows
    # multiplies by those blocks, which give the bfloat16 head's weights exactly, so its logits
    # match the bfloat16 head's to the accumulation order; elsewhere the head stays bfloat16.
    llm = LLM(dtype="bfloat16", cache_dir=str(isoserve_cache))
    head = llm.engine.model.lm_head
    kinds = [type(q).__name__ for _, q in head.tiers]
    assert kinds == (["AmxQ8Weight"] if HAS_AMX else [])
    assert ("LM head AMX 8-bit for steps of <= 32 tokens" in llm.engine.model.quantized_paths) == HAS_AMX
    if not HAS_AMX:
        return
    x = torch.randn(8, 576, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    logits = head(x)
    reference = torch.nn.functional.linear(x, llm.engine.model.embed)
    scale = reference.abs().max().item()
    torch.testing.assert_close(logits.float() / scale, reference.float() / scale, rtol=2 * BF16_ULP, atol=1e-4)
    assert (logits.argmax(-1) == reference.argmax(-1)).all()
    eye = torch.eye(576, dtype=torch.bfloat16)[:32].contiguous()
    assert torch.equal(head(eye), llm.engine.model.embed[:, :32].t())
    assert q8_0.has_companions(load_checkpoint("smollm2-135m-instruct", torch.bfloat16, isoserve_cache).weights,
                               "model.embed_tokens.weight")


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_weight_takes_a_strided_input_as_the_bfloat16_path_does(fmt):
    # The kernel itself refuses a strided x (above); the weight's matmul hands it a copy.
    weight, bf16, _ = _random_blocks(fmt, 64, 64, seed=9)
    wide = torch.randn(5, 128, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    y = _run_or_refusal(lambda: weight.matmul(wide[:, ::2]))
    if y is not None:
        assert torch.equal(y, weight.matmul(wide[:, ::2].contiguous()))


def _gate_up(outputs: int, cols: int, seed: int):
    """(gate part, up part) of random Q4_1 blocks, each [outputs, cols], as the loader gives them."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    for _ in range(2):
        codes = torch.randint(0, 16, (outputs, cols), generator=g, dtype=torch.uint8)
        d = (torch.randn(outputs, cols // 32, generator=g) * 0.05).half()
        m = (torch.randn(outputs, cols // 32, generator=g) * 0.2).half()
        parts.append((int4._pack(codes), d, m))
    return parts


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33])
def test_the_gate_up_kernel_gives_silu_mul_of_the_projection_bit_for_bit(rows):
    # silu(x G^T) * (x U^T) in the pair's epilogue: exactly the plain kernel's [gate; up] output
    # then silu_mul, for one A tile, two, and more than one pass of 32 rows.
    ops = cpu_ops()
    parts = _gate_up(96, 128, seed=rows)
    fused, plain = amx.AmxQ4SwigluWeight.from_companions(parts, ops), amx.AmxQ4Weight.from_companions(parts, ops)
    assert fused.fuses_swiglu and fused.out_features == 192
    x = (torch.randn(rows, 128, generator=torch.Generator().manual_seed(200 + rows)) * 3).to(torch.bfloat16)
    y = _run_or_refusal(lambda: fused.swiglu(x))
    if y is None:
        return
    expected = ops.silu_mul(plain.matmul(x))
    assert y.shape == (rows, 96)
    assert torch.equal(y, expected)
    # Through a Projection: swiglu takes the kernel; a plain call multiplies by the dense weight.
    dense = torch.cat([int4.dequantize({"w" + s: t for s, t in zip(int4.COMPANIONS, p)}, "w") for p in parts])
    projection = Projection(dense.to(torch.bfloat16), None, [(32, fused)])
    if rows <= 32:
        assert torch.equal(projection.swiglu(x, ops.silu_mul), expected)
    torch.testing.assert_close(projection(x).float(), torch.nn.functional.linear(x, dense.to(torch.bfloat16)).float(),
                               rtol=2 * BF16_ULP, atol=1e-2)
    with pytest.raises(TypeError, match="not x W"):
        fused.matmul(x)


def test_the_gate_up_kernel_takes_only_a_gate_and_an_up_of_whole_blocks():
    ops = cpu_ops()
    parts = _gate_up(24, 64, seed=1)  # 48 outputs: 24 is no whole number of 16-row blocks
    assert amx.AmxQ4SwigluWeight.from_companions(parts, ops) is None
    assert amx.AmxQ4SwigluWeight.from_companions(_gate_up(32, 64, seed=2)[:1], ops) is None  # not a gate and an up
    gate, up = _gate_up(48, 64, seed=3)  # 48 + 16 rows would make whole pairs: only the shapes differ
    narrow_up = tuple(t[:16] for t in up)
    assert amx.AmxQ4SwigluWeight.from_companions([gate, narrow_up], ops) is None  # halves of different sizes


def test_the_default_model_gate_up_takes_the_swiglu_kernel_where_amx_runs(isoserve_cache):
    llm = LLM(dtype="bfloat16", cache_dir=str(isoserve_cache))
    kinds = [type(q).__name__ for _, q in llm.engine.model.layers[0].gate_up.tiers]
    assert kinds == (["Int4Weight", "AmxQ4SwigluWeight"] if HAS_AMX else ["Int4Weight"])
