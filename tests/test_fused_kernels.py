"""The fused CPU kernels (isoserve/kernels/cpu_ops.cpp) against the torch reference
(model/layer_ops.TorchOps): same results, the same pool slots written and no others, bounds
checked before any read or write, and padding past a sequence's length never read."""
from __future__ import annotations

import pytest
import torch

from isoserve.kernels import cpu_ops
from isoserve.model.layer_ops import FusedOps, TorchOps, select_ops
from isoserve.model.paged_attention import StepAttention

BF16_ULP = 2.0 ** -7  # relative spacing of bfloat16: one rounding step


@pytest.fixture(scope="module")
def fused():
    # No skip: the suite runs where `make install` built the kernels; failing to build is a defect.
    return FusedOps(cpu_ops(), torch.float32)


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, ulps: float = 1) -> None:
    """float32: equal to float32 rounding; bfloat16: at most `ulps` rounding steps apart."""
    if dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    else:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=ulps * BF16_ULP, atol=1e-5)


def test_select_ops_uses_kernels_on_cpu_only():
    ops, note = select_ops(torch.device("cpu"), torch.bfloat16)
    assert isinstance(ops, FusedOps) and note == ""
    ops, note = select_ops(torch.device("cpu"), torch.float16)
    assert isinstance(ops, TorchOps) and "float16" in note
    ops, note = select_ops(torch.device("cpu"), torch.float32, fused=False)
    assert isinstance(ops, TorchOps) and "off" in note


def test_torch_ops_sample_top_p_by_a_built_kernel_only(tmp_path, monkeypatch):
    """A model the kernels do not serve (float16 here; CUDA likewise) still samples on the CPU:
    its nuclei take the CPU kernel where it is built, never a build; turned off, the reference."""
    from isoserve.engine.nucleus import nucleus_weights
    kernels = cpu_ops()
    draw = kernels.temperature_draw if kernels.has_temperature_draw else None
    ops, _ = select_ops(torch.device("cpu"), torch.float16)
    assert ops.nucleus == kernels.nucleus_rows and ops.draw == draw
    assert select_ops(torch.device("cpu"), torch.float32)[0].draw == draw
    off = select_ops(torch.device("cpu"), torch.float32, fused=False)[0]
    assert off.nucleus is nucleus_weights and off.draw is None  # the reference: torch ops only
    monkeypatch.setenv("ISOSERVE_KERNELS_DIR", str(tmp_path))  # nothing built there
    unbuilt = select_ops(torch.device("cpu"), torch.float16)[0]
    assert unbuilt.nucleus is nucleus_weights and unbuilt.draw is None
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 33])
def test_norms_match_torch(fused, dtype, rows):
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 576, generator=g) * 3).to(dtype)
    y = torch.randn(rows, 576, generator=g).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    _close(fused.rms_norm(x, w, 1e-5), TorchOps.rms_norm(x, w, 1e-5), dtype)

    x_ref, x_fused = x.clone(), x.clone()
    expected = TorchOps.add_rms_norm(x_ref, y, w, 1e-5)
    actual = fused.add_rms_norm(x_fused, y, w, 1e-5)
    assert torch.equal(x_fused, x_ref)  # the residual add, in place, rounds as torch's does
    _close(actual, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_matches_torch(fused, dtype):
    g = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(9, 2 * 1536, generator=g) * 6).to(dtype)
    gate_up[0, :6] = torch.tensor([-200.0, -88.0, 0.0, 88.0, 200.0, -1e-30])  # past the clamp
    _close(fused.silu_mul(gate_up), TorchOps.silu_mul(gate_up), dtype)


def _caches(dtype, pages=12, page_size=4, kv_heads=2, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, pages, page_size, dim, generator=g).to(dtype)
    return k, torch.randn(kv_heads, pages, page_size, dim, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [16, 64])  # 64: halves of whole 16-lane vectors (kernels/bf16x16.h)
