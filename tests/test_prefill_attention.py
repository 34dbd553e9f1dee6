"""The prefill attention kernels, AMX's in bfloat16 (kernels/amx_attention.cpp) and AVX-512's in
float32 (kernels/f32_prefill_attention.cpp), and the ops that choose them.

It must give each chunk's causal attention as exactly as torch's own bfloat16 path does,
against a float64 definition; read only the first `context` keys of each chunk's pages (every
other slot of the pool holds NaN here: a value read from one turns the output NaN, and the
kernel copies the keys of a chunk's last tile rather than load past its context, since a score
read there would be masked out and go unseen); write only the chunks' rows; give
the same bits on any number of threads and for any split of a prompt into chunks; and refuse
inputs it cannot take before reading anything. On a CPU without AMX the kernel refuses every
call and the ops take torch's path. The float32 kernel is held to the same, to float32's
rounding, to the decode kernel's bits for each query, and to the same bits for any 16-query
block a query lands in; without AVX-512 it refuses every call and float32 takes the decode
kernel and torch's path. (It masks every key past a query's position before the softmax and
the values, so there the NaN slots show a read that reaches the output; that it reads no slot
past a chunk's context at all rests on its layout loop, which stops there.)
"""
from __future__ import annotations

import pytest
import torch

from isoserve.kernels import cpu_ops
from isoserve.model.layer_ops import SHORT_PREFILL_CONTEXT, FusedOps
from isoserve.model.paged_attention import PrefillChunk, StepAttention, prefill_attention_torch
from tiny_models import HAS_AMX, HAS_AVX512

PAGE = 16
SCALE = 0.125
# (query heads, KV heads, head_dim): the default model's, plain multi-head, a wide group, 32 dims
SHAPES = [(9, 3, 64), (4, 4, 64), (8, 1, 32)]
F32_SHAPES = SHAPES + [(4, 2, 128)]  # the float32 kernel takes 128 dims too
# Each chunk: (rows, context); a context past the rows is a later chunk of a longer prompt.
CASES = {
    "one prompt": [(100, 100)],
    "a wave of prompts": [(37, 37), (16, 16), (5, 5), (64, 64)],
    "later chunks": [(17, 40), (33, 200), (1, 77)],
    "long": [(300, 300), (48, 560)],
}


