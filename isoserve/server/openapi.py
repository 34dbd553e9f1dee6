"""The OpenAPI document a tenant can read at /openapi.json: the contract of this deployment.

The generation endpoints read their bodies by hand (the size limit comes before parsing), so
FastAPI cannot see their request models; this module describes them from the same pydantic
models that validate them, with the bounds of this deployment filled in (its model names, its
vocabulary), and documents every response a client can get, errors included. It needs a
tenant key: strangers learn nothing about the deployment from it.
"""
from __future__ import annotations

import copy
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from isoserve.server.limits import MAX_TOKEN_ID
from isoserve.server.protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"


# ---- response bodies (documentation: the formatters in protocol.py build them) ------------------

class _Doc(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    error: ErrorDetail


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Doc):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"]


class Completion(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(_Doc):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Doc):
    content: list[TokenLogprobEntry]


class AssistantMessage(_Doc):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Doc):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionChunkChoice(_Doc):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class CompletionChunk(_Doc):
    """One event of a /v1/completions stream; with include_usage, each has `usage: null` and a
    last one with no choices carries the usage."""
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


class Delta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class ChatCompletionChunk(_Doc):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Doc):
    status: str


_ERROR_MEANINGS = {
    400: "Invalid request: a parameter out of its limits (`param` names it), malformed JSON, "
         "or a prompt over the context (`context_length_exceeded`)",
    401: "Missing or unknown API key",
    403: "The API key may not use this endpoint",
    404: "Unknown model",
    408: "The client took too long to send the request body",
    413: "The request body is larger than the limit",
    429: "A queue or the tenant's limit is full; retry after `Retry-After` seconds",
    500: "The server failed this request (an isolation guard, for one)",
    503: "No worker can take the request, or the server is shutting down",
    504: "The request did not finish within its deadline",
}
_GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503, 504)
_SECURED = [{"bearerAuth": []}]

# (path, method) -> what it answers besides errors, its errors, whether it needs a key.
_OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("/v1/completions", "post"): dict(body=CompletionRequest, ok=Completion, stream=CompletionChunk,
                                      errors=_GENERATION_ERRORS, secured=True),
    ("/v1/chat/completions", "post"): dict(body=ChatCompletionRequest, ok=ChatCompletion,
                                           stream=ChatCompletionChunk,
                                           errors=_GENERATION_ERRORS, secured=True),
    ("/v1/models", "get"): dict(ok=ModelList, errors=(401,), secured=True),
    ("/v1/models/{model}", "get"): dict(ok=ModelCard, errors=(401, 404), secured=True),
    ("/status", "get"): dict(ok=None, errors=(401, 403), secured=True),
    ("/health", "get"): dict(ok=Health, errors=(), secured=False),
    ("/metrics", "get"): dict(ok="text/plain", errors=(), secured=False),
}


def install_openapi(app: FastAPI, served_model_names: list[str], vocab_size: int, dependencies) -> None:
    """Build the document once, on first use, and serve it at /openapi.json behind `dependencies`
    (the tenant key check)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = build_openapi(app, served_model_names, vocab_size)
        return app.openapi_schema

    async def openapi_json() -> JSONResponse:
        return JSONResponse(openapi())

    app.openapi = openapi
    app.add_api_route("/openapi.json", openapi_json, methods=["GET"], dependencies=dependencies,
                      include_in_schema=False)


def build_openapi(app: FastAPI, served_model_names: list[str], vocab_size: int) -> dict:
    doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                      description="The OpenAI API as isoserve serves it.")
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)  # FastAPI's 422s: isoserve answers 400 instead
    schemas.pop("ValidationError", None)
    components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer",
                                                    "description": "A tenant API key (isk-...)"}}
    _add_model(schemas, ErrorResponse)
    for (path, method), spec in _OPERATIONS.items():
        operation = doc["paths"].get(path, {}).get(method)
        if operation is None:
            continue
        responses = {"200": _ok_response(schemas, spec)}
        if path == "/health":
            responses["503"] = _json_response("Not ready, or shutting down", _ref(_add_model(schemas, Health)))
        for status in spec["errors"]:
            responses[str(status)] = _json_response(_ERROR_MEANINGS[status], _ref("ErrorResponse"))
        operation["responses"] = responses
        if spec["secured"]:
            operation["security"] = _SECURED
        if "body" in spec:
            name = _add_model(schemas, spec["body"])
            _bind_to_deployment(schemas[name], served_model_names, vocab_size)
            operation["requestBody"] = {"required": True, "content": {
                "application/json": {"schema": {"$ref": _REF.format(model=name)}}}}
    return doc


def _ok_response(schemas: dict, spec: dict) -> dict:
    ok = spec["ok"]
    if ok == "text/plain":
        return {"description": "Prometheus metrics", "content": {"text/plain": {"schema": {"type": "string"}}}}
    if ok is None:
        return _json_response("OK", {"type": "object"})
    response = _json_response("OK", {"$ref": _REF.format(model=_add_model(schemas, ok))})
    if spec.get("stream"):
        response["description"] = ("The completion; with `stream: true`, server-sent events: "
                                   "chunks, an error event if it fails midway, then `[DONE]`")
        response["content"]["text/event-stream"] = {"schema": _event_schema(schemas, spec["stream"])}
    return response


def _event_schema(schemas: dict, chunk: type[BaseModel]) -> dict:
    """One server-sent event (OpenAPI 3.1 describes each event of a stream with `schema`): its
    data is a JSON chunk or error, or the literal `[DONE]` that ends the stream."""
    json_data = {"type": "string", "contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(_add_model(schemas, chunk)), _ref("ErrorResponse")]}}
    return {"type": "object", "required": ["data"],
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, json_data]},
                           "event": {"type": "string"}, "id": {"type": "string"},
                           "retry": {"type": "integer"}}}


def _json_response(description: str, schema: dict) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _ref(name: str) -> dict:
    return {"$ref": _REF.format(model=name)}


def _add_model(schemas: dict, model: type[BaseModel]) -> str:
    """Put a model's JSON schema and those it refers to under components/schemas."""
    schema = copy.deepcopy(model.model_json_schema(ref_template=_REF))  # edited per deployment
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return model.__name__


def _bind_to_deployment(schema: dict, served_model_names: list[str], vocab_size: int) -> None:
    """The request schema of this deployment: its model names, its vocabulary, and `null` for
    every optional field (the server reads null as "not given")."""
    props = schema["properties"]
    props["model"]["enum"] = list(served_model_names)
    for name in ("prompt", "stop_token_ids"):
        if name in props:
            _bound_token_ids(props[name], vocab_size - 1)
    required = set(schema.get("required", []))
    for name, prop in props.items():
        if name not in required:
            props[name] = _nullable(prop)


def _bound_token_ids(schema: Any, highest: int) -> None:
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("maximum") == MAX_TOKEN_ID:
            schema["maximum"] = highest
        for value in schema.values():
            _bound_token_ids(value, highest)
    elif isinstance(schema, list):
        for value in schema:
            _bound_token_ids(value, highest)


def _nullable(prop: dict) -> dict:
    if any(member.get("type") == "null" for member in prop.get("anyOf", [])):
        return prop
    outer = {k: prop.pop(k) for k in ("title", "default", "description") if k in prop}
    return {"anyOf": [prop, {"type": "null"}], **outer}
