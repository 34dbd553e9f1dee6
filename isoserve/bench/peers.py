"""The engines the offline benchmark times, each behind `generate(prompts, new_tokens) -> tokens`.

All are greedy and run every prompt to exactly `new_tokens` new tokens, so their output token
counts are equal and tokens/s compare like with like.

    isoserve        LLM.generate (continuous batching over the paged KV cache), ignore_eos
    transformers    model.generate: static batching, left padding, min_new_tokens=max_new_tokens
    generate_batch  transformers' own continuous batching, EOS disabled; its KV cache sized
                    for the prompts and its per-step token budget that of isoserve's engine
                    (512), not the gigabytes it would size for a GPU; no warm-up pass inside
                    the timed call (ours runs once before, as for every peer)
"""
from __future__ import annotations

import logging

import torch

from isoserve.model.registry import resolve_model


class IsoservePeer:
    name = "isoserve"

    def __init__(self, llm):
        self.llm = llm

    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        from isoserve import SamplingParams
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        results = self.llm.generate(prompts, params)
        failed = [r.error for r in results if r.error is not None]
        if failed:
            raise RuntimeError(f"isoserve failed {len(failed)} prompt(s): {failed[0]}")
        return sum(len(r.token_ids) for r in results)


class TransformersPeer:
    name = "transformers"

    def __init__(self, model, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, prompt in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[row, width - len(prompt):] = torch.tensor(prompt)
            mask[row, width - len(prompt):] = 1
        ids, mask = ids.to(self.model.device), mask.to(self.model.device)
        out = self.model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  pad_token_id=self.pad_token_id)
        return (out.shape[1] - width) * len(prompts)


class GenerateBatchPeer:
    name = "generate_batch"
    page_size, max_batch_tokens = 256, 512

    def __init__(self, model, pad_token_id: int):
        self.model = model
        self.pad_token_id = pad_token_id
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.WARNING)  # a line per call

    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], new_tokens: int) -> int:
        from transformers import GenerationConfig
        config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                                  pad_token_id=self.pad_token_id)
        try:
            from transformers import ContinuousBatchingConfig
        except ImportError:  # older transformers: its own sizing
            batching = None
        else:
            pages = sum(-(-(len(p) + new_tokens) // self.page_size) for p in prompts)
            batching = ContinuousBatchingConfig(page_size=self.page_size, num_blocks=pages + 4,
                                                max_batch_tokens=self.max_batch_tokens)
        outputs = self.model.generate_batch(inputs=prompts, generation_config=config,
                                            continuous_batching_config=batching,
                                            progress_bar=False, warmup=False)
        errors = [o.error for o in outputs.values() if o.error]
        if errors:
            raise RuntimeError(f"generate_batch failed: {errors[0]}")
        return sum(len(o.generated_tokens) for o in outputs.values())


def load_reference_model(model: str, dtype: torch.dtype):
    """transformers' own model for the same weights: from the same GGUF, or the same folder."""
    from transformers import AutoModelForCausalLM
    source = resolve_model(model)
    if source.kind == "gguf":
        ref = AutoModelForCausalLM.from_pretrained(source.path.parent, gguf_file=source.path.name,
                                                   dtype=dtype, local_files_only=True)
    else:
        ref = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, local_files_only=True)
    return ref.eval()