def _case(chunks, shape, seed=0, pages=90):
    """q for the chunks' rows plus two rows of no chunk at each end; pages chosen at random;
    every pool slot outside the chunks' first `context` keys is NaN."""
    heads, kv_heads, dim = shape
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(kv_heads, pages, PAGE, dim, generator=g).to(torch.bfloat16)
    v = torch.randn(kv_heads, pages, PAGE, dim, generator=g).to(torch.bfloat16)
    readable = torch.zeros(pages, PAGE, dtype=torch.bool)
    order = torch.randperm(pages, generator=g).tolist()
    rows = 2 + sum(r for r, _ in chunks) + 2
    q = torch.randn(rows, heads, dim, generator=g).to(torch.bfloat16)
    prefills, row = [], 2
    for n, ctx in chunks:
        used = [order.pop() for _ in range(-(-ctx // PAGE))]
        for j in range(ctx):
            readable[used[j // PAGE], j % PAGE] = True
        prefills.append(PrefillChunk(row, n, ctx, torch.tensor(used)))
        row += n
    k[:, ~readable] = float("nan")
    v[:, ~readable] = float("nan")
    attn = StepAttention(write_slots=torch.zeros(0, dtype=torch.int64), decode_rows=torch.zeros(0, dtype=torch.int64),
                         decode_pages=torch.zeros(0, 1, dtype=torch.int64),
                         decode_lens=torch.zeros(0, dtype=torch.int64), prefills=prefills)
    return q, k, v, attn


def _gold(q, k, v, attn):
    """float64, chunk by chunk, straight from the definition: query i of a chunk sits at
    position context - rows + i and attends to keys 0 .. that position."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    heads, kv_heads, dim = q.shape[1], k.shape[0], k.shape[-1]
    for c in attn.prefills:
        keys = k[:, c.pages].reshape(kv_heads, -1, dim)[:, :c.context_len].double()
        vals = v[:, c.pages].reshape(kv_heads, -1, dim)[:, :c.context_len].double()
        keys = keys.repeat_interleave(heads // kv_heads, 0)
        vals = vals.repeat_interleave(heads // kv_heads, 0)
        qs = q[c.token_start:c.token_start + c.num_tokens].double().transpose(0, 1)
        scores = qs @ keys.transpose(1, 2) * SCALE
        position = torch.arange(c.context_len - c.num_tokens, c.context_len)[:, None]
        scores = scores.masked_fill(torch.arange(c.context_len)[None, :] > position, float("-inf"))
        out[c.token_start:c.token_start + c.num_tokens] = (torch.softmax(scores, -1) @ vals).transpose(0, 1)
    return out


def _run(kernel: str, q, k, v, attn, fill=0.0):
    """out of cpu_ops().<kernel> over every chunk of attn, its other rows `fill`."""
    out = torch.full_like(q, fill)
    chunks, pages = attn.prefill_tables()
    getattr(cpu_ops(), kernel)(q, k, v, chunks, pages, out, SCALE)
    return out


def _kernel(q, k, v, attn, fill=0.0):
    return _run("prefill_attention", q, k, v, attn, fill)


def _f32_kernel(q, k, v, attn, fill=0.0):
    return _run("prefill_attention_f32", q, k, v, attn, fill)


def _torch_path(q, k, v, attn):
    out = torch.zeros_like(q)
    prefill_attention_torch(q, k, v, attn, SCALE, out)
    return out


def _chunk_rows(attn) -> torch.Tensor:
    rows = torch.zeros(0, dtype=torch.int64)
    for c in attn.prefills:
        rows = torch.cat([rows, torch.arange(c.token_start, c.token_start + c.num_tokens)])
    return rows


def _outside(q, attn) -> torch.Tensor:
    """[T] True for the step's rows that belong to no chunk."""
    others = torch.ones(q.shape[0], dtype=torch.bool)
    others[_chunk_rows(attn)] = False
    return others


def _refused_without(runs_here: bool, needs: str, run, q, k, v, attn) -> bool:
    """True (after checking that `run` refuses, saying what it needs) where the CPU lacks it,
    so the caller stops there."""
    if runs_here:
        return False
    with pytest.raises(RuntimeError, match=needs):
        run(q, k, v, attn)
    return True


def _refused_without_amx(q, k, v, attn) -> bool:
    return _refused_without(HAS_AMX, "needs AMX", _kernel, q, k, v, attn)


def _f32_refused_without_avx512(q, k, v, attn) -> bool:
    assert (cpu_ops().f32_prefill_status() == "") == HAS_AVX512
    return _refused_without(HAS_AVX512, "needs AVX-512", _f32_kernel, q, k, v, attn)


def _on_each_thread_count(run) -> list[torch.Tensor]:
    """run() on 1, 2 and 3 threads."""
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            results.append(run())
    finally:
        torch.set_num_threads(threads)
    return results


def _cut(attn, pieces: list[int]) -> StepAttention:
    """attn's one prompt as chunks of `pieces` rows, each over the pages its context needs."""
    whole = attn.prefills[0]
    split, start, context = [], whole.token_start, 0
    for rows in pieces:
        context += rows
        split.append(PrefillChunk(start, rows, context, whole.pages[:-(-context // PAGE)]))
        start += rows
    return StepAttention(write_slots=attn.write_slots, decode_rows=attn.decode_rows, decode_pages=attn.decode_pages,
                         decode_lens=attn.decode_lens, prefills=split)


def _bad_tables(q, k, v, chunks, pages, out) -> dict:
    """Chunk tables both kernels refuse (prefill_chunks.h), by the words of their refusal."""
    outside_pool = pages.clone()
    outside_pool[1, 1] = k.shape[1]
    return {
        "page": (q, k, v, chunks, outside_pool, out),
        "keys from a": (q, k, v, torch.tensor([[2, 20, 20], [22, 10, 40 + PAGE * 3]]), pages, out),
        "outside the step": (q, k, v, torch.tensor([[2, 20, 20], [q.shape[0] - 5, 10, 40]]), pages, out),
        "overlap": (q, k, v, torch.tensor([[2, 20, 20], [12, 10, 40]]), pages, out),
        "reads 5 keys": (q, k, v, torch.tensor([[2, 20, 20], [22, 10, 5]]), pages, out),
        "int64": (q, k, v, chunks.int(), pages, out),
    }


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernel_reads_only_its_keys_writes_only_its_rows_and_is_as_exact_as_torch(case, shape):
    q, k, v, attn = _case(CASES[case], shape)
    if _refused_without_amx(q, k, v, attn):
        return
    gold = _gold(q, k, v, attn)
    out = _kernel(q, k, v, attn, fill=7.0)
    rows = _chunk_rows(attn)
    assert torch.all(out[_outside(q, attn)] == 7.0), "the kernel wrote rows outside its chunks"
    assert torch.isfinite(out[rows]).all(), "a NaN slot outside the chunks' keys was read"
    kernel_error = (out[rows].double() - gold[rows]).abs().max().item()
    torch_error = (_torch_path(q, k, v, attn)[rows].double() - gold[rows]).abs().max().item()
    # Both round the output to bfloat16 (up to ~4e-3 here); the kernel also rounds the
    # probabilities to bfloat16 for the value product.
    assert kernel_error <= 2 * torch_error + 1e-3, (kernel_error, torch_error)


def test_same_bits_on_any_thread_count_and_for_any_split_into_chunks():
    q, k, v, attn = _case([(130, 130)], SHAPES[0], seed=3)
    if _refused_without_amx(q, k, v, attn):
        return
    results = _on_each_thread_count(lambda: _kernel(q, k, v, attn))
    assert all(torch.equal(r, results[0]) for r in results)
    # The same prompt as three chunks (50, 1 and 79 tokens) over the same pages, in one call.
    assert torch.equal(_kernel(q, k, v, _cut(attn, [50, 1, 79])), results[0])


def test_fused_ops_take_the_kernel_only_where_it_applies():
    fused = FusedOps(cpu_ops(), torch.bfloat16)
    assert fused.amx_prefill_for(64, PAGE, torch.bfloat16) == HAS_AMX and fused.amx_prefill_for(32, 2 * PAGE, torch.bfloat16) == HAS_AMX
    assert not fused.amx_prefill_for(128, PAGE, torch.bfloat16) and not fused.amx_prefill_for(64, 8, torch.bfloat16)
    assert not FusedOps(cpu_ops(), torch.float32).amx_prefill_for(64, PAGE, torch.bfloat16)
    # a float8 pool too (its pages widened first), never a float32 one
    assert fused.amx_prefill_for(64, PAGE, torch.float8_e4m3fn) == HAS_AMX
    assert not fused.amx_prefill_for(64, PAGE, torch.float32)
    assert FusedOps(cpu_ops(), torch.float32)._prefill_as_decode  # on AVX2 and AVX-512 builds alike
    assert not fused._prefill_as_decode  # bfloat16 never takes the float32 decode kernel
    assert fused.prefill_kernel_for(64, PAGE, torch.bfloat16) == ("AMX" if HAS_AMX else "")
    # float32 takes its own kernel wherever the CPU has AVX-512: any page size, 128 dims too
    f32 = FusedOps(cpu_ops(), torch.float32)
    for dim, page, pool in ((64, PAGE, torch.bfloat16), (128, 8, torch.float32), (32, PAGE, torch.float8_e4m3fn)):
        assert f32.prefill_kernel_for(dim, page, pool) == ("AVX-512 float32" if HAS_AVX512 else "")
    assert not f32.f32_prefill_for(48, torch.bfloat16) and not fused.f32_prefill_for(64, torch.bfloat16)
    q, k, v, attn = _case(CASES["a wave of prompts"], SHAPES[0], seed=4)
    out = torch.zeros_like(q)
    fused.prefill_attention(q, k, v, attn, SCALE, out)
    assert torch.equal(out, _kernel(q, k, v, attn) if HAS_AMX else _torch_path(q, k, v, attn))
    if HAS_AVX512:  # a 560-key chunk, which the decode kernel and torch's path would give other bits
        q, k, v, attn = _case(CASES["long"], SHAPES[0], seed=4)
        out = torch.zeros_like(q, dtype=torch.float32)
        f32.prefill_attention(q.float(), k, v, attn, SCALE, out)
        assert torch.equal(out, _f32_kernel(q.float(), k, v, attn))
    # A head of 128 dims: torch's path, whatever the CPU.
    q, k, v, attn = _case([(20, 20)], (4, 2, 128), seed=5)
    out = torch.zeros_like(q)
    fused.prefill_attention(q, k, v, attn, SCALE, out)
    assert torch.equal(out, _torch_path(q, k, v, attn))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_prefill_over_a_float8_pool_is_prefill_over_a_bfloat16_pool_of_its_values(case, shape):
    """A float8 pool (--kv-dtype float8_e4m3fn): in bfloat16 the pages the chunks read are
    widened exactly and go to the AMX kernel (torch's path without AMX), in float32 to the
    AVX-512 kernel the same way (without it, short chunks to the decode kernel and long ones to
    torch's path), and either way each chunk's output is that over a bfloat16 pool holding the
    same values: to the bit where a prefill kernel takes both, else to float32 rounding (the
    decode kernel's AVX2 version may sum in another order). The pool's other slots hold NaN, as
    in every case here: a read past a chunk's context would show."""
    f8 = torch.float8_e4m3fn
    q, k, v, attn = _case(CASES[case], shape, seed=9)
    k8, v8 = (k.clamp(-448, 448) * 8).to(f8), (v.clamp(-448, 448) * 8).to(f8)
    k16, v16 = k8.to(torch.bfloat16), v8.to(torch.bfloat16)  # exact: every e4m3 value is a bfloat16
    for dtype in (torch.bfloat16, torch.float32):
        fused = FusedOps(cpu_ops(), dtype)
        assert fused.amx_prefill_for(shape[2], PAGE, f8) == (HAS_AMX and dtype == torch.bfloat16)
        outs = {}
        for name, (kc, vc) in {"float8": (k8, v8), "bfloat16": (k16, v16)}.items():
            outs[name] = torch.full_like(q.to(dtype), 7.0)
            fused.prefill_attention(q.to(dtype), kc, vc, attn, SCALE, outs[name])
        rows = _chunk_rows(attn)
        assert torch.all(outs["float8"][_outside(q, attn)] == 7.0) and not outs["float8"][rows].isnan().any()
        if dtype == torch.bfloat16 or HAS_AVX512:
            assert torch.equal(outs["float8"], outs["bfloat16"])
        else:
            torch.testing.assert_close(outs["float8"], outs["bfloat16"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_short_chunks_as_decode_queries_read_only_their_keys_and_write_only_their_rows(case, shape):
    """float32 without AVX-512: chunks of at most SHORT_PREFILL_CONTEXT keys go through the
    decode kernel, a query row at a time with its causal length, in one call; longer ones
    through torch's path (with AVX-512 all of them through the float32 prefill kernel). Either
    way each chunk's causal attention to float32 rounding, from its own first `context` keys
    only (NaN everywhere else in the pool), into its own rows only."""
    q, k, v, attn = _case(CASES[case], shape, seed=8)
    q, k, v = q.float(), k.float(), v.float()
    fused = FusedOps(cpu_ops(), torch.float32)
    fused._f32_prefill = False  # this path, on an AVX-512 machine too
    short = attn.prefill_queries(SHORT_PREFILL_CONTEXT)
    assert all(c.context_len > SHORT_PREFILL_CONTEXT for c in short.longer)
    assert short.rows.numel() == sum(c.num_tokens for c in attn.prefills if c not in short.longer)
    out = torch.full_like(q, 7.0)
    fused.prefill_attention(q, k, v, attn, SCALE, out)
    chunk_rows = _chunk_rows(attn)
    assert torch.all(out[_outside(q, attn)] == 7.0)
    torch.testing.assert_close(out[chunk_rows].double(), _gold(q, k, v, attn)[chunk_rows], rtol=1e-5, atol=1e-5)


def test_kernel_refuses_what_it_cannot_take():
    q, k, v, attn = _case([(20, 20), (10, 40)], SHAPES[0], seed=6)
    chunks, pages = attn.prefill_tables()
    out = torch.zeros_like(q)
    bad = {
        **_bad_tables(q, k, v, chunks, pages, out),
        "bfloat16": (q.float(), k, v, chunks, pages, out),
        "head_dim": (q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(), chunks, pages,
                     out[..., :48].contiguous()),
        "multiple of 16 keys": (q, k.reshape(3, -1, 8, 64), v.reshape(3, -1, 8, 64), chunks, pages, out),
    }
    for what, args in bad.items():
        expected = what if HAS_AMX else "needs AMX"
        with pytest.raises(RuntimeError, match=expected):
            cpu_ops().prefill_attention(*args, SCALE)
    assert torch.all(out == 0)


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", F32_SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_kernel_reads_only_its_keys_writes_only_its_rows_to_float32_rounding(case, shape, pool):
    q, k, v, attn = _case(CASES[case], shape, seed=11)
    q, k, v = q.float(), k.to(pool), v.to(pool)
    if _f32_refused_without_avx512(q, k, v, attn):
        return
    out = _f32_kernel(q, k, v, attn, fill=7.0)
    rows = _chunk_rows(attn)
    assert torch.all(out[_outside(q, attn)] == 7.0), "the kernel wrote rows outside its chunks"
    assert torch.isfinite(out[rows]).all(), "a NaN slot outside the chunks' keys was read"
    torch.testing.assert_close(out[rows].double(), _gold(q, k, v, attn)[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pool", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", F32_SHAPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_float32_kernel_gives_each_query_the_decode_kernels_bits(case, shape, pool):
    """Each query row as the decode kernel computes it alone over its causal keys, to the bit:
    a one-token chunk runs as a decode row, and a sequence recomputed after preemption has its
    decoded tokens' KV rebuilt by prefill, so both paths must agree for the engine's tokens not
    to depend on how a prompt was scheduled (tests/test_engine_batching.py)."""
    q, k, v, attn = _case(CASES[case], shape, seed=13)
    q, k, v = q.float(), k.to(pool), v.to(pool)
    if _f32_refused_without_avx512(q, k, v, attn):
        return
    alone = attn.prefill_queries(max_context=10**9)  # every chunk's rows as single queries
    decode = cpu_ops().decode_attention(q[alone.rows], k, v, alone.pages, alone.lens, SCALE)
    assert torch.equal(_f32_kernel(q, k, v, attn)[alone.rows], decode)


def test_float32_kernel_gives_a_query_the_same_bits_on_any_thread_count_split_or_block():
    """A 600-token prompt whole, on 1, 2 and 3 threads, and cut into chunks whose rows start
    at other offsets in their 16-query blocks (50, 1, 200 and 349 tokens): every query's
    output to the bit, as an unsplit prefill's."""
    q, k, v, attn = _case([(600, 600)], SHAPES[0], seed=12)
    q = q.float()
    if _f32_refused_without_avx512(q, k, v, attn):
        return
    results = _on_each_thread_count(lambda: _f32_kernel(q, k, v, attn))
    assert all(torch.equal(r, results[0]) for r in results)
    assert torch.equal(_f32_kernel(q, k, v, _cut(attn, [50, 1, 200, 349])), results[0])


def test_float32_kernel_refuses_what_it_cannot_take():
    q, k, v, attn = _case([(20, 20), (10, 40)], SHAPES[0], seed=6)
    q = q.float()
    chunks, pages = attn.prefill_tables()
    out = torch.zeros_like(q)
    bad = {
        **_bad_tables(q, k, v, chunks, pages, out),
        "float32 CPU tensors": (q.bfloat16(), k, v, chunks, pages, out),
        "caches of one dtype": (q, k, v.float(), chunks, pages, out),
        "share memory": (q, k, v, chunks, pages, q),
        "head_dim 32, 64 or 128": (q[..., :48].contiguous(), k[..., :48].contiguous(), v[..., :48].contiguous(),
                                   chunks, pages, out[..., :48].contiguous()),
    }
    for what, args in bad.items():
        with pytest.raises(RuntimeError, match=what if HAS_AVX512 else "needs AVX-512"):
            cpu_ops().prefill_attention_f32(*args, SCALE)
    assert torch.all(out == 0)
