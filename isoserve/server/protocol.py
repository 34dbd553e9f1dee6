"""The OpenAI API as isoserve speaks it: request bodies for /v1/completions and
/v1/chat/completions, and the response bodies and stream chunks built from RequestOutputs.

Unknown fields are ignored (OpenAI clients send fields we have no use for), `null` means "not
given", and a known field we cannot honour (n > 1, echo, penalties, tools, ...) is rejected
with a 400 naming it, never silently dropped: the client would get an answer to a question it
did not ask. Types are strict ("0.5" is not a temperature) and every size is bounded by
isoserve.server.limits; the JSON schema of each field says the same as its validation, so the
served OpenAPI document is the contract a client can generate requests from.
"""
from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, WithJsonSchema, field_validator,
                      model_validator)
from pydantic_core import PydanticCustomError

from isoserve.engine.engine import RequestOutput
from isoserve.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from isoserve.engine.sequence import TokenLogprob
from isoserve.errors import IsoserveError, RequestAborted
from isoserve.server.limits import (MAX_CONTENT_PARTS, MAX_MESSAGES, MAX_NAME_CHARS,
                                    MAX_PROMPT_CHARS, MAX_PROMPT_TOKEN_IDS, MAX_STOP_LENGTH,
                                    MAX_STOP_SEQUENCES, MAX_STOP_TOKEN_IDS, MAX_TOKEN_ID,
                                    MIN_TEMPERATURE)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # the legacy completions API's default

TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def _integral(value: Any) -> Any:
    """JSON has one number type: 2.0 is the integer 2 (JSON Schema agrees), 2.5 is not. Applied
    before the strict integer fields (and lists of them), which still refuse "2" and true."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    return value

# Pydantic's lax mode would take "0.5" for a temperature and "true" for a flag; an API whose
# schema says number must not accept a string. NaN and infinities are not JSON numbers.
_REQUEST_CONFIG = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


# ---- requests -------------------------------------------------------------------------------

def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_value", message)


def _check_vocabulary(ids: list[int], info: ValidationInfo, what: str) -> None:
    """The server validates with context {"vocab_size": n}: ids at or above it are no token
    (the engine would refuse them too, but only after the request was queued)."""
    vocab = (info.context or {}).get("vocab_size")
    if vocab is not None and ids and max(ids) >= vocab:
        raise PydanticCustomError("token_id_out_of_range",
                                  f"{what} holds token id {max(ids)}, outside the vocabulary "
                                  f"[0, {vocab})")


_TEXT_PROMPT = {"type": "string", "minLength": 1, "maxLength": MAX_PROMPT_CHARS}
_TOKEN_PROMPT = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": MAX_TOKEN_ID},
                 "minItems": 1, "maxItems": MAX_PROMPT_TOKEN_IDS}
# One prompt: text or token ids, bare or as a batch of one (what the openai client sends).
_PROMPT_SCHEMA = {"anyOf": [_TEXT_PROMPT, _TOKEN_PROMPT,
                            {"type": "array", "items": _TEXT_PROMPT, "minItems": 1, "maxItems": 1},
                            {"type": "array", "items": _TOKEN_PROMPT, "minItems": 1, "maxItems": 1}]}
_STOP_STRING = {"type": "string", "minLength": 1, "maxLength": MAX_STOP_LENGTH}
_STOP_SCHEMA = {"anyOf": [_STOP_STRING,
                          {"type": "array", "items": _STOP_STRING, "maxItems": MAX_STOP_SEQUENCES}]}


class StreamOptions(BaseModel):
    model_config = _REQUEST_CONFIG
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields both endpoints share."""
    model_config = _REQUEST_CONFIG

    model: str = Field(max_length=MAX_NAME_CHARS)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=MAX_TOKEN_ID)  # extension: -1 or 0 disables it
    seed: int | None = Field(None, ge=-2**63, le=2**63 - 1)  # it travels to workers as an int64
    stop: Annotated[str | list[str] | None, WithJsonSchema(_STOP_SCHEMA)] = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False  # extension, as in vLLM
    # The fields below accept only the value that means "off": the schema says so exactly.
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": 1})
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=MAX_NAME_CHARS)
    presence_penalty: float = Field(0.0, json_schema_extra={"minimum": 0, "maximum": 0})
    frequency_penalty: float = Field(0.0, json_schema_extra={"minimum": 0, "maximum": 0})
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={"maxProperties": 0})

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @field_validator("top_k", "seed", "n", "stop_token_ids", mode="before")
    @classmethod
    def _integers(cls, value):
        return _integral(value)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_SEQUENCES:
            raise PydanticCustomError("too_many", f"at most {MAX_STOP_SEQUENCES} stop sequences are "
                                                  f"allowed, got {len(stops)}")
        if any(not 0 < len(s) <= MAX_STOP_LENGTH for s in stops):
            raise PydanticCustomError("bad_length", "each stop sequence must have 1 to "
                                                    f"{MAX_STOP_LENGTH} characters")
        return stops

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_tokens_in_vocabulary(cls, ids, info: ValidationInfo):
        _check_vocabulary(ids, info, "stop_token_ids")
        return ids

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise _unsupported(f"only n=1 is supported, got {n}; send several requests instead")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value, info):
        if value != 0:
            raise _unsupported(f"{info.field_name} is not supported; only 0 is accepted")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value):
        if value:
            raise _unsupported("logit_bias is not supported")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        # Sampling at a temperature this close to 0 is greedy decoding in all but overflow.
        temperature = self.temperature if self.temperature >= MIN_TEMPERATURE else 0.0
        return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=list(self.stop or []),
                              stop_token_ids=list(self.stop_token_ids),
                              ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(_GenerationRequest):
    prompt: Annotated[str | list[TokenId] | list[str] | list[list[TokenId]],
                      WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: int = Field(DEFAULT_COMPLETION_MAX_TOKENS, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = Field(False, json_schema_extra={"const": False})
    suffix: str | None = Field(None, json_schema_extra={"maxLength": 0})
    best_of: int | None = Field(None, json_schema_extra={"minimum": 1, "maximum": 1})

    @field_validator("prompt", "max_tokens", "logprobs", "best_of", mode="before")
    @classmethod
    def _completion_integers(cls, value):
        return _integral(value)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt, info: ValidationInfo):
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise _unsupported("batched prompts are not supported; send one prompt "
                                             "per request")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise PydanticCustomError("empty", "the prompt is empty")
        if isinstance(prompt, str):
            if len(prompt) > MAX_PROMPT_CHARS:
                raise PydanticCustomError("too_long", f"the prompt has {len(prompt)} characters; "
                                                      f"at most {MAX_PROMPT_CHARS} are allowed")
        else:
            if len(prompt) > MAX_PROMPT_TOKEN_IDS:
                raise PydanticCustomError("too_long", f"the prompt has {len(prompt)} token ids; "
                                                      f"at most {MAX_PROMPT_TOKEN_IDS} are allowed")
            _check_vocabulary(prompt, info, "the prompt")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, echo):
        if echo:
            raise _unsupported("echo is not supported")
        return echo

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix):
        if suffix:
            raise _unsupported("suffix (insertion) is not supported")
        return suffix

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, best_of):
        if best_of not in (None, 1):
            raise _unsupported("only best_of=1 is supported")
        return best_of

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]
    text: str = Field(max_length=MAX_PROMPT_CHARS)


class ChatMessage(BaseModel):
    model_config = _REQUEST_CONFIG
    # "developer" is OpenAI's newer name for "system"; tool calls are not supported.
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_PROMPT_CHARS)] \
        | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content)

    def to_template(self) -> dict:
        """The plain {role, content} dict chat templates expect."""
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": self.text()}


class ResponseFormat(BaseModel):
    model_config = _REQUEST_CONFIG
    type: Literal["text"]  # json_object and json_schema would need constrained decoding


