"""The engine: requests in, a step at a time, tokens out.

    add_request -> Scheduler.schedule -> ModelRunner.execute (guard -> model -> pool) -> outputs

One engine owns one KV pool and is driven by one thread (the LLM API, or a worker's loop).
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from isoserve.admission import check_prompt_fits, effective_prompt_limit
from isoserve.config import AutoInputs, EngineConfig, dtype_name, parse_dtype, parse_kv_dtype
from isoserve.engine.runner import ModelRunner
from isoserve.engine.sampling_params import SamplingParams
from isoserve.engine.scheduler import Scheduler
from isoserve.engine.sequence import Sequence, Status, TokenLogprob
from isoserve.engine.deadlines import Deadlines
from isoserve.engine.detokenizer import Detokenizer
from isoserve.errors import (GenerationTimeout, InvalidRequest, IsoserveError, KVIsolationViolation,
                             QueueTimeout)
from isoserve.kv.allocator import PageAllocator
from isoserve.kv.pool import KVPool
from isoserve.model.llama import LlamaModel
from isoserve.model.loader import Checkpoint, load_checkpoint

log = logging.getLogger("isoserve.engine")


@dataclass
class RequestOutput:
    """What a request produced since its previous output."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob | None]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    error: IsoserveError | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


@dataclass
class EngineStats:
    counters: Counter = field(default_factory=Counter)  # guard_violations, preemptions, steps, ...


