"""The decode step's layers in one kernel call (model/decoder_stack.py, kernels/decoder_stack.cpp)
against LlamaModel.forward's Python loop over the same kernels: the same logits and the same KV
pool, bit for bit, step after step; only decode-only steps within its rows take it; it refuses
what the kernels refuse. A tiny random Llama as a Q4_1 GGUF in float32, whose projections
multiply by the int8 block kernels wherever they run (AVX2 or AVX512-VNNI)."""
from __future__ import annotations

import pytest
import torch

from isoserve.config import EngineConfig
from isoserve.engine.engine import Engine
from isoserve.engine.sampling_params import SamplingParams
from isoserve.model.loader import load_checkpoint

PROMPTS = [[1, 9, 33, 7, 250, 12], [1, 4000, 17], list(range(100, 141)), [1, 2, 3, 4, 5, 6, 7, 8, 9]]


@pytest.fixture(scope="module")
def checkpoint(tiny_q4_1, tiny_cache):
    return load_checkpoint(str(tiny_q4_1), torch.float32, tiny_cache)


def _engine(checkpoint, tiny_q4_1, *, stack: bool) -> Engine:
    engine = Engine(EngineConfig(model=str(tiny_q4_1), dtype="float32", kv_dtype="bfloat16", page_size=16,
                                 kv_tokens=2048), checkpoint=checkpoint)
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


def _stack_applies(engine: Engine) -> bool:
    kernels = getattr(engine.model.ops, "kernels", None)
    return kernels is not None and kernels.int8_status() == ""


def test_stack_gives_the_python_loops_logits_and_kv(checkpoint, tiny_q4_1):
    fast, slow = _engine(checkpoint, tiny_q4_1, stack=True), _engine(checkpoint, tiny_q4_1, stack=False)
    if not _stack_applies(fast):
        assert fast.model.decoder_stack_rows == 0  # no int8 kernels here: every step runs the loop
        return
    assert fast.model.decoder_stack_rows > len(PROMPTS)
    calls = {}
    for name, engine in (("fast", fast), ("slow", slow)):
        calls[name] = _recording(engine)
        for i, prompt in enumerate(PROMPTS):  # a seeded sampled request among greedy ones
            params = SamplingParams(max_tokens=24, temperature=0.0 if i else 0.8, seed=7, ignore_eos=True)
            engine.add_request(f"r{i}", prompt, params)
    tokens = {"fast": {}, "slow": {}}
    finished = 0
    while finished < len(PROMPTS):
        for name, engine in (("fast", fast), ("slow", slow)):
            for out in engine.step():
                assert out.error is None
                tokens[name].setdefault(out.request_id, []).extend(out.new_token_ids)
                finished += out.finished and name == "fast"
        assert torch.equal(fast.pool.kv.view(torch.int16), slow.pool.kv.view(torch.int16))
    assert tokens["fast"] == tokens["slow"]
    assert all(len(t) == 24 for t in tokens["fast"].values())
    assert len(calls["fast"]) == len(calls["slow"])
    for (rows, used, logits), (rows_slow, used_slow, logits_slow) in zip(calls["fast"], calls["slow"]):
        assert rows == rows_slow and not used_slow
        assert torch.equal(logits.view(torch.int32), logits_slow.view(torch.int32))
    # The first step prefills every prompt: the loop; the decode-only steps after it: the stack.
    assert not calls["fast"][0][1]
    assert sum(used for _, used, _ in calls["fast"]) >= 20


def test_only_decode_steps_within_its_rows_take_the_stack(checkpoint, tiny_q4_1):
    engine = _engine(checkpoint, tiny_q4_1, stack=True)
    if not _stack_applies(engine):
        assert engine.model.decoder_stack_rows == 0
        return
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


def test_stack_refuses_what_the_kernels_refuse(checkpoint, tiny_q4_1):
    engine = _engine(checkpoint, tiny_q4_1, stack=True)
    if not _stack_applies(engine):
        assert engine.model.decoder_stack_rows == 0
        return
    from isoserve.model.decoder_stack import build_stack
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
    assert torch.equal(pool.kv.view(torch.int16), before.view(torch.int16))
    # A page table naming a page past the pool: refused before any key is read.
    with pytest.raises(RuntimeError, match=f"page {num_pages} is outside the pool"):
        stack.decode(x.clone(), h, cos, sin, slots, torch.tensor([[0], [num_pages]]), lens, model.scale)