def test_rotary_store_matches_torch_and_writes_only_its_slots(fused, dtype, dim):
    heads, kv_heads, tokens = 4, 2, 5
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    angles = torch.rand(tokens, 1, dim, generator=g) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.tensor([3, 17, 18, 40, 0])
    k_ref, v_ref = _caches(dtype, kv_heads=kv_heads, dim=dim)
    k_fused, v_fused = k_ref.clone(), v_ref.clone()
    q_ref = TorchOps.rotary_store(qkv, cos, sin, k_ref, v_ref, slots, heads)
    q_fused = fused.rotary_store(qkv, cos, sin, k_fused, v_fused, slots, heads)
    assert torch.equal(v_fused, v_ref)  # V copied to the same slots, and nothing else touched
    if dtype == torch.bfloat16:  # every product rounded as torch rounds it: the same bits
        assert torch.equal(q_fused, q_ref) and torch.equal(k_fused, k_ref)
    else:  # float32: the compiler may fuse x * cos + r * sin into one FMA, one rounding fewer
        _close(q_fused, q_ref, dtype)
        _close(k_fused, k_ref, dtype)
        untouched = torch.ones(k_ref.shape[1] * k_ref.shape[2], dtype=torch.bool)
        untouched[slots] = False
        assert torch.equal(k_fused.view(2, -1, dim)[:, untouched], k_ref.view(2, -1, dim)[:, untouched])


# (query heads, KV heads, head_dim): a shape read at run time; the default model's, which the
# kernel runs unrolled; and a head_dim that is no multiple of the kernel's 16-float vectors.
ATTENTION_SHAPES = [(6, 2, 16), (9, 3, 64), (4, 1, 24)]