class Engine:
    def __init__(self, config: EngineConfig, checkpoint: Checkpoint | None = None):
        if config.stream_interval < 1:  # before minutes of loading, not after
            raise ValueError(f"stream_interval must be >= 1, got {config.stream_interval}")
        self.config = config
        auto = AutoInputs.of(config)
        dtype = parse_dtype(config.dtype, config.device, auto)
        kv_dtype = parse_kv_dtype(config.kv_dtype, config.dtype, config.device, auto)
        t0 = time.perf_counter()
        ckpt = checkpoint or load_checkpoint(config.model, dtype, cache_dir=config.cache_dir)
        self.model_name = ckpt.name
        self.model_config = ckpt.config
        self.tokenizer = ckpt.tokenizer
        self.detokenizer = Detokenizer(self.tokenizer)
        model_context = ckpt.config.max_position_embeddings
        self.context_length = config.context_length or model_context
        if self.context_length > model_context:
            raise ValueError(f"context length {self.context_length} exceeds the model's {model_context}")
        num_pages = KVPool.pages_for(ckpt.config, config.page_size, kv_dtype,
                                     **config.pool_tokens_request(self.context_length))
        self.pool = KVPool(ckpt.config, num_pages, config.page_size, kv_dtype, config.device)
        self.allocator = PageAllocator(self.pool, scrub_freed_pages=config.scrub_freed_pages)
        self.model = LlamaModel(ckpt.config, ckpt.weights, dtype, config.device,
                                max_positions=self.context_length, int4_max_rows=config.int4_max_rows,
                                int8_activations=config.int8_activations, fused_kernels=config.fused_kernels)
        self.scheduler = Scheduler(self.allocator, config.page_size, config.max_num_seqs,
                                   config.max_batched_tokens)
        self.runner = ModelRunner(self.model, self.pool,
                                  check_writer_tags="writer_tags" not in config.disabled_guards)
        self.eos_token_ids = set(ckpt.config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.requests: dict[str, Sequence] = {}
        self.stats = EngineStats()
        self._tags = itertools.count(1)  # 0 is UNWRITTEN
        self._arrivals = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        log.info("engine ready: model=%s dtype=%s device=%s pool=%d pages x %d tokens = %d tokens "
                 "(%.1f MiB, %s) context=%d quantized=%s layers=%s (%.1fs)", self.model_name, dtype_name(dtype),
                 config.device, num_pages, config.page_size, self.pool.capacity_tokens, self.pool.nbytes / 2**20,
                 dtype_name(kv_dtype),
                 self.context_length, self._quantized_summary(), self._ops_summary(),
                 time.perf_counter() - t0)

    def _quantized_summary(self) -> str:
        if not self.model.quantized_projections:
            return "off"
        paths = "; ".join(f"{n} x {path}" for path, n in self.model.quantized_paths.items())
        if any("int8" in path for path in self.model.quantized_paths):  # which tiles: AVX2's or AVX512-VNNI's
            paths += f" (int8 tiles: {self.model.ops.kernels.int8_isa()})"
        return paths

    def _ops_summary(self) -> str:
        note = self.model.ops_note
        ops = self.model.ops
        kernel = ops.prefill_kernel_for(self.model.cfg.head_dim, self.pool.page_size, self.pool.kv.dtype)
        details = f", prefill attention on {kernel}" if kernel else ""
        if self.pool.kv.dtype == torch.float8_e4m3fn and ops.kernels is not None and not ops.kernels.fast_fp8_kv:
            details += ", float8 KV widened without AVX-512 (its attention slower than a bfloat16 pool's)"
        if self.model.decoder_stack_rows:
            details += ", a decode step's layers in one call"
        return ops.name + details + (f" ({note})" if note else "")

    # ---- limits -------------------------------------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.pool.capacity_tokens

    def prompt_limit(self, max_tokens: int) -> int:
        """What this engine alone can hold: the engine's own "cannot fit" bound."""
        return effective_prompt_limit(self.context_length, [self.capacity_tokens],
                                      [self.capacity_tokens], max_tokens)

    # ---- requests -----------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    *, keep_kv_on_finish: bool = False, deadlines: Deadlines | None = None) -> Sequence:
        seq = self._new_sequence(request_id, prompt_token_ids, params, deadlines)
        check_prompt_fits(len(prompt_token_ids), self.prompt_limit(params.max_tokens), params.max_tokens)
        seq.keep_kv_on_finish = keep_kv_on_finish
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def _new_sequence(self, request_id: str, prompt_token_ids: list[int],
                      params: SamplingParams, deadlines: Deadlines | None) -> Sequence:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        vocab = self.model_config.vocab_size
        if any(not (0 <= t < vocab) for t in prompt_token_ids):
            raise InvalidRequest(f"prompt has token ids outside the vocabulary [0, {vocab})",
                                 param="prompt")
        queue_deadline, generation_deadline = (deadlines or Deadlines()).instants()
        return Sequence(request_id=request_id, tag=next(self._tags),
                        prompt_token_ids=list(prompt_token_ids), params=params,
                        arrival=next(self._arrivals), queue_deadline=queue_deadline,
                        generation_deadline=generation_deadline)

    # ---- decode side of a disaggregated request -----------------------------------------
    def reserve(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                deadlines: Deadlines | None = None) -> Sequence:
        """Allocate pages for a prompt whose KV will arrive by transfer. The prompt (and so its
        length) comes from the router, never from the sender of the KV. Raises OutOfPages."""
        seq = self._new_sequence(request_id, prompt_token_ids, params, deadlines)
        check_prompt_fits(len(prompt_token_ids), self.prompt_limit(params.max_tokens), params.max_tokens)
        pages, epochs = self.allocator.allocate(-(-len(prompt_token_ids) // self.pool.page_size))
        seq.pages, seq.page_epochs = pages, epochs
        seq.status = Status.AWAITING_KV
        self.requests[request_id] = seq
        return seq

    def start_decoding(self, seq: Sequence, first_token: int, first_logprob: TokenLogprob | None) -> None:
        """The verified transfer filled the prompt's pages: decode from the first token on."""
        seq.num_computed = len(seq.prompt_token_ids)
        self.scheduler.add_running(seq)
        self._append_token(seq, first_token, first_logprob)
        if not seq.finished:
            self._pending_outputs.append(self._output(seq))

    def check_owned(self, seq: Sequence, upto: int):
        """The read guard for one sequence over positions [0, upto); a Violation or None."""
        if not self.runner.check_writer_tags:
            return None
        found = self.runner.guard_sequences([seq], [upto])
        if found:
            self.stats.counters["guard_violations"] += 1
            return found[0][1]
        return None

    def abort(self, request_id: str) -> bool:
        """End a request now; its pages go back at once (epochs fence any late write)."""
        seq = self.requests.get(request_id)
        if seq is None or seq.finished:
            return False
        self._finish(seq, "abort")
        return True

    def fail(self, request_id: str, error: IsoserveError) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self._finish(seq, "error", error)

    def release(self, request_id: str) -> None:
        """Free the pages a finished keep_kv_on_finish sequence still holds (after its transfer)."""
        seq = self.requests.pop(request_id, None)
        if seq is not None and seq.pages:
            self.allocator.free(seq.pages)
            seq.pages, seq.page_epochs = [], []

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending_outputs)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        # Outputs produced between steps (aborts, failures, a transfer's first token) go first,
        # so each request's outputs stay in order.
        self.end_expired()
        outputs, self._pending_outputs = self._pending_outputs, []
        chunks = self.scheduler.schedule()
        if chunks:
            self.stats.counters["steps"] += 1
            result = self.runner.execute(chunks)
            for seq, violation in result.violations:
                self.stats.counters["guard_violations"] += 1
                self._finish(seq, "error", KVIsolationViolation(
                    f"request {seq.request_id} was stopped before reading KV it does not own "
                    f"({violation.describe()})"))
            for seq, token, logprob in result.sampled:
                self._append_token(seq, token, logprob)
                if not seq.finished and self._output_due(seq):
                    outputs.append(self._output(seq))
        outputs += self._pending_outputs  # requests that finished in this step
        self._pending_outputs = []
        return outputs

    def end_expired(self, now: float | None = None) -> None:
        """End requests past a deadline (each step does, before scheduling; a worker also does
        while no step runs, for requests that wait for a KV transfer)."""
        now = time.monotonic() if now is None else now
        for seq in list(self.requests.values()):
            if seq.finished:
                continue
            if seq.queued and seq.queue_deadline is not None and now > seq.queue_deadline:
                self.stats.counters["queue_timeouts"] += 1
                self._finish(seq, "error", QueueTimeout(
                    f"request {seq.request_id} waited in the queue past its deadline; the server "
                    "is busy, retry later"))
            elif seq.generation_deadline is not None and now > seq.generation_deadline:
                self.stats.counters["generation_timeouts"] += 1
                self._finish(seq, "error", GenerationTimeout(
                    f"request {seq.request_id} did not finish within its generation deadline "
                    f"({len(seq.output_token_ids)} tokens generated)"))

    def _append_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        seq.output_token_ids.append(token)
        seq.logprobs.append(logprob)
        p = seq.params
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self._update_text(seq)
            self._finish(seq, "stop")
            return
        if self._update_text(seq):
            self._finish(seq, "stop")
            return
        if len(seq.output_token_ids) >= p.max_tokens:
            self._finish(seq, "length")

    def _update_text(self, seq: Sequence) -> bool:
        """Detokenize the output; True when a stop string appeared (the text is cut before it)."""
        if seq.output_text is None:
            seq.output_text = self.detokenizer.start()
        text = seq.output_text.after(seq.output_token_ids)
        # Of several stop strings, the one that occurs first in the text ends it.
        hits = [i for stop in seq.params.stop
                if (i := text.find(stop, max(0, len(seq.text) - len(stop)))) != -1]
        if hits:
            seq.text = text[:min(hits)]
            return True
        seq.text = text
        return False

    def _finish(self, seq: Sequence, reason: str, error: IsoserveError | None = None) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.scheduler.finish(seq)
        if seq.pages and not (seq.keep_kv_on_finish and error is None and reason != "abort"):
            self.allocator.free(seq.pages)
            seq.pages, seq.page_epochs = [], []
        self.stats.counters[f"finished_{reason}"] += 1
        self._pending_outputs.append(self._output(seq))
        if not seq.pages:
            self.requests.pop(seq.request_id, None)

    def _output_due(self, seq: Sequence) -> bool:
        """Whether a running sequence's new tokens go out now: its first at once (time to first
        token), then every stream_interval tokens. A finished one always goes out (_finish)."""
        unsent = len(seq.output_token_ids) - seq.emitted_tokens
        return seq.emitted_tokens == 0 or unsent >= self.config.stream_interval

    def _output(self, seq: Sequence) -> RequestOutput:
        new_tokens = seq.output_token_ids[seq.emitted_tokens:]
        new_logprobs = seq.logprobs[seq.emitted_tokens:]
        seq.emitted_tokens = len(seq.output_token_ids)
        text = seq.text
        # Hold back a trailing partial UTF-8 character until the next token completes it, and
        # the last characters that a stop string still to come may start with.
        visible = len(text)
        if not seq.finished:
            visible = len(text.rstrip("\ufffd"))
            if seq.params.stop:
                visible = max(0, min(visible, len(text) - max(map(len, seq.params.stop)) + 1))
        new_text = text[seq.emitted_text_len:visible]
        seq.emitted_text_len = max(seq.emitted_text_len, visible)
        return RequestOutput(seq.request_id, new_tokens, new_logprobs, new_text, seq.finished,
                             seq.finish_reason, seq.error, len(seq.prompt_token_ids),
                             len(seq.output_token_ids))
