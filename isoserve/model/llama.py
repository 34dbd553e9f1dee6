"""Llama-family decoder (Llama, Mistral, Qwen2 shapes) over the paged KV pool.

Plain tensors and functions: merged QKV and gate-up projections, GQA, RoPE, RMSNorm, SwiGLU,
tied embeddings. One forward runs a whole scheduler step (decodes and prefill chunks together);
a decode-only step of a float32 model whose projections all take the int8 Q4_1 kernels, with no
bias, runs its layers in one C++ call (model/decoder_stack.py): the same kernels in the same
order as the loop here.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from isoserve.kv.pool import KVPool
from isoserve.model.config import ModelConfig
from isoserve.model import int4, q8_0
from isoserve.model.decoder_stack import build_stack, stack_rows
from isoserve.model.layer_ops import select_ops
from isoserve.model.projection import Projection
from isoserve.model.quantized import EVERY_STEP, q4_tiers, q8_tiers, require_int8_activations
from isoserve.model.paged_attention import StepAttention, paged_attention
from isoserve.model.rope import RotaryEmbedding


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Projection
    o: Projection
    post_norm: torch.Tensor
    gate_up: Projection
    down: Projection


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu", max_positions: int | None = None,
                 int4_max_rows: int | None = None, fused_kernels: bool = True,
                 int8_activations: bool | None = None):
        """int4_max_rows: steps of at most this many tokens multiply by the companions of Q4_1
        projections (and, on AMX, of a Q8_0 LM head) where the checkpoint has them; bfloat16 on
        CPU only. None: the defaults of the kernels this machine runs (model/quantized.py).
        fused_kernels: run the work between matmuls as fused CPU kernels where they apply
        (model/layer_ops.py, and the AMX matmul); `self.ops_note` says why not otherwise.
        int8_activations: in float32, those blocks multiply the activations quantized to int8
        (model/int8_blocks.py); None: wherever that kernel runs, True: a ValueError where not."""
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops, self.ops_note = select_ops(self.device, dtype, fused_kernels)
        if self.device.type != "cpu":
            int4_max_rows = 0
        if int8_activations:
            why = require_int8_activations(dtype, self.ops.kernels, int4_max_rows)
            if why:
                raise ValueError(f"int8 activations cannot run here: {why}")
        self.quantized_paths: Counter[str] = Counter()  # kernels and their row limits: projections

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"checkpoint has no tensor {name!r}")
            return weights[name].to(device=self.device, dtype=dtype).contiguous()

        def projection(names: list[str], bias: torch.Tensor | None = None, gate_up: bool = False) -> Projection:
            """One matmul for the projections in `names`, stacked by output rows."""
            full = torch.cat([w(n) for n in names]).contiguous()
            tiers = []
            if all(int4.has_companions(weights, n) for n in names):
                tiers = q4_tiers([tuple(weights[n + s] for s in int4.COMPANIONS) for n in names],
                                 dtype, self.ops.kernels, int4_max_rows, int8_activations, gate_up=gate_up)
            return self._projection(full, bias, tiers)

        self.embed = w("model.embed_tokens.weight")
        self.final_norm = w("model.norm.weight")
        head = "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"
        head_tiers = []
        if q8_0.has_companions(weights, head):
            head_tiers = q8_tiers(weights[head + q8_0.CODES], weights[head + q8_0.SCALE], dtype,
                                  self.ops.kernels, int4_max_rows, int8_activations)
        self.lm_head = self._projection(self.embed if cfg.tie_word_embeddings else w(head), None, head_tiers,
                                        "LM head ")
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            qkv_names = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([w(p + f"self_attn.{x}_proj.bias") for x in "qkv"])
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=projection(qkv_names, bias),
                o=projection([p + "self_attn.o_proj.weight"]),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=projection([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], gate_up=True),
                down=projection([p + "mlp.down_proj.weight"]),
            ))
        self.quantized_projections = sum(self.quantized_paths.values())
        self.rope = RotaryEmbedding(cfg, max_positions or cfg.max_position_embeddings, dtype, self.device)
        self.scale = cfg.head_dim ** -0.5
        self._q_size = cfg.num_heads * cfg.head_dim
        self._stack_rows_limit = stack_rows(self)  # what the layers allow (model/decoder_stack.py)
        self.decoder_stack_rows = self._stack_rows_limit
        self._stack: tuple[KVPool, object] | None = None  # (the pool it was built for, the stack)

    @property
    def decoder_stack_rows(self) -> int:
        """Decode-only steps of at most this many rows run the layers in one kernel call
        (model/decoder_stack.py); 0: never."""
        return self._decoder_stack_rows

    @decoder_stack_rows.setter
    def decoder_stack_rows(self, rows: int) -> None:
        # Only ever lowered below what the layers allow (tests turn it off to compare the two
        # ways): above it the stack would hand the int8 kernels weights in another form.
        self._decoder_stack_rows = max(0, min(rows, self._stack_rows_limit))

    def _projection(self, weight: torch.Tensor, bias: torch.Tensor | None, tiers: list, what: str = "") -> Projection:
        if tiers:
            ways = ", ".join(f"{q.name} for " + ("every step" if rows >= EVERY_STEP else f"steps of <= {rows} tokens")
                             for rows, q in tiers)
            self.quantized_paths[what + ways] += 1
        return Projection(weight, bias, tiers)

    @torch.inference_mode()
    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attn: StepAttention,
                pool: KVPool, logits_rows: torch.Tensor) -> torch.Tensor:
        """Run one step; writes each token's K/V into the pool and returns the logits, in the
        model's dtype, for the rows in `logits_rows` only (the tokens that will be sampled).
        The sampler converts to float32 only the rows that need more than an argmax."""
        cfg, ops, eps = self.cfg, self.ops, self.cfg.rms_norm_eps
        x = F.embedding(token_ids, self.embed)  # the residual stream, updated in place
        cos, sin = self.rope.tables(positions)
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        if not attn.prefills and token_ids.shape[0] <= self.decoder_stack_rows:
            # The loop below, in C++: the same kernels in the same order.
            self._decoder_stack(pool).decode(x, h, cos, sin, attn.write_slots, attn.decode_pages, attn.decode_lens,
                                             self.scale)
            return self._logits(x, logits_rows)
        # Keep this loop in step with kernels/decoder_stack.cpp, and decoder_stack.stack_rows with
        # what that copy of it can run.
        for i, layer in enumerate(self.layers):
            k_cache, v_cache = pool.layer_cache(i)
            q = ops.rotary_store(layer.qkv(h), cos, sin, k_cache, v_cache, attn.write_slots, cfg.num_heads)
            a = paged_attention(q, k_cache, v_cache, attn, self.scale, ops.decode_attention, ops.prefill_attention)
            h = ops.add_rms_norm(x, layer.o(a.reshape(-1, self._q_size)), layer.post_norm, eps)
            mlp = layer.down(layer.gate_up.swiglu(h, ops.silu_mul))
            if i + 1 < len(self.layers):  # the residual add, fused with the next layer's norm
                h = ops.add_rms_norm(x, mlp, self.layers[i + 1].input_norm, eps)
            else:
                x.add_(mlp)
        return self._logits(x, logits_rows)

    def _logits(self, x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ops.rms_norm(x[rows], self.final_norm, self.cfg.rms_norm_eps))

    def _decoder_stack(self, pool: KVPool):
        if self._stack is None or self._stack[0] is not pool:
            self._stack = pool, build_stack(self, pool)
        return self._stack[1]