def _attention_case(dtype, lens, page_size=4, pages=40, seed=0, shape=ATTENTION_SHAPES[0]):
    """Page tables of random, non-adjacent pages; everything a sequence must not read (pages
    past its length, slots past its length in its last page, table padding) holds NaN."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = shape
    k, v = _caches(dtype, pages=pages, page_size=page_size, kv_heads=kv_heads, dim=dim, seed=seed)
    width = max(-(-n // page_size) for n in lens) + 1  # one page of padding for everyone
    order = torch.randperm(pages - 1, generator=g) + 1    # page 0 is the padding page
    tables, taken = torch.zeros(len(lens), width, dtype=torch.int64), 0
    readable = torch.zeros(pages, page_size, dtype=torch.bool)
    for b, n in enumerate(lens):
        used = -(-n // page_size)
        tables[b, :used] = order[taken:taken + used]
        taken += used
        for j in range(n):
            readable[tables[b, j // page_size], j % page_size] = True
    k[:, ~readable] = float("nan")
    v[:, ~readable] = float("nan")
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    attn = StepAttention(write_slots=torch.zeros(0, dtype=torch.int64), decode_rows=torch.arange(len(lens)),
                         decode_pages=tables, decode_lens=torch.tensor(lens), prefills=[])
    return q, k, v, attn


def _gold_attention(q, k, v, attn, scale):
    """float64, one sequence at a time, from the page table: the definition."""
    out = []
    heads, kv_heads = q.shape[1], k.shape[0]
    for b, n in enumerate(attn.decode_lens.tolist()):
        slots = [(int(attn.decode_pages[b, j // k.shape[2]]), j % k.shape[2]) for j in range(n)]
        keys = torch.stack([k[:, p, s] for p, s in slots], dim=1).double()  # [H_kv, n, D]
        vals = torch.stack([v[:, p, s] for p, s in slots], dim=1).double()
        keys = keys.repeat_interleave(heads // kv_heads, dim=0)
        vals = vals.repeat_interleave(heads // kv_heads, dim=0)
        probs = torch.softmax(torch.einsum("hd,hnd->hn", q[b].double(), keys) * scale, dim=-1)
        out.append(torch.einsum("hn,hnd->hd", probs, vals))
    return torch.stack(out)


def _kernel_attention(q, k, v, attn, scale, bf16_dot):
    return cpu_ops().decode_attention(q, k, v, attn.decode_pages, attn.decode_lens, scale, bf16_dot=bf16_dot)


def test_the_bf16_dot_path_is_built_where_the_cpu_has_it():
    """-march=native: a CPU with AVX512-BF16 compiles the scores' dot-product path, so the tests
    below run both paths on it (bf16_dot=False forces the float32 one)."""
    flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    assert cpu_ops().has_bf16_dot == ("avx512_bf16" in flags)


def test_the_float32_avx2_kernels_are_built_where_the_cpu_has_avx2_and_no_avx512():
    """-march=native: f32x8.h's float32 kernels (attention, argmax) replace the 16-float vector
    code only on a CPU without AVX-512, where that code splits into register pairs (float32
    SwiGLU takes f32x8.h's 8-lane code on every AVX2 build)."""
    flags = set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    assert cpu_ops().has_f32x8 == ({"avx2", "fma"} <= flags and "avx512f" not in flags)


@pytest.mark.parametrize("bf16_dot", [True, False])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[1], [5, 4, 13], [16, 1, 9, 30, 2, 7, 33]])
def test_decode_attention_reads_only_its_keys(dtype, lens, shape, bf16_dot):
    q, k, v, attn = _attention_case(dtype, lens, shape=shape)
    gold = _gold_attention(q, k, v, attn, 0.25)
    actual = _kernel_attention(q, k, v, attn, 0.25, bf16_dot)
    assert not actual.isnan().any()  # nothing past a sequence's length was read
    tolerance = 1e-5 if dtype == torch.float32 else 2 * BF16_ULP
    torch.testing.assert_close(actual.double(), gold, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("shape", [(5, 5, 40), (10, 2, 128), (8, 4, 8), (12, 3, 64)])
def test_float32_decode_attention_over_every_tile_shape_and_long_sequences(shape):
    """float32 on AVX2 (kernels/vector_attention.cpp) tiles query heads in threes and dims in
    32s, and scores keys in pairs and blocks of 8: one query head per KV head, five (3 + 2), two,
    three; 40, 128, 8 and 64 dims; lengths that end inside a pair, a block and a page."""
    lens = [1, 7, 8, 9, 33, 200, 17]
    q, k, v, attn = _attention_case(torch.float32, lens, page_size=16, pages=40, seed=7, shape=shape)
    gold = _gold_attention(q, k, v, attn, 0.3)
    actual = _kernel_attention(q, k, v, attn, 0.3, False)
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.double(), gold, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bf16_dot", [True, False])
@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_decode_attention_in_bf16_is_at_least_as_exact_as_the_torch_path(shape, bf16_dot):
    """The kernel keeps scores and probabilities in float32 where the torch path rounds them to
    bf16 in between: against the float64 definition, its error is no larger."""
    q, k, v, attn = _attention_case(torch.bfloat16, [9, 3, 21, 40], seed=5, shape=shape)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the torch path multiplies padding by zero
    gold = _gold_attention(q, k, v, attn, 0.25)
    fused_error = (_kernel_attention(q, k, v, attn, 0.25, bf16_dot).double() - gold).abs().max()
    torch_error = (TorchOps.decode_attention(q, k, v, attn, 0.25).double() - gold).abs().max()
    assert fused_error <= torch_error


def test_decode_attention_bf16_dot_agrees_with_the_float32_path():
    """The default model's shape over long, scattered sequences: the two ways of scoring differ
    only in the order of float32 sums, so the outputs agree to a bfloat16 rounding step."""
    q, k, v, attn = _attention_case(torch.bfloat16, [300, 17, 129, 64], page_size=16, pages=60,
                                    seed=11, shape=(9, 3, 64))
    q = q * 8  # large scores: a sharp softmax magnifies any error in them
    _close(_kernel_attention(q, k, v, attn, 0.125, True), _kernel_attention(q, k, v, attn, 0.125, False),
           torch.bfloat16)


def test_decode_attention_refuses_a_length_past_its_own_pages(fused):
    """Page tables are padded with NO_PAGE: a row whose length ran past its own pages (the other
    rows' tables are wider) is refused, never served from a page it does not hold."""
    from isoserve.kv.pool import NO_PAGE, page_tables
    q, k, v, _ = _attention_case(torch.float32, [6, 8])
    pages = page_tables([[1], [2, 3]], 2)
    assert pages[0, 1] == NO_PAGE
    with pytest.raises(RuntimeError, match="outside the pool"):
        cpu_ops().decode_attention(q, k, v, pages, torch.tensor([6, 8]), 0.25)


@pytest.mark.parametrize("shape", ATTENTION_SHAPES)
def test_decode_attention_matches_torch_path(fused, shape):
    q, k, v, attn = _attention_case(torch.float32, [9, 3, 21], seed=3, shape=shape)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the torch path multiplies padding by zero
    torch.testing.assert_close(fused.decode_attention(q, k, v, attn, 0.25),
                               TorchOps.decode_attention(q, k, v, attn, 0.25), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152 + 7])