class ChatCompletionRequest(_GenerationRequest):
    # top_logprobs > 0 needs logprobs: true (as OpenAI has it); JSON Schema can say that too.
    model_config = ConfigDict(json_schema_extra={
        "if": {"properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
               "required": ["top_logprobs"]},
        "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}})

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name; it wins
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = Field(None, json_schema_extra={"maxItems": 0})
    response_format: ResponseFormat | None = None

    @field_validator("max_tokens", "max_completion_tokens", "top_logprobs", mode="before")
    @classmethod
    def _chat_integers(cls, value):
        return _integral(value)

    @field_validator("messages")
    @classmethod
    def _prompt_chars(cls, messages):
        total = sum(len(m.text()) for m in messages)
        if total > MAX_PROMPT_CHARS:
            raise PydanticCustomError("too_long", f"the messages have {total} characters of content; "
                                                  f"at most {MAX_PROMPT_CHARS} are allowed")
        return messages

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, tools):
        if tools:
            raise _unsupported("tool calling is not supported")
        return tools

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_needs_logprobs(cls, top, info):
        if top and not info.data.get("logprobs"):
            raise _unsupported("top_logprobs needs logprobs=true")
        return top

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        return self.sampling_params(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


# Pydantic puts the union member it tried into an error's location ("str", "list[int]", ...).
_UNION_MEMBER = re.compile(r"(str|int|float|bool|none|list|dict|constrained-\w+|function-\w+)(\[.*\])?")


def most_specific_error(errors: list[dict]) -> dict:
    """The one error to report: the deepest (a union reports each member it tried), and among
    those one that broke a limit over one that only says a member's type did not match."""
    return max(errors, key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))


def validation_error_param(loc: tuple) -> str | None:
    """The offending parameter as OpenAI names it: `messages[0].content`, `temperature`."""
    parts = []
    for i, item in enumerate(loc):
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif i == 0 and item in ("body", "query", "path", "header"):
            continue  # FastAPI's prefix for where the parameter came from
        elif parts and _UNION_MEMBER.fullmatch(item):
            continue
        else:
            parts.append(("." if parts else "") + str(item))
    return "".join(parts) or None


# ---- token strings for logprobs ---------------------------------------------------------------

@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table, inverted: byte-level BPE vocabularies spell
    every byte as one of these characters, so a token's raw bytes can be read back exactly."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenStrings:
    """A token's text and raw bytes, as logprobs report them; cached because the same ids recur."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text(self, token_id: int) -> str:
        return self._lookup(token_id)[0]

    def bytes(self, token_id: int) -> list[int]:
        return self._lookup(token_id)[1]

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            # A lone piece of a multi-byte character decodes to U+FFFD; its bytes stay exact.
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            hit = self._cache[token_id] = (text, self._raw_bytes(token_id, text))
        return hit

    def _raw_bytes(self, token_id: int, text: str) -> list[int]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level:
                table = _byte_level_decoder()
                if all(c in table for c in piece):
                    return [table[c] for c in piece]
            if m := _BYTE_FALLBACK.fullmatch(piece):  # SentencePiece byte-fallback tokens
                return [int(m.group(1), 16)]
        return list(text.encode("utf-8"))


# ---- responses ------------------------------------------------------------------------------

def finish_reason(output: RequestOutput) -> str | None:
    """OpenAI's finish_reason for a finished output; an output that ended any other way is an
    error, never a quietly truncated success."""
    if not output.finished:
        return None
    if output.error is not None:
        raise output.error
    if output.finish_reason in ("stop", "length"):
        return output.finish_reason
    if output.finish_reason == "abort":
        raise RequestAborted("the request was aborted before it finished")
    raise IsoserveError(f"the request ended with an unexpected reason {output.finish_reason!r}")


def _finite(logprob: float) -> float:
    """JSON has no -Infinity; a token the model rules out entirely gets vLLM's floor instead."""
    return logprob if math.isfinite(logprob) else -9999.0


def usage(output: RequestOutput) -> dict:
    return {"prompt_tokens": output.num_prompt_tokens,
            "completion_tokens": output.num_output_tokens,
            "total_tokens": output.num_prompt_tokens + output.num_output_tokens}


@dataclass
class ResponseContext:
    """What every body and chunk of one response repeats."""
    id: str
    model: str
    created: int
    strings: TokenStrings
    logprobs: bool       # the client asked for logprobs
    include_usage: bool  # streaming: end with a usage chunk

    @classmethod
    def new(cls, prefix: str, model: str, strings: TokenStrings, *, logprobs: bool,
            include_usage: bool = False) -> ResponseContext:
        return cls(f"{prefix}-{uuid.uuid4().hex}", model, int(time.time()), strings, logprobs,
                   include_usage)


class CompletionFormatter:
    """/v1/completions: `choices[0].text` and legacy-format logprobs."""
    id_prefix = "cmpl"
    object_name = "text_completion"

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx
        self._text_offset = 0  # legacy logprobs give each token's offset into the completion

    def body(self, outputs: list[RequestOutput]) -> dict:
        final = outputs[-1]
        choice = {"index": 0, "text": "".join(o.new_text for o in outputs),
                  "logprobs": self._logprobs([lp for o in outputs for lp in o.new_logprobs]),
                  "finish_reason": finish_reason(final)}
        return self._envelope([choice]) | {"usage": usage(final)}

    def start_chunks(self) -> list[dict]:
        return []

    def chunks(self, output: RequestOutput) -> list[dict]:
        reason = finish_reason(output)
        if not (output.new_text or reason or (self.ctx.logprobs and output.new_token_ids)):
            return []  # only held-back bytes of a partial character: nothing to say yet
        choice = {"index": 0, "text": output.new_text,
                  "logprobs": self._logprobs(output.new_logprobs), "finish_reason": reason}
        return [self._chunk([choice])]

    def usage_chunk(self, final: RequestOutput) -> dict:
        return self._envelope([]) | {"usage": usage(final)}

    def _chunk(self, choices: list[dict]) -> dict:
        body = self._envelope(choices)
        return body | {"usage": None} if self.ctx.include_usage else body

    def _envelope(self, choices: list[dict]) -> dict:
        return {"id": self.ctx.id, "object": self.object_name, "created": self.ctx.created,
                "model": self.ctx.model, "choices": choices}

    def _logprobs(self, logprobs: list[TokenLogprob | None]) -> dict | None:
        if not self.ctx.logprobs:
            return None
        s = self.ctx.strings
        tokens, offsets = [], []
        for lp in logprobs:
            tokens.append(s.text(lp.token_id))
            offsets.append(self._text_offset)
            self._text_offset += len(tokens[-1])
        return {"tokens": tokens,
                "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
                "top_logprobs": [{s.text(t): _finite(v) for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}


class ChatFormatter:
    """/v1/chat/completions: `choices[0].message` and `logprobs.content[]`."""
    id_prefix = "chatcmpl"
    object_name = "chat.completion"

    def __init__(self, ctx: ResponseContext):
        self.ctx = ctx

    def body(self, outputs: list[RequestOutput]) -> dict:
        final = outputs[-1]
        choice = {"index": 0,
                  "message": {"role": "assistant", "content": "".join(o.new_text for o in outputs)},
                  "logprobs": self._logprobs([lp for o in outputs for lp in o.new_logprobs]),
                  "finish_reason": finish_reason(final)}
        return self._envelope(self.object_name, [choice]) | {"usage": usage(final)}

    def start_chunks(self) -> list[dict]:
        """OpenAI opens a chat stream with the assistant role and empty content."""
        return [self._chunk({"role": "assistant", "content": ""}, None, None)]

    def chunks(self, output: RequestOutput) -> list[dict]:
        reason = finish_reason(output)
        if not (output.new_text or reason or (self.ctx.logprobs and output.new_token_ids)):
            return []
        delta = {"content": output.new_text} if output.new_text else {}
        return [self._chunk(delta, self._logprobs(output.new_logprobs), reason)]

    def usage_chunk(self, final: RequestOutput) -> dict:
        return self._envelope("chat.completion.chunk", []) | {"usage": usage(final)}

    def _chunk(self, delta: dict, logprobs: dict | None, reason: str | None) -> dict:
        body = self._envelope("chat.completion.chunk", [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}])
        return body | {"usage": None} if self.ctx.include_usage else body

    def _envelope(self, object_name: str, choices: list[dict]) -> dict:
        return {"id": self.ctx.id, "object": object_name, "created": self.ctx.created,
                "model": self.ctx.model, "choices": choices}

    def _logprobs(self, logprobs: list[TokenLogprob | None]) -> dict | None:
        if not self.ctx.logprobs:
            return None
        s = self.ctx.strings

        def entry(token_id: int, logprob: float) -> dict:
            return {"token": s.text(token_id), "logprob": _finite(logprob), "bytes": s.bytes(token_id)}

        return {"content": [entry(lp.token_id, lp.logprob)
                            | {"top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in logprobs]}
