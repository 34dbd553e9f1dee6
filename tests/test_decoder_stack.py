"""The decode step's layers in one kernel call (model/decoder_stack.py, kernels/decoder_stack.cpp)
against LlamaModel.forward's Python loop over the same kernels: the same logits and the same KV
pool, bit for bit, step after step, over each KV pool dtype; only decode-only steps within its
rows take it; models it cannot run never reach it; it refuses what the kernels refuse. A tiny
random Llama as a Q4_1 GGUF in float32, whose projections multiply by the int8 block kernels
wherever they run (AVX2 or AVX512-VNNI)."""
from __future__ import annotations

import pytest
import torch

from isoserve.config import EngineConfig
from isoserve.engine.engine import Engine
from isoserve.engine.sampling_params import SamplingParams
from isoserve.model.decoder_stack import build_stack, stack_rows
from isoserve.model.loader import load_checkpoint

from tiny_models import HAS_AVX2, NEEDS_AVX2

# 12 sequences: a decode step of more rows than one tile holds (8 on AVX512-VNNI, 4 on AVX2), so
# the tiles read gathered pairs of panels and prefetch the next pair (int8_matmul.cpp).
PROMPTS = [[1, 9, 33, 7, 250, 12], [1, 4000, 17], list(range(100, 141)), [1, 2, 3, 4, 5, 6, 7, 8, 9],
           [5] * 20, list(range(3000, 3033, 3)), [1, 77], list(range(500, 530)), [42] * 7,
           [1, 11, 111, 1111], list(range(60, 77)), [9, 8, 7, 6, 5]]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tiny_q4_1, tiny_cache):
    return load_checkpoint(str(tiny_q4_1), torch.float32, tiny_cache)


def _engine(checkpoint, tiny_q4_1, *, stack: bool = True, kv_dtype: str = "bfloat16", **options) -> Engine:
    engine = Engine(EngineConfig(model=str(tiny_q4_1), dtype="float32", kv_dtype=kv_dtype, page_size=16,
                                 kv_tokens=4096, **options), checkpoint=checkpoint)
    if not stack:
        engine.model.decoder_stack_rows = 0
    return engine


def _recording(engine: Engine) -> list[tuple[int, bool, torch.Tensor]]:
    """Records each forward's (rows, whether the stack ran it, logits)."""
    model, calls = engine.model, []
    forward, stack_for = model.forward, model._decoder_stack
    used = []

    def counted_stack(pool):
        used.append(True)
        return stack_for(pool)

    def recorded(token_ids, *args, **kwargs):
        used.clear()
        logits = forward(token_ids, *args, **kwargs)
        calls.append((token_ids.shape[0], bool(used), logits.clone()))
        return logits

    model._decoder_stack = counted_stack
    model.forward = recorded
    return calls


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@NEEDS_AVX2
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn", "float32"])
def test_stack_gives_the_python_loops_logits_and_kv(checkpoint, tiny_q4_1, kv_dtype):
    fast = _engine(checkpoint, tiny_q4_1, kv_dtype=kv_dtype)
    slow = _engine(checkpoint, tiny_q4_1, stack=False, kv_dtype=kv_dtype)
    assert fast.model.decoder_stack_rows > len(PROMPTS)
    calls = {}
    for name, engine in (("fast", fast), ("slow", slow)):
        calls[name] = _recording(engine)
        for i, prompt in enumerate(PROMPTS):  # seeded sampled requests among greedy ones
            params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8 if i % 4 == 0 else 0.0, seed=7 + i,
                                    ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
    tokens = {"fast": {}, "slow": {}}
    finished = 0
    while finished < len(PROMPTS):
        for name, engine in (("fast", fast), ("slow", slow)):
            for out in engine.step():
                assert out.error is None
                tokens[name].setdefault(out.request_id, []).extend(out.new_token_ids)
                finished += out.finished and name == "fast"
        assert torch.equal(_bits(fast.pool.kv), _bits(slow.pool.kv))
    assert tokens["fast"] == tokens["slow"]
    assert all(len(t) == NEW_TOKENS for t in tokens["fast"].values())
    assert len(calls["fast"]) == len(calls["slow"])
    for (rows, used, logits), (rows_slow, used_slow, logits_slow) in zip(calls["fast"], calls["slow"]):
        assert rows == rows_slow and not used_slow
        assert torch.equal(_bits(logits), _bits(logits_slow))
    # The first step prefills every prompt: the loop; the decode-only steps after it: the stack,
    # at 12 rows.
    assert not calls["fast"][0][1]
    assert sum(used and rows == len(PROMPTS) for rows, used, _ in calls["fast"]) >= NEW_TOKENS - 2


@NEEDS_AVX2
def test_only_decode_steps_within_its_rows_take_the_stack(checkpoint, tiny_q4_1):
    engine = _engine(checkpoint, tiny_q4_1)
    engine.model.decoder_stack_rows = 2
    calls = _recording(engine)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.add_request("a", PROMPTS[0], params)
    engine.add_request("b", PROMPTS[1], params)
    engine.step()                      # both prompts: prefill, the loop
    engine.step()                      # two decodes: the stack
    engine.add_request("c", PROMPTS[2], params)
    engine.step()                      # two decodes and a prefill chunk: the loop
    engine.step()                      # three decodes, more than its 2 rows: the loop
    assert [(rows, used) for rows, used, _ in calls] == [
        (len(PROMPTS[0]) + len(PROMPTS[1]), False), (2, True), (2 + len(PROMPTS[2]), False), (3, False)]


