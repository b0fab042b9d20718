"""The OpenAPI 3.1 description of every route (`GET /openapi.json`), from msgspec schemas.

Request bodies are the Structs the server decodes (server/protocol.py), with the
ranges the server enforces written in; response bodies are the Structs below, which
describe what server/openai_format.py and the routes send (tests/test_openapi.py runs
schemathesis against a live server to hold the two together).
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
from typing import TYPE_CHECKING, Literal

import msgspec
from aiohttp import web

from jaxserve.config import MAX_LOGIT_BIAS, MAX_LOGPROBS
from jaxserve.serving import LiveRequest
from server.protocol import (
    MAX_BIAS_VALUE,
    MAX_COMPLETION_LOGPROBS,
    MAX_N,
    MAX_STOP,
    MAX_TEMPERATURE,
    ROLES,
    ChatCompletionRequest,
    CompletionRequest,
    LoadAdapterRequest,
    UnloadAdapterRequest,
)
from server.responses import json_response

if TYPE_CHECKING:
    from server.app import Server

UNSET = msgspec.UNSET
Unset = msgspec.UnsetType
# "abort": cancelled by the server (a stream's buffer overflowed, or shutdown)
FinishReason = Literal["stop", "length", "abort"]


class _Body(msgspec.Struct, forbid_unknown_fields=True):
    """A response body: its schema allows no field it does not name."""


# ---------------------------------------------------------------- errors


class ErrorObject(_Body):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Body):
    """OpenAI's error object (server/protocol.APIError), for every error status; also a
    stream's last event when the engine fails after the status line has gone."""

    error: ErrorObject


# ---------------------------------------------------------------- completions


class Usage(_Body):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(_Body):
    """The legacy layout: per token its text, logprob (null for an echoed prompt's first
    token), alternatives by text, and offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason


class Completion(_Body):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunkChoice(_Body):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionChunk(_Body):
    """One `data:` event of a completions stream; with stream_options.include_usage, a
    last one with no choices carries the usage."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | Unset = UNSET


# ---------------------------------------------------------------- chat completions


class TopLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Body):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Body):
    content: list[TokenLogprob]


class AssistantMessage(_Body):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Body):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(_Body):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Body):
    role: Literal["assistant"] | Unset = UNSET
    content: str | Unset = UNSET


