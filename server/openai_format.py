"""OpenAI response bodies and stream chunks for completions and chat completions."""

import time

from jaxserve.stream import RequestOutput
from jaxserve.tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_logprobs(tokenizer: Tokenizer, outputs: list[RequestOutput], offset: int) -> dict:
    """The legacy completions `logprobs` object for the tokens in `outputs`."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for out in outputs:
        for token_id, lp, alternatives in zip(out.token_ids, out.logprobs, out.top_logprobs):
            text = tokenizer.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(lp)
            top.append({tokenizer.token_text(i): v for i, v in alternatives.items()})
            offsets.append(offset)
            offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def prompt_logprobs(tokenizer: Tokenizer, prompt_ids: list[int], first: RequestOutput) -> dict:
    """The completions `logprobs` object of an echoed prompt (OpenAI's legacy layout:
    the first token has no logprob and no alternatives)."""
    tokens, offsets, offset = [], [], 0
    for token_id in prompt_ids:
        text = tokenizer.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    top = [
        None if alternatives is None
        else {tokenizer.token_text(i): v for i, v in alternatives.items()}
        for alternatives in first.prompt_top_logprobs
    ]
    return {
        "tokens": tokens,
        "token_logprobs": list(first.prompt_logprobs),
        "top_logprobs": top,
        "text_offset": offsets,
    }


def join_logprobs(first: dict, second: dict) -> dict:
    """Two completions `logprobs` objects, one after the other."""
    return {key: first[key] + second[key] for key in first}


def chat_logprobs(tokenizer: Tokenizer, outputs: list[RequestOutput]) -> dict:
    """The chat `logprobs` object: one entry per token with its top alternatives."""
    content = []
    for out in outputs:
        for token_id, lp, alternatives in zip(out.token_ids, out.logprobs, out.top_logprobs):
            text = tokenizer.token_text(token_id)
            content.append(
                {
                    "token": text,
                    "logprob": lp,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        _chat_alternative(tokenizer.token_text(i), v)
                        for i, v in alternatives.items()
                    ],
                }
            )
    return {"content": content}


def _chat_alternative(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def body(kind: str, request_id: str, model: str, choices: list[dict], usage_=None) -> dict:
    """A response or stream chunk; `kind` is its OpenAI object name, e.g. "chat.completion"."""
    out = {
        "id": request_id,
        "object": kind,
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }
    if usage_ is not None:
        out["usage"] = usage_
    return out
