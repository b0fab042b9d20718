"""A request body's prompt as token ids and its sampling parameters, checked as the
engine checks them: one place for both APIs, and the same checks `LLM` makes
(`EngineClient.encode` and `check`), so a 400 here is what the offline API raises.
"""

from jaxserve.config import SamplingParams
from jaxserve.host.request import RequestRejected
from jaxserve.serving import EngineClient
from server.protocol import (
    MAX_COMPLETION_LOGPROBS,
    ROLES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    sampling_params,
)


def completion(
    req: CompletionRequest, client: EngineClient
) -> tuple[list[list[int]], SamplingParams]:
    """A completions body's prompts (string, strings, ids, lists of ids) and parameters."""
    prompt = req.prompt
    if prompt is None or prompt == "" or prompt == []:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if isinstance(prompt, str) or all(isinstance(p, int) for p in prompt):
        prompts = [prompt]
    elif all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(400, "prompt must be a string, strings, token ids or lists of ids",
                       param="prompt")
    try:
        ids = [client.encode(p) for p in prompts]
    except RequestRejected as e:
        raise APIError(400, str(e), param="prompt") from None
    # echo with logprobs scores the prompt too (lm-evaluation-harness's loglikelihood)
    scores = req.logprobs if req.echo else None
    params = sampling_params(
        req, req.max_tokens, req.logprobs, default_max_tokens=16, prompt_logprobs=scores,
        max_logprobs=MAX_COMPLETION_LOGPROBS,
    )
    _check_length(client, ids, params, chat=False)
    return ids, params


def chat(
    req: ChatCompletionRequest, client: EngineClient, default_max_tokens: int
) -> tuple[list[int], SamplingParams]:
    """A chat body's messages as prompt ids (through the model's chat template) and its
    parameters; without a max_tokens the answer may take `default_max_tokens` or what is
    left of the context, whichever is less."""
    if not req.messages:
        raise APIError(400, "messages must not be empty", param="messages")
    for i, m in enumerate(req.messages):
        if m.role not in ROLES:
            raise APIError(
                400,
                f"messages[{i}].role {m.role!r} must be one of {ROLES}",
                param=f"messages[{i}].role",
            )
    messages = [{"role": m.role, "content": m.text()} for m in req.messages]
    try:
        text = client.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, str(e), param="messages") from None
    ids = client.tokenizer.encode(text, add_special_tokens=False)
    if req.top_logprobs is not None and not req.logprobs:  # refused, not ignored
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens  # 0 is an error, not "unset"
    if max_tokens is None:
        max_tokens = req.max_tokens
    elif req.max_tokens not in (None, max_tokens):  # one would be ignored
        raise APIError(400, "max_tokens and max_completion_tokens differ: set one",
                       param="max_tokens")
    if max_tokens is None:
        max_tokens = max(1, min(default_max_tokens, client.max_model_len - len(ids)))
    params = sampling_params(req, max_tokens, logprobs, default_max_tokens=max_tokens)
    _check_length(client, [ids], params, chat=True)
    return ids, params


def _check_length(
    client: EngineClient, prompts: list[list[int]], params: SamplingParams, chat: bool
) -> None:
    """The engine's own check of a request's length, before the queue is asked."""
    for ids in prompts:
        try:
            client.check(ids, params)
        except RequestRejected as e:
            raise rejected(e, chat) from None


def rejected(e: RequestRejected, chat: bool) -> APIError:
    """The 400 of a request the engine can never run; a chat's prompt is its messages."""
    param = "messages" if chat and e.param == "prompt" else e.param
    return APIError(400, str(e), param=param, code=e.code)
