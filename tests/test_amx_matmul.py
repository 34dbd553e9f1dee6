"""isoserve's AMX 4-bit matmul (kernels/amx_matmul.cpp, model/int4.py: AmxQ4Weight).

It must give the very bfloat16 weights the bfloat16 path multiplies by (so one-hot rows read
them back bit for bit), products as close to exact as a bfloat16 matmul, the same result on any
number of threads, and refuse inputs it cannot take. It runs only where the CPU has AMX; on
other machines these tests check that it says so and refuses every call, and that the model
then takes torch's int4 kernel (test_int4.py).
"""
from __future__ import annotations

import pytest
import torch

from isoserve.kernels import cpu_ops
from isoserve.model import int4
from isoserve.model.loader import load_checkpoint
from tiny_models import make_tiny_gguf

BF16_ULP = 2.0 ** -7


def _machine_has_amx() -> bool:
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    return {"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl"} <= set(flags)


HAS_AMX = _machine_has_amx()


def _random_q4_1(rows: int, cols: int, seed: int):
    """Codes, d and m as a Q4_1 file holds them (d, m float16), and the weight the bfloat16
    path makes of them: float32 d * q + m (gguf-py's dequantizer), rounded to bfloat16."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, cols), generator=g, dtype=torch.uint8)
    d = (torch.randn(rows, cols // 32, generator=g) * 0.05).half()
    m = (torch.randn(rows, cols // 32, generator=g) * 0.2).half()
    d[0, 0], m[0, 0] = 6.0e-8, -65504.0   # a float16 subnormal scale and the most negative minimum
    d[1, 0], m[1, 0] = -1000.0, 3.0       # a negative scale
    weight = (d.float().repeat_interleave(32, 1) * codes.float() + m.float().repeat_interleave(32, 1))
    return codes, d, m, weight.to(torch.bfloat16)


def _amx_weight(codes, d, m) -> int4.AmxQ4Weight:
    return int4.AmxQ4Weight.from_companions([(int4._pack(codes), d, m)], cpu_ops())


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
    assert (int4.amx_unavailable(cpu_ops()) == "") == HAS_AMX
    assert int4.amx_unavailable(None) != ""  # no kernels, no AMX path


def test_blocks_follow_the_documented_layout():
    # Decode the blocks by the layout amx_matmul.cpp documents and get the inputs back.
    rows, cols = 64, 96
    codes, d, m, _ = _random_q4_1(rows, cols, seed=1)
    blocks = int4.amx_blocks(codes, d, m)
    assert blocks.dtype == torch.uint8 and blocks.numel() == rows // 16 * cols // 32 * int4.AMX_BLOCK_BYTES
    k_blocks = cols // 32
    b = blocks.view(rows // 32, k_blocks, 2, int4.AMX_BLOCK_BYTES)
    for pair in range(rows // 32):
        for kb in range(k_blocks):
            for half_pair in range(2):
                block = b[pair, kb, half_pair]
                first = 32 * pair + 16 * half_pair
                scale = block[256:288].view(torch.float16)
                minimum = block[288:320].view(torch.float16)
                assert torch.equal(scale, d[first:first + 16, kb]) and torch.equal(minimum, m[first:first + 16, kb])
                for line in range(16):
                    for i in range(16):
                        byte = int(block[16 * line + i])
                        k = 32 * kb + 2 * line + i % 2
                        assert byte & 15 == codes[first + i // 2, k]
                        assert byte >> 4 == codes[first + 8 + i // 2, k]


@pytest.mark.parametrize("shape", [(64, 96), (160, 64), (96, 1536 // 16)])
def test_one_hot_rows_read_back_the_bfloat16_weights_bit_for_bit(shape):
    # x = e_k gives y = W[:, k] with no sum to round: the kernel's widening of the blocks must
    # equal the bfloat16 path's weights exactly, extreme scales and minimums included.
    rows, cols = shape
    codes, d, m, weight = _random_q4_1(rows, cols, seed=2)
    amx = _amx_weight(codes, d, m)
    eye = torch.eye(cols, dtype=torch.bfloat16)
    for start in range(0, cols, 32):
        y = _run_or_refusal(lambda: amx.matmul(eye[start:start + 32].contiguous()))
        if y is not None:
            assert torch.equal(y, weight[:, start:start + 32].t()), start


@pytest.mark.parametrize("rows", [1, 2, 15, 16, 17, 31, 32, 33, 70])
def test_products_are_as_exact_as_a_bfloat16_matmul(rows):
    # Against the exact product of the same bfloat16 numbers: at most one rounding of the output
    # (float32 accumulation, then bfloat16), as the bfloat16 path.
    codes, d, m, weight = _random_q4_1(96, 128, seed=3)
    amx = _amx_weight(codes, d, m)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    y = _run_or_refusal(lambda: amx.matmul(x))
    if y is None:
        return
    exact = x.double() @ weight.double().t()
    torch.testing.assert_close(y.double(), exact, rtol=BF16_ULP, atol=1e-6 * exact.abs().max().item())
    bf16_path = torch.nn.functional.linear(x, weight)
    torch.testing.assert_close(y.float(), bf16_path.float(), rtol=2 * BF16_ULP, atol=1e-5 * exact.abs().max().item())


def test_the_tiny_model_file_weights_through_the_kernel(tmp_path, tiny_llama_dir):
    # The companions the loader takes from a real Q4_1 GGUF, merged as the model merges them.
    path = make_tiny_gguf(tmp_path / "tiny-q4_1.gguf", tiny_llama_dir, q4_1=True)
    weights = load_checkpoint(str(path), torch.bfloat16, tmp_path / "cache").weights
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    amx = int4.AmxQ4Weight.from_companions([tuple(weights[n + s] for s in int4.COMPANIONS) for n in names],
                                           cpu_ops())
    full = torch.cat([weights[n] for n in names])
    eye = torch.eye(full.shape[1], dtype=torch.bfloat16)
    y = _run_or_refusal(lambda: torch.cat([amx.matmul(eye[s:s + 32].contiguous()) for s in range(0, full.shape[1], 32)]))
    if y is not None:
        assert torch.equal(y, full.t())


def test_any_number_of_threads_gives_the_same_bits():
    # Each output column is one thread's whole sum, in one order: threads change nothing.
    codes, d, m, _ = _random_q4_1(256, 128, seed=4)
    amx = _amx_weight(codes, d, m)
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(_run_or_refusal(lambda: amx.matmul(x)))
    finally:
        torch.set_num_threads(before)
    if HAS_AMX:
        assert all(torch.equal(r, results[0]) for r in results)


def test_zero_rows_give_an_empty_result():
    codes, d, m, _ = _random_q4_1(64, 64, seed=6)
    y = _run_or_refusal(lambda: _amx_weight(codes, d, m).matmul(torch.empty(0, 64, dtype=torch.bfloat16)))
    if y is not None:
        assert y.shape == (0, 64)


def test_refuses_inputs_it_cannot_take():
    kernels = cpu_ops()
    codes, d, m, _ = _random_q4_1(64, 64, seed=7)
    blocks = int4.amx_blocks(codes, d, m)
    x = torch.randn(4, 64).to(torch.bfloat16)
    bad = {
        "float32 input": (x.float(), blocks, 64),
        "strided input": (torch.randn(4, 128).to(torch.bfloat16)[:, ::2], blocks, 64),
        "3-d input": (x.view(2, 2, 64), blocks, 64),
        "blocks of another shape": (torch.randn(4, 96).to(torch.bfloat16), blocks, 64),
        "outputs not in 32s": (x, blocks, 48),
        "blocks not bytes": (x, blocks.to(torch.int32), 64),
    }
    expected = "q4_1_linear" if HAS_AMX else "needs AMX"
    for what, args in bad.items():
        with pytest.raises(RuntimeError, match=expected):
            kernels.q4_1_linear(*args)
        assert what  # each case is refused on its own
    # Shapes the kernel cannot take never reach it: from_companions declines them.
    assert int4.AmxQ4Weight.from_companions([(int4._pack(codes[:48]), d[:48], m[:48])], kernels) is None