@NEEDS_AVX2
def test_models_it_cannot_run_never_reach_it(checkpoint, tiny_q4_1, tiny_checkpoint):
    # Steps above --int4-max-rows multiply by the dense weight: the stack stops there.
    limited = _engine(checkpoint, tiny_q4_1, int4_max_rows=3)
    assert limited.model.decoder_stack_rows == 3
    limited.model.decoder_stack_rows = 1000  # may only be lowered
    assert limited.model.decoder_stack_rows == 3
    # Other forms of the projections, other dtypes, torch ops: never.
    for options in ({"int8_activations": False}, {"fused_kernels": False}):
        other = _engine(checkpoint, tiny_q4_1, **options)
        assert other.model.decoder_stack_rows == 0
        with pytest.raises(ValueError, match="int8 Q4_1 kernels"):
            build_stack(other.model, other.pool)
    bf16 = Engine(EngineConfig(model=str(tiny_q4_1), dtype="bfloat16", kv_tokens=1024), checkpoint=tiny_checkpoint)
    assert bf16.model.decoder_stack_rows == 0
    # A bias on a projection (Qwen2's QKV) is work the stack does not do.
    engine = _engine(checkpoint, tiny_q4_1)
    assert stack_rows(engine.model) > 0
    engine.model.layers[1].qkv.bias = torch.zeros(engine.model.layers[1].qkv.out_features)
    assert stack_rows(engine.model) == 0


def test_the_stack_runs_exactly_where_the_int8_kernels_do(checkpoint, tiny_q4_1):
    # Without AVX2 the projections take other kernels, and every step the Python loop.
    assert (_engine(checkpoint, tiny_q4_1).model.decoder_stack_rows > 0) == HAS_AVX2


@NEEDS_AVX2
def test_stack_refuses_what_the_kernels_refuse(checkpoint, tiny_q4_1):
    engine = _engine(checkpoint, tiny_q4_1)
    model, pool = engine.model, engine.pool
    stack = build_stack(model, pool)
    assert stack.num_layers == model.cfg.num_layers
    DecoderStack = model.ops.kernels.DecoderStack
    with pytest.raises(RuntimeError, match="has 15 tensors, not 16"):
        DecoderStack([[model.layers[0].input_norm] * 15], model.cfg.num_heads, 1e-5)
    with pytest.raises(RuntimeError, match="heads must be positive"):
        DecoderStack([[model.layers[0].input_norm] * 16], 0, 1e-5)
    with pytest.raises(RuntimeError, match="at least one layer"):
        DecoderStack([], model.cfg.num_heads, 1e-5)

    rows, hidden = 2, model.cfg.hidden_size
    x = torch.randn(rows, hidden)
    h = model.ops.rms_norm(x, model.layers[0].input_norm, model.cfg.rms_norm_eps)
    cos, sin = model.rope.tables(torch.tensor([3, 5]))
    slots = torch.tensor([3, pool.page_size + 5])
    lens = torch.tensor([4, 6])
    num_pages = pool.kv.shape[3]
    before = pool.kv.clone()
    # A write slot past the pool: refused before anything is written.
    with pytest.raises(RuntimeError, match=f"KV slot {num_pages * pool.page_size} is outside the pool"):
        stack.decode(x.clone(), h, cos, sin, torch.tensor([3, num_pages * pool.page_size]),
                     torch.tensor([[0], [1]]), lens, model.scale)
    assert torch.equal(_bits(pool.kv), _bits(before))
    # A page table naming a page past the pool: refused before any key is read.
    with pytest.raises(RuntimeError, match=f"page {num_pages} is outside the pool"):
        stack.decode(x.clone(), h, cos, sin, slots, torch.tensor([[0], [num_pages]]), lens, model.scale)


@NEEDS_AVX2
def test_the_keys_it_requests_ahead_are_those_attention_reads(checkpoint, tiny_q4_1):
    # While a layer's down projection runs, the stack requests the next layer's keys into cache
    # (kernels/line_prefetch.h): exactly the lines of keys [0, len) of each sequence and KV head,
    # in attention's order, through pages in runs and scattered, full and partial.
    engine = _engine(checkpoint, tiny_q4_1)
    model, pool = engine.model, engine.pool
    stack = build_stack(model, pool)
    k_cache, _ = pool.layer_cache(0)
    kv_heads, num_pages, page_size, dim = k_cache.shape
    key_bytes = dim * k_cache.element_size()
    pages = torch.tensor([[5, 6, 9, 2], [7, 8, 0, 0], [3, 1, 4, 0], [11, 0, 0, 0]])
    lens = torch.tensor([3 * page_size + 12, page_size + 1, 2 * page_size + 1, 1])
    expected = []
    for b in range(len(lens)):
        for h in range(kv_heads):
            for t in range(int(lens[b])):
                offset = ((h * num_pages + int(pages[b, t // page_size])) * page_size + t % page_size) * key_bytes
                for line in range(offset // 64, (offset + key_bytes - 1) // 64 + 1):
                    if not expected or expected[-1] != line:
                        expected.append(line)
    ranges = stack.planned_key_lines(pages, lens).tolist()
    planned = [first // 64 + i for first, lines in ranges for i in range(lines)]
    assert planned == expected
    # Pages 5 and 6 are one run: one range for them; 9 and 2 are each their own.
    assert len(ranges) < sum(-(-int(n) // page_size) for n in lens) * kv_heads
    # A page past the pool is refused before any address is formed from it.
    with pytest.raises(RuntimeError, match=f"page {num_pages} is outside the pool"):
        stack.planned_key_lines(torch.tensor([[0, num_pages]]), torch.tensor([page_size + 1]))
    with pytest.raises(RuntimeError, match="reads 65 keys from a 4-page table"):
        stack.planned_key_lines(pages[:1], torch.tensor([4 * page_size + 1]))
