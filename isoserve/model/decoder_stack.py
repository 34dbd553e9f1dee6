"""A decode step's decoder layers in one kernel call, where its projections all take the int8 kernels.

LlamaModel.forward's loop over its layers calls, per layer, the QKV projection, RoPE and the KV
write, decode attention, the O projection, the residual add and norm, the gate-up with SwiGLU,
the down projection and the next add and norm: ~8 kernel calls, with Python in between.
kernels/decoder_stack.cpp runs the same calls in the same order in C++ (the same bits; the
GIL released meanwhile). At batch 32 on a 2-core Zen 4, the interpreter and the calls' wrappers
were ~9% of a decode step on the main thread, with the OpenMP worker waiting on it
(docs/benchmarks.md, session 33).

It applies to steps with no prefill chunk, in float32 on the fused CPU kernels, where every
layer's projections multiply by the int8 block kernels for the step's rows and carry no bias
(the defaults for a Q4_1 GGUF on AVX2 and AVX512-VNNI CPUs without AMX). Any other step runs
the Python loop. The stack holds the KV pool's per-layer views, so it is built per pool.
"""
from __future__ import annotations

import torch

from isoserve.model.int8_blocks import Int8Q4SwigluWeight, Int8Q4Weight


def _int8_limit(projection, weight_type) -> int:
    """Most rows for which `projection` multiplies by its single int8 tier of `weight_type`; 0 when
    it has another form (other tiers, another kernel) or a bias (Qwen2's QKV: cfg.attention_bias)."""
    if projection.bias is not None or len(projection.tiers) != 1:
        return 0
    rows, weight = projection.tiers[0]
    return rows if type(weight) is weight_type else 0


def stack_rows(model) -> int:
    """Most rows a decode step may have for the stack to run it: 0 where it does not apply."""
    kernels = getattr(model.ops, "kernels", None)
    if kernels is None or model.dtype != torch.float32:
        return 0
    limits = [min(_int8_limit(layer.qkv, Int8Q4Weight), _int8_limit(layer.o, Int8Q4Weight),
                  _int8_limit(layer.gate_up, Int8Q4SwigluWeight), _int8_limit(layer.down, Int8Q4Weight))
              for layer in model.layers]
    return min(limits, default=0)


def build_stack(model, pool):
    """The kernels' DecoderStack over `model`'s layers and `pool`'s per-layer caches; a
    ValueError where stack_rows says it does not apply (the kernels cannot tell weights in
    another layout from theirs)."""
    if stack_rows(model) <= 0:
        raise ValueError("the decoder stack runs float32 layers whose projections all take the int8 "
                         "Q4_1 kernels with no bias; this model's do not")
    layers = []
    for i, layer in enumerate(model.layers):
        k_cache, v_cache = pool.layer_cache(i)
        qkv, o = layer.qkv.tiers[0][1], layer.o.tiers[0][1]
        gate_up, down = layer.gate_up.tiers[0][1], layer.down.tiers[0][1]
        layers.append([layer.input_norm, qkv.codes, qkv.d, qkv.m, o.codes, o.d, o.m, layer.post_norm,
                       gate_up.codes, gate_up.d, gate_up.m, down.codes, down.d, down.m, k_cache, v_cache])
    return model.ops.kernels.DecoderStack(layers, model.cfg.num_heads, model.cfg.rms_norm_eps)
