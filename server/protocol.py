"""OpenAI request schemas (msgspec), their validation, and the OpenAI error object.

Unknown fields are ignored, as OpenAI does. A wrong type or an out-of-range value
is a 400 whose error names the parameter; nothing invalid reaches the engine.
"""

import math

import msgspec

from jaxserve.config import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams

MAX_N = 16  # choices per request
MAX_STOP = 4  # stop strings per request, as OpenAI allows
# OpenAI's documented ranges, where vLLM is looser (the offline API keeps vLLM's)
MAX_TEMPERATURE = 2.0
MAX_COMPLETION_LOGPROBS = 5  # legacy completions; chat's top_logprobs go to MAX_LOGPROBS
MAX_BIAS_VALUE = 100.0  # logit_bias values are in [-100, 100]
ROLES = ("system", "user", "assistant", "tool", "developer")


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error for the client, rendered as OpenAI's error object with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}
        self.body = {
            "error": {
                "message": message,
                "type": ERROR_TYPES.get(status, "server_error"),
                "param": param,
                "code": code,
            }
        }


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class ContentPart(msgspec.Struct):
    type: str
    text: str = ""


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""


class _Common(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None


class CompletionRequest(_Common):
    # a string, strings, token ids or lists of token ids (msgspec allows one list type
    # in a union, so the element kinds are checked when the prompt is encoded)
    prompt: str | list[str | int | list[int]] | None = None
    echo: bool = False
    logprobs: int | None = None  # top alternatives per token: 0-5, as in OpenAI


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = []
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class LoadAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `POST /v1/load_lora_adapter` body: serve the PEFT directory at `lora_path`
    (a path on the server's machine) as the model `lora_name`."""

    lora_name: str
    lora_path: str


class UnloadAdapterRequest(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `POST /v1/unload_lora_adapter` body (its `lora_int_id` is not needed here)."""

    lora_name: str
    lora_int_id: int | None = None


def decode(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Parse a JSON body into `kind`, or raise a 400 that names the parameter at fault."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        text = str(e)
        param = text.split("$.", 1)[1].rstrip("`") if "$." in text else None
        if param is not None:
            param = param.replace("[...]", "")  # a mapping's value: name the mapping
        raise APIError(400, f"invalid request: {text}", param=param) from None
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise APIError(400, f"request body is not valid JSON: {e}") from None


def _check_number(name: str, value: float | None) -> None:
    if value is not None and not math.isfinite(value):
        raise APIError(400, f"{name} must be a finite number", param=name)


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias, token ids (as strings) to values in [-100, 100], as
    (id, value) pairs; at most MAX_LOGIT_BIAS of them (the engine's table per row)."""
    if not bias:
        return ()
    if len(bias) > MAX_LOGIT_BIAS:
        raise APIError(400, f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got "
                       f"{len(bias)}", param="logit_bias")
    pairs = []
    for key, value in bias.items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, got {key!r}",
                           param="logit_bias")
        if not (math.isfinite(value) and -MAX_BIAS_VALUE <= value <= MAX_BIAS_VALUE):
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}",
                           param="logit_bias")
        pairs.append((int(key), float(value)))
    return tuple(pairs)


def sampling_params(
    req: _Common,
    max_tokens: int | None,
    logprobs: int | None,
    default_max_tokens: int,
    prompt_logprobs: int | None = None,
    max_logprobs: int = MAX_LOGPROBS,
) -> SamplingParams:
    """SamplingParams from a request's fields, or a 400 naming the bad one."""
    for name in (
        "temperature",
        "top_p",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
    ):
        _check_number(name, getattr(req, name))
    if not 1 <= req.n <= MAX_N:
        raise APIError(400, f"n must be between 1 and {MAX_N}, got {req.n}", param="n")
    if max_tokens is not None and max_tokens < 1:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", param="max_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise APIError(400, f"at most {MAX_STOP} stop sequences, got {len(stop)}", param="stop")
    if logprobs is not None and not 0 <= logprobs <= max_logprobs:
        raise APIError(400, f"logprobs must be between 0 and {max_logprobs}", param="logprobs")
    if req.temperature is not None and req.temperature > MAX_TEMPERATURE:
        raise APIError(400, f"temperature must be at most {MAX_TEMPERATURE:g}, got "
                       f"{req.temperature}", param="temperature")
    fields = {
        "max_tokens": max_tokens if max_tokens is not None else default_max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "top_k": 0 if req.top_k is None else req.top_k,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "seed": req.seed,
        "stop": tuple(s for s in stop if s),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "min_tokens": req.min_tokens,
        "logit_bias": _logit_bias(req.logit_bias),
    }
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=param if param in fields else None) from None
