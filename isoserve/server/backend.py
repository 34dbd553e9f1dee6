"""What the HTTP layer needs from whatever runs the model (the disaggregated router, or one
aggregated worker behind the same router): a contract, so the API code never sees zmq."""
from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from isoserve.engine.engine import RequestOutput
from isoserve.engine.sampling_params import SamplingParams


@dataclass
class GenerationRequest:
    request_id: str
    tenant: str
    prompt_token_ids: list[int]
    params: SamplingParams


class Backend(Protocol):
    model_name: str
    tokenizer: object  # a transformers tokenizer: chat template, encode, decode

    def max_model_len(self) -> int:
        """The advertised limit: longest prompt + output any request can have (one limit)."""

    def check_admission(self, prompt_len: int, max_tokens: int) -> None:
        """Raise ContextLengthExceeded if the prompt does not fit (see isoserve.admission)."""

    def generate(self, request: GenerationRequest) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; the last one has finished=True (with error set when it
        failed). Closing the iterator early aborts the request everywhere."""

    def healthy(self) -> bool:
        """True when at least one worker of each needed role is registered and up."""

    def status(self) -> dict:
        """Workers with role, pid, host, state and pool pages total/used/free."""
