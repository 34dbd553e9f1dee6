"""The offline Python API, in the shape vLLM users know:

    from isoserve import LLM, SamplingParams
    llm = LLM(model="smollm2-135m-instruct", dtype="bfloat16")
    [r.text for r in llm.generate(["Hello"], SamplingParams(max_tokens=32))]
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from tqdm.auto import tqdm

from isoserve.config import EngineConfig
from isoserve.engine.engine import Engine
from isoserve.engine.sampling_params import SamplingParams
from isoserve.engine.sequence import TokenLogprob
from isoserve.errors import IsoserveError
from isoserve.model.registry import DEFAULT_MODEL


@dataclass
class CompletionResult:
    request_id: str
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] | None = None
    error: IsoserveError | None = None


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", device: str = "cpu",
                 kv_tokens: int | None = None, page_size: int = 16, **engine_options):
        self.engine = Engine(EngineConfig(model=model, dtype=dtype, device=device,
                                          kv_tokens=kv_tokens, page_size=page_size, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[CompletionResult]:
        """Prompts: a string, a list of token ids, or a list of either. One result per prompt,
        in order. A prompt that can never fit raises before anything runs."""
        prompt_ids = [self._token_ids(p) for p in _as_prompt_list(prompts)]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompt_ids)
        if len(params_list) != len(prompt_ids):
            raise ValueError("give one SamplingParams, or one per prompt")
        results: dict[str, CompletionResult] = {}
        order = []
        try:
            for ids, p in zip(prompt_ids, params_list):
                rid = f"llm-{next(self._ids)}"
                self.engine.add_request(rid, ids, p)
                results[rid] = CompletionResult(rid, ids, logprobs=[] if p.logprobs is not None else None)
                order.append(rid)
        except Exception:
            for rid in order:
                self.engine.abort(rid)
            self.engine.step()  # drain the abort outputs
            raise
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm)
        remaining = len(order)
        while remaining:
            for out in self.engine.step():
                r = results[out.request_id]
                r.token_ids += out.new_token_ids
                r.text += out.new_text
                if r.logprobs is not None:
                    r.logprobs += out.new_logprobs
                if out.finished:
                    r.finish_reason, r.error = out.finish_reason, out.error
                    remaining -= 1
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False):
        """One conversation (a list of messages) gives one result; a list of them, a list."""
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False)
                   for c in conversations]
        # The template already carries the special tokens; do not add a BOS again.
        ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        results = self.generate(ids, sampling_params, use_tqdm=use_tqdm)
        return results[0] if single else results

    def _token_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)