class ChatChunkChoice(_Body):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(_Body):
    """One `data:` event of a chat stream (the first of each choice names the role)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | Unset = UNSET


# ---------------------------------------------------------------- the other routes


class Model(_Body):
    """OpenAI's model card, and what is served (extensions): the context, the dtype
    activations compute in, how the projection weights are stored (float32, bfloat16,
    int8, float8_e4m3fn) and how KV pages are (f32, bf16, int8, fp8)."""

    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    dtype: str
    weight_dtype: str
    kv_dtype: str
    parent: str | Unset = UNSET  # a LoRA adapter's base model
    root: str | Unset = UNSET  # a LoRA adapter's directory


class AdapterLoaded(_Body):
    """A LoRA adapter now served under `id`."""

    id: str
    object: Literal["lora_adapter"]
    parent: str
    rank: int


class AdapterUnloaded(_Body):
    """A LoRA adapter no longer served (requests running with it finish)."""

    id: str
    object: Literal["lora_adapter"]
    deleted: bool


class ModelList(_Body):
    object: Literal["list"]
    data: list[Model]


class LiveRequestList(_Body):
    object: Literal["list"]
    data: list[LiveRequest]


class HealthOk(_Body, tag_field="status", tag="ok"):
    """Serving."""


class HealthLoading(_Body, tag_field="status", tag="loading"):
    """The model is loading: `compiled` of `buckets` step shapes are compiled."""

    compiled: int
    buckets: int


class HealthDraining(_Body, tag_field="status", tag="draining"):
    """Shutting down: live requests finish, new ones get 503."""


class HealthFailed(_Body, tag_field="status", tag="failed"):
    """The model failed to load or the engine failed; the process exits."""

    error: str


HealthUnavailable = HealthLoading | HealthDraining | HealthFailed

# ---------------------------------------------------------------- request ranges

# What the server enforces (server/protocol.py, jaxserve.config.SamplingParams), written
# into the request schemas: a value outside these gets a 400 naming its field.
COMMON_RANGES = {
    "max_tokens": {"minimum": 1},
    "temperature": {"minimum": 0, "maximum": MAX_TEMPERATURE},
    "top_p": {"exclusiveMinimum": 0, "maximum": 1},
    "top_k": {"minimum": -1},
    "min_p": {"minimum": 0, "maximum": 1},
    "n": {"minimum": 1, "maximum": MAX_N},
    "stop": {"maxItems": MAX_STOP},
    "presence_penalty": {"minimum": -2, "maximum": 2},
    "frequency_penalty": {"minimum": -2, "maximum": 2},
    "repetition_penalty": {"exclusiveMinimum": 0},
    "min_tokens": {"minimum": 0},
    # keys are token ids as strings: said in the description, not as a pattern (a
    # propertyNames pattern crashed schemathesis's generator inside CPython's ast)
    "logit_bias": {
        "maxProperties": MAX_LOGIT_BIAS,
        "additionalProperties": {"minimum": -MAX_BIAS_VALUE, "maximum": MAX_BIAS_VALUE},
        "description": "token ids (as strings) to values added to their logits",
    },
}
RANGES = {
    "CompletionRequest": {
        **COMMON_RANGES,
        "logprobs": {"minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS},
    },
    "ChatCompletionRequest": {
        **COMMON_RANGES,
        "messages": {"minItems": 1},
        "max_completion_tokens": {"minimum": 1},
        "top_logprobs": {"minimum": 0, "maximum": MAX_LOGPROBS},
    },
    "ChatMessage": {"role": {"enum": list(ROLES)}},
}
# The Structs default these so that a missing one is a 400 naming it, as an empty one is.
REQUIRED = {"CompletionRequest": "prompt", "ChatCompletionRequest": "messages"}
_TOKEN_IDS = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}}
# msgspec takes one list type in a union: the prompt's kinds as server/prompts.py checks them
PROMPT = {
    "anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
        _TOKEN_IDS,
        {"type": "array", "minItems": 1, "items": _TOKEN_IDS},
    ],
}
TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}
# a request's tokens, prompt and answer, fit the model's context: known once it loads
CONTEXT_BOUNDED = {
    "CompletionRequest": ("max_tokens",),
    "ChatCompletionRequest": ("max_tokens", "max_completion_tokens"),
}


def _restrict(prop: dict, bounds: dict) -> None:
    """Add `bounds` to a property's schema: to its non-null branch when it may be null."""
    branches = [b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"]
    if len(branches) == 1:
        branches[0].update(bounds)
        return
    for b in branches:  # e.g. stop: a string or a list of them
        if b.get("type") == "array":
            b.update(bounds)


# ---------------------------------------------------------------- the document

JSON = "application/json"
STORY = "Once upon a time"
COMPLETION_EXAMPLES = {
    "text": {"prompt": STORY, "max_tokens": 8},
    "stream": {"prompt": STORY, "max_tokens": 8, "stream": True,
               "stream_options": {"include_usage": True}},
    # lm-evaluation-harness's loglikelihood: the prompt's own logprobs
    "score": {"prompt": STORY, "max_tokens": 1, "echo": True, "logprobs": 2},
    "batch": {"prompt": [[1, 2, 3], [4, 5]], "n": 2, "max_tokens": 4, "stream": True,
              "echo": True, "logprobs": 1, "stop": ["\n"], "seed": 7},
}
HELLO = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
CHAT_EXAMPLES = {
    "chat": {"messages": HELLO, "max_completion_tokens": 8},
    "stream": {"messages": HELLO, "max_tokens": 8, "n": 2, "stream": True, "logprobs": True,
               "top_logprobs": 2, "stream_options": {"include_usage": True}},
    "logprobs": {"messages": HELLO, "max_tokens": 4, "temperature": 0, "logprobs": True,
                 "top_logprobs": 3},
}
REF = "#/components/schemas/{name}"


def _content(name: str) -> dict:
    return {JSON: {"schema": {"$ref": REF.format(name=name)}}}


def _error(description: str, headers: dict | None = None) -> dict:
    out = {"description": description, "content": _content("ErrorResponse")}
    if headers:
        out["headers"] = headers
    return out


ERRORS = {
    400: _error("Invalid request: the error names the parameter at fault"),
    401: _error("Missing or invalid API key (when the server has keys), or not an admin's"),
    404: _error("No such model"),
    408: _error("The request body did not arrive in time (--request-read-timeout-s)"),
    413: _error("Request body too large (--max-body-bytes)"),
    429: _error(
        "Over a tenant's limit or the queue's bound",
        {"Retry-After": {"required": True, "description": "seconds to wait",
                         "schema": {"type": "integer", "minimum": 0}}},
    ),
    500: _error("Internal error, or the engine failed while generating this request"),
    503: _error("The model is loading, the server is draining, the engine has failed, or "
                "the server has --max-connections open"),
}


def _events(chunk: str) -> dict:
    """Server-sent events as OpenAPI 3.2 reads them (in 3.1, `schema` is one event):
    each `data` is a chunk, or an error when the engine fails mid-stream, then [DONE]."""
    payload = {"oneOf": [{"$ref": REF.format(name=chunk)},
                         {"$ref": REF.format(name="ErrorResponse")}]}
    data = {"type": "string", "if": {"const": "[DONE]"},
            "else": {"contentMediaType": JSON, "contentSchema": payload}}
    return {"schema": {"type": "object", "properties": {"data": data}, "required": ["data"]}}


def _generate(
    name: str, summary: str, body: str, answer: str, chunk: str, examples: dict[str, dict]
) -> dict:
    content = _content(body)
    content[JSON]["examples"] = {k: {"value": v} for k, v in examples.items()}
    return {
        "operationId": name,
        "summary": summary,
        "requestBody": {"required": True, "content": content},
        "responses": {
            "200": {
                "description": "The answer: one JSON body, or events when `stream` is true",
                "content": {**_content(answer), "text/event-stream": _events(chunk)},
            },
            **{str(s): ERRORS[s] for s in (400, 401, 404, 408, 413, 429, 500, 503)},
        },
    }


def _get(name: str, summary: str, ok: dict, errors: tuple[int, ...]) -> dict:
    return {
        "operationId": name,
        "summary": summary,
        "responses": {"200": ok, **{str(s): ERRORS[s] for s in errors}},
    }


def _ok(name: str, description: str) -> dict:
    return {"description": description, "content": _content(name)}


def _post(name: str, summary: str, body: str, ok: dict, errors: tuple[int, ...]) -> dict:
    return {**_get(name, summary, ok, errors),
            "requestBody": {"required": True, "content": _content(body)}}


def _schemas() -> dict:
    """Every body's schema by name: the Structs', with the server's ranges written in."""
    types = [
        CompletionRequest, ChatCompletionRequest, Completion, CompletionChunk, ChatCompletion,
        ChatCompletionChunk, ModelList, LiveRequestList, HealthOk, HealthUnavailable,
        ErrorResponse, LoadAdapterRequest, UnloadAdapterRequest, AdapterLoaded,
        AdapterUnloaded,
    ]
    refs, schemas = msgspec.json.schema_components(types, ref_template=REF)
    schemas["HealthUnavailable"] = refs[types.index(HealthUnavailable)]
    for struct, ranges in RANGES.items():
        for field, bounds in ranges.items():
            _restrict(schemas[struct]["properties"][field], bounds)
    for struct, field in REQUIRED.items():
        schemas[struct]["required"] = [field]
    schemas["CompletionRequest"]["properties"]["prompt"] = PROMPT
    chat = schemas["ChatCompletionRequest"]
    chat.update(TOP_LOGPROBS_NEED_LOGPROBS)
    chat["properties"]["max_completion_tokens"]["description"] = (
        "max_tokens's newer name: with both, they must be equal")
    return schemas


def _paths() -> dict:
    health = _get("health", "Whether the server is serving", _ok("HealthOk", "Serving"),
                  (500,))
    health["responses"]["503"] = {
        "description": "Not serving (yet, or any more), or too many connections",
        "content": {JSON: {"schema": {"anyOf": [{"$ref": REF.format(name="HealthUnavailable")},
                                                {"$ref": REF.format(name="ErrorResponse")}]}}},
    }
    paths = {
        "/v1/completions": {"post": _generate(
            "completion", "Complete a prompt", "CompletionRequest", "Completion",
            "CompletionChunk", COMPLETION_EXAMPLES)},
        "/v1/chat/completions": {"post": _generate(
            "chatCompletion", "Answer a conversation", "ChatCompletionRequest",
            "ChatCompletion", "ChatCompletionChunk", CHAT_EXAMPLES)},
        "/v1/models": {"get": _get("listModels", "The served model and its LoRA adapters",
                                   _ok("ModelList", "The base model, then each adapter"),
                                   (401, 500, 503))},
        "/v1/load_lora_adapter": {"post": _post(
            "loadLoraAdapter", "Serve a LoRA adapter (--enable-runtime-lora; an admin key)",
            "LoadAdapterRequest", _ok("AdapterLoaded", "Loaded"), (400, 401, 404, 500, 503))},
        "/v1/unload_lora_adapter": {"post": _post(
            "unloadLoraAdapter", "Stop serving a LoRA adapter (--enable-runtime-lora)",
            "UnloadAdapterRequest", _ok("AdapterUnloaded", "Unloaded"),
            (400, 401, 404, 500, 503))},
        "/health": {"get": health},
        "/metrics": {"get": _get(
            "metrics", "Prometheus metrics",
            {"description": "Prometheus text format",
             "content": {"text/plain": {"schema": {"type": "string"}}}},
            (500, 503))},
        "/admin/requests": {"get": _get(
            "liveRequests", "What the engine holds now",
            _ok("LiveRequestList", "One row per live request"), (401, 500, 503))},
        "/openapi.json": {"get": _get(
            "openapi", "This document",
            {"description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}},
            (500, 503))},
    }
    tenant = {"name": "X-Tenant", "in": "header", "required": False,
              "description": "The tenant, when the server has no API keys",
              "schema": {"type": "string"}}
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/admin/requests",
                 "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        for op in paths[path].values():
            op["security"] = [{}, {"bearerAuth": []}]  # a key only when the server has keys
            op["parameters"] = [tenant]
    priority = {"name": "X-Priority", "in": "header", "required": False,
                "description": "Lower this request to the batch class (never raises it)",
                "schema": {"type": "string", "enum": ["interactive", "batch"]}}
    for path in ("/v1/completions", "/v1/chat/completions"):
        paths[path]["post"]["parameters"] = [tenant, priority]
    return paths


@functools.cache
def _static() -> dict:
    """The document, less what depends on the loaded model."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "jaxserve", "version": importlib.metadata.version("jaxserve"),
                 "description": "An OpenAI-compatible LLM server on JAX/XLA."},
        "paths": _paths(),
        "components": {
            "schemas": _schemas(),
            "securitySchemes": {"bearerAuth": {"type": "http", "scheme": "bearer"}},
        },
    }


def document(max_model_len: int | None = None) -> dict:
    """The OpenAPI document; with the model's context length, max_tokens's real maximum
    (a prompt has at least one token)."""
    doc = _static()
    if max_model_len is None:
        return doc
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    for struct, fields in CONTEXT_BOUNDED.items():
        for field in fields:
            _restrict(schemas[struct]["properties"][field], {"maximum": max_model_len - 1})
    return doc


def route(server: Server):
    """The `GET /openapi.json` handler of `server`."""

    async def openapi(request: web.Request) -> web.Response:
        client = server.client
        return json_response(document(client and client.max_model_len))

    return openapi