def test_argmax_matches_torch_with_ties_infinities_and_nan(fused, dtype, vocab):
    """Greedy tokens: the first maximal index of each row, as torch.argmax picks it, including
    ties (bfloat16 logits tie often), rows of -inf, and a NaN (torch counts it the maximum)."""
    g = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(9, vocab, generator=g) * 4).to(dtype)
    logits[1] = logits[1].round()                        # many ties at the top
    logits[2] = float("-inf")
    logits[3, -1] = float("inf")                         # the last element: the tail loop
    logits[4, vocab // 2] = float("nan")
    logits[5, :] = 7.0                                   # all equal: index 0
    logits[6, vocab - 1] = float("nan")
    logits[6, 0] = float("inf")                          # NaN beats +inf, as in torch
    logits[7, vocab // 3] = float("nan")
    logits[7, vocab - 1] = float("nan")                  # the first NaN
    logits[8, [vocab - 1, 2 * vocab // 3, vocab // 3]] = 100.0  # one maximum in the tail, two
                                                         # in other lanes: the first one wins
    assert torch.equal(fused.argmax(logits), TorchOps.argmax(logits))
    assert fused.argmax(logits[:0]).shape == (0,)


# ---- A bfloat16 pool under a float32 model (--kv-dtype bfloat16, config.parse_kv_dtype) ----

@pytest.mark.parametrize("dim", [16, 64, 20])
def test_rotary_store_into_a_bfloat16_pool_rounds_k_and_v_once(fused, dim):
    """float32 Q, K and V into a bfloat16 pool: Q as for a float32 pool; K rotated in float32
    and V as projected, each rounded once to the nearest bfloat16, in their slots and no others;
    the torch path (write_kv's .to()) rounds the same V to the same bits."""
    heads, kv_heads, tokens = 4, 2, 5
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g)
    angles = torch.rand(tokens, 1, dim, generator=g) * 6
    cos, sin = angles.cos(), angles.sin()
    slots = torch.tensor([3, 17, 18, 40, 0])
    k_wide, v_wide = _caches(torch.float32, kv_heads=kv_heads, dim=dim)
    k_narrow, v_narrow = k_wide.to(torch.bfloat16), v_wide.to(torch.bfloat16)
    k_ref, v_ref = k_narrow.clone(), v_narrow.clone()
    q_wide = fused.rotary_store(qkv, cos, sin, k_wide, v_wide, slots, heads)
    q_narrow = fused.rotary_store(qkv, cos, sin, k_narrow, v_narrow, slots, heads)
    q_ref = TorchOps.rotary_store(qkv, cos, sin, k_ref, v_ref, slots, heads)
    assert q_narrow.dtype == torch.float32 and torch.equal(q_narrow, q_wide)
    assert torch.equal(k_narrow, k_wide.to(torch.bfloat16)) and torch.equal(v_narrow, v_wide.to(torch.bfloat16))
    assert torch.equal(v_narrow, v_ref)
    _close(q_narrow, q_ref, torch.float32)
    _close(k_narrow, k_ref, torch.bfloat16)  # the float32 rotations may differ by an FMA's rounding
    untouched = torch.ones(k_ref.shape[1] * k_ref.shape[2], dtype=torch.bool)
    untouched[slots] = False
    before = _caches(torch.float32, kv_heads=kv_heads, dim=dim)[0].to(torch.bfloat16)
    assert torch.equal(k_narrow.view(kv_heads, -1, dim)[:, untouched], before.view(kv_heads, -1, dim)[:, untouched])


@pytest.mark.parametrize("shape", ATTENTION_SHAPES + [(12, 3, 64), (10, 2, 128), (4, 2, 20)])
@pytest.mark.parametrize("lens", [[1], [5, 4, 13], [16, 1, 9, 30, 2, 7, 33]])
def test_decode_attention_over_a_bfloat16_pool_is_the_float32_kernel_on_its_values(shape, lens):
    """float32 queries over a bfloat16 pool: each key and value widened exactly, then the float32
    kernel's arithmetic, so the output is that of the float32 kernel over the pool widened, to
    the bit (on AVX2 kernels/vector_attention.cpp, elsewhere cpu_ops.cpp's kernel; 20 dims is
    no multiple of either's vectors). Nothing past a sequence's length is read."""
    q, k, v, attn = _attention_case(torch.float32, lens, shape=shape)
    k, v = k.to(torch.bfloat16), v.to(torch.bfloat16)
    actual = _kernel_attention(q, k, v, attn, 0.25, False)
    assert actual.dtype == torch.float32 and not actual.isnan().any()
    assert torch.equal(actual, _kernel_attention(q, k.float(), v.float(), attn, 0.25, False))
    gold = _gold_attention(q, k.float(), v.float(), attn, 0.25)
    torch.testing.assert_close(actual.double(), gold, rtol=1e-5, atol=1e-5)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the torch path multiplies padding by zero
    # (torch's float32 matmuls sum in their own order: on one AMX Xeon an output of 0.013 came
    # out 1.2e-6 apart, past 1e-6)
    torch.testing.assert_close(_kernel_attention(q, k, v, attn, 0.25, False),
                               TorchOps.decode_attention(q, k, v, attn, 0.25), rtol=1e-5, atol=1e-5)


# ---- A float8 pool (--kv-dtype float8_e4m3fn, config.parse_kv_dtype; kernels/fp8.h) ----------

F8 = torch.float8_e4m3fn


def _every_code_and_more() -> torch.Tensor:
    """float32 values that reach every rounding case: each e4m3 value and each midpoint between
    neighbours (ties, to even), a sweep over every magnitude, the subnormals and the smallest
    normal's neighbourhood, past the largest finite value (448) up to infinity, and NaN."""
    g = torch.Generator().manual_seed(8)
    codes = torch.arange(256, dtype=torch.uint8).view(F8).float()
    finite = codes[codes.isfinite()].sort().values
    sweep = torch.cat([torch.randn(4096, generator=g) * 2.0 ** e for e in range(-12, 11, 2)])
    special = torch.tensor([0.0, -0.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10, 2.0 ** -10 * 1.0001, 3 * 2.0 ** -10,
                            7.5 * 2.0 ** -9, 447.0, 448.0, 449.0, 464.0, 465.0, 480.0, 1e6, float("inf"),
                            -float("inf"), float("nan")])
    return torch.cat([finite, (finite[1:] + finite[:-1]) / 2, sweep, -sweep, special])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_store_into_a_float8_pool_rounds_as_torch_does(fused, dtype):
    """K and V into a float8 pool: each rounded once to e4m3, to the very code torch's .to()
    gives (to nearest even, saturating at +-448, infinity included, NaN kept), in their slots and
    no others; Q as for a pool of the model's dtype. V is written as projected, so the values
    below reach the pool unrotated and every rounding case is checked; the torch path's
    write_kv writes the same bytes."""
    values = _every_code_and_more().to(dtype)
    heads, kv_heads, dim = 2, 1, 64
    tokens = -(-values.numel() // dim)
    qk = torch.randn(tokens, (heads + kv_heads) * dim, generator=torch.Generator().manual_seed(3)).to(dtype)
    v_rows = torch.cat([values, torch.zeros(tokens * dim - values.numel(), dtype=dtype)]).view(tokens, dim)
    qkv = torch.cat([qk, v_rows], dim=1)
    angles = torch.rand(tokens, 1, dim, generator=torch.Generator().manual_seed(4)) * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    slots = torch.randperm(tokens + 7, generator=torch.Generator().manual_seed(5))[:tokens]
    pages = -(-(tokens + 7) // 4)
    k_wide, v_wide = (c.zero_() for c in _caches(dtype, pages=pages, kv_heads=kv_heads, dim=dim))
    k_f8, v_f8 = torch.full_like(k_wide, 3.0).to(F8), torch.full_like(v_wide, 3.0).to(F8)
    k_ref, v_ref = k_f8.clone(), v_f8.clone()
    q_wide = fused.rotary_store(qkv, cos, sin, k_wide, v_wide, slots, heads)
    q_f8 = fused.rotary_store(qkv, cos, sin, k_f8, v_f8, slots, heads)
    assert torch.equal(q_f8, q_wide)
    as_bytes = lambda t: t.view(torch.uint8)  # noqa: E731 (NaN codes compare as bytes)
    written = torch.zeros(k_f8.shape[1] * k_f8.shape[2], dtype=torch.bool)
    written[slots] = True
    for narrow, wide in ((k_f8, k_wide), (v_f8, v_wide)):
        got, want = as_bytes(narrow).view(kv_heads, -1, dim), as_bytes(wide.to(F8)).view(kv_heads, -1, dim)
        assert torch.equal(got[:, written], want[:, written])
        assert (got[:, ~written] == as_bytes(torch.tensor(3.0).to(F8))).all()  # untouched
    TorchOps.rotary_store(qkv, cos, sin, k_ref, v_ref, slots, heads)
    assert torch.equal(as_bytes(v_ref), as_bytes(v_f8))


@pytest.mark.parametrize("shape", ATTENTION_SHAPES + [(12, 3, 64), (4, 2, 20)])
@pytest.mark.parametrize("lens", [[1], [5, 4, 13], [16, 1, 9, 30, 2, 7, 33]])
def test_decode_attention_over_a_float8_pool_is_the_kernel_over_its_values(shape, lens):
    """A float8 pool holds e4m3 values, each exactly a bfloat16: decoding over it gives, to the
    bit, what a bfloat16 model gives over a bfloat16 pool of the same values (the same dot
    products, widened in registers from 8 bits), and a float32 model what it gives over those
    values in float32. The pool cycles through every finite code; nothing past a sequence's
    length is read (NaN there would show)."""
    g = torch.Generator().manual_seed(len(lens))
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v, attn = _attention_case(dtype, lens, shape=shape)
        finite = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
        k_codes = finite[torch.randperm(finite.numel(), generator=g)].repeat(-(-k.numel() // finite.numel()))
        k_codes = k_codes[:k.numel()].view(k.shape)  # every finite code, over and over
        v_codes = k_codes.flip(-1).contiguous()
        k_codes[k.isnan()], v_codes[v.isnan()] = 0x7F, 0x7F  # NaN where nothing may read
        k8, v8 = k_codes.view(F8), v_codes.view(F8)
        actual = _kernel_attention(q, k8, v8, attn, 0.25, True)
        assert actual.dtype == dtype and not actual.isnan().any()
        widened = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        assert torch.equal(k8.to(widened).to(F8).view(torch.uint8), k8.view(torch.uint8))  # exact widening
        expected = _kernel_attention(q, k8.to(widened), v8.to(widened), attn, 0.25, True)
        if dtype == torch.bfloat16:
            assert torch.equal(actual, expected)
        else:  # over a float32 pool the AVX2 kernel sums in its own order, with its own exp
            torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-3)
        torch.testing.assert_close(actual.double(), _gold_attention(q, k8.float(), v8.float(), attn, 0.25),
                                   rtol=2 * BF16_ULP if dtype == torch.bfloat16 else 1e-4, atol=1e-3)


def test_float8_pages_widen_to_bfloat16_exactly_and_only_pages_of_the_pool():
    """fp8_pages_to_bfloat16 (the AMX prefill's input): the listed pages, every code widened
    exactly as torch widens it (NaN to NaN), in order; a page outside the pool is refused."""
    kernels = cpu_ops()
    codes = torch.arange(256, dtype=torch.uint8).repeat(2 * 6 * 16 * 64 // 256).view(2, 6, 16, 64)
    cache = codes[:, torch.randperm(6)].contiguous().view(F8)
    pages = torch.tensor([4, 0, 5, 4])
    got = kernels.fp8_pages_to_bf16(cache, pages)
    assert got.dtype == torch.bfloat16 and got.shape == (2, 4, 16, 64)
    torch.testing.assert_close(got, cache[:, pages].to(torch.bfloat16), rtol=0, atol=0, equal_nan=True)
    odd = torch.arange(3 * 5 * 7, dtype=torch.uint8).view(1, 3, 5, 7).view(F8)  # no whole 32-code vectors
    torch.testing.assert_close(kernels.fp8_pages_to_bf16(odd, torch.tensor([2, 1])), odd[:, [2, 1]].to(torch.bfloat16),
                               rtol=0, atol=0, equal_nan=True)
    for page in (6, -1):
        with pytest.raises(RuntimeError, match="outside the pool"):
            kernels.fp8_pages_to_bf16(cache, torch.tensor([0, page]))
    with pytest.raises(RuntimeError, match="float8_e4m3fn"):
        kernels.fp8_pages_to_bf16(cache.to(torch.bfloat16), pages)


def test_kernels_refuse_a_pool_dtype_no_kernel_reads(fused):
    """A pool is the model's dtype, or bfloat16 under float32; any other pair is refused before
    anything is read or written."""
    kernels = cpu_ops()
    q, k, v, attn = _attention_case(torch.bfloat16, [5, 6])
    with pytest.raises(RuntimeError, match="BFloat16 model cannot use a Float KV pool"):
        kernels.decode_attention(q, k.float(), v.float(), attn.decode_pages, attn.decode_lens, 0.25)
    with pytest.raises(RuntimeError, match="K and V caches must share a dtype"):
        kernels.decode_attention(q.float(), k, v.float(), attn.decode_pages, attn.decode_lens, 0.25)
    kc, vc = _caches(torch.float32, kv_heads=2, dim=16)
    qkv, cos = torch.zeros(2, 8 * 16, dtype=torch.bfloat16), torch.zeros(2, 1, 16, dtype=torch.bfloat16)
    before = kc.clone()
    with pytest.raises(RuntimeError, match="BFloat16 model cannot use a Float KV pool"):
        kernels.rotary_store(qkv, cos, cos, kc, vc, torch.tensor([0, 1]), 4)
    assert torch.equal(kc, before)


def test_kernels_refuse_out_of_pool_addresses(fused):
    kernels = cpu_ops()
    q, k, v, attn = _attention_case(torch.float32, [5, 6])
    pages, lens = attn.decode_pages.clone(), attn.decode_lens.clone()
    pages[1, 0] = k.shape[1]  # one past the last page
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.decode_attention(q, k, v, pages, lens, 0.25)
    pages[1, 0] = -1
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.decode_attention(q, k, v, pages, lens, 0.25)
    too_long = torch.tensor([5, attn.decode_pages.shape[1] * k.shape[2] + 1])
    with pytest.raises(RuntimeError, match="reads"):
        kernels.decode_attention(q, k, v, attn.decode_pages, too_long, 0.25)
    with pytest.raises(RuntimeError, match="reads"):
        kernels.decode_attention(q, k, v, attn.decode_pages, torch.tensor([5, 0]), 0.25)

    heads, kv_heads, dim = 4, 2, 16
    kc, vc = _caches(torch.float32, kv_heads=kv_heads, dim=dim)
    before = kc.clone()
    qkv = torch.zeros(2, (heads + 2 * kv_heads) * dim)
    cos = sin = torch.zeros(2, 1, dim)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.rotary_store(qkv, cos, sin, kc, vc, torch.tensor([0, kc.shape[1] * kc.shape[2]]), heads)
    assert torch.equal(kc, before)  # checked before anything was written


def test_kernels_refuse_wrong_inputs(fused):
    kernels = cpu_ops()
    x = torch.zeros(2, 8)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        kernels.rms_norm(x.half(), torch.zeros(8).half(), 1e-5)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.rms_norm(torch.zeros(8, 2).t(), torch.zeros(8), 1e-5)
    with pytest.raises(RuntimeError, match="share a dtype"):
        kernels.rms_norm(x, torch.zeros(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match="2 \\* n"):
        kernels.silu_mul(torch.zeros(2, 7))
    with pytest.raises(RuntimeError, match="n > 0"):
        kernels.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.argmax_rows(torch.zeros(8, 2).t())


@pytest.mark.parametrize("kv_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_mixed_step_fused_equals_torch_in_float32(tiny_llama_dir, kv_dtype):
    """A whole engine, fused vs torch ops, over steps that mix prefill chunks with decodes:
    the same greedy tokens and logprobs to float32 rounding, with a float32 pool, a bfloat16
    one and a float8 one."""
    from isoserve.engine.llm import LLM
    from isoserve.engine.sampling_params import SamplingParams

    prompts = [list(range(5, 5 + n)) for n in (3, 40, 17, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    results = {}
    for name, on in (("fused", True), ("torch", False)):
        llm = LLM(model=str(tiny_llama_dir), dtype="float32", kv_dtype=kv_dtype, fused_kernels=on,
                  max_batched_tokens=24)
        assert llm.engine.model.ops.name == ("fused CPU kernels" if on else "torch ops")
        assert llm.engine.pool.kv.dtype == getattr(torch, kv_dtype)
        results[name] = llm.generate(prompts, params)
    for fused_out, torch_out in zip(results["fused"], results["torch"]):
        assert fused_out.token_ids == torch_out.token_ids
        torch.testing.assert_close(torch.tensor([t.logprob for t in fused_out.logprobs]),
                                   torch.tensor([t.logprob for t in torch_out.logprobs]), rtol=1e-4, atol=1e-4)
