"""OpenAI response bodies and stream chunks for completions and chat completions.

The server renders every answer through one `ResponseFormat`: `CompletionFormat` or
`ChatFormat`, each giving a whole answer's choice, a stream's opening event and each
stream event's choice, so the routes hold no per-API branches.
"""

import time

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.host.stream import RequestOutput


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


class CompletionFormat:
    """The completions API's choices: `text`, the legacy `logprobs` object, `echo`."""

    object_name = chunk_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, tokenizer: Tokenizer, req) -> None:
        self.tokenizer, self.req = tokenizer, req

    def choice(self, index: int, prompt_ids: list[int], text: str,
               outputs: list[RequestOutput], finish_reason: str | None) -> dict:
        """A whole answer's choice."""
        req, tokenizer = self.req, self.tokenizer
        prefix = tokenizer.decode(prompt_ids) if req.echo else ""
        item = {"index": index, "text": prefix + text, "logprobs": None,
                "finish_reason": finish_reason}
        if req.logprobs is not None:
            item["logprobs"] = completion_logprobs(tokenizer, outputs, len(prefix))
            if req.echo and outputs and outputs[0].prompt_logprobs is not None:
                echoed = prompt_logprobs(tokenizer, prompt_ids, outputs[0])
                item["logprobs"] = join_logprobs(echoed, item["logprobs"])
        return item

    def opening(self, index: int, prompt_ids: list[int]) -> dict | None:
        """A stream's first event, before any token: the echoed prompt, if any. Echoed
        with logprobs, the prompt goes out with the first token instead, which brings
        the prompt's logprobs."""
        if not self.req.echo or self.req.logprobs is not None:
            return None
        return {"index": index, "text": self.tokenizer.decode(prompt_ids), "logprobs": None,
                "finish_reason": None}

    def delta(self, index: int, prompt_ids: list[int], out: RequestOutput) -> dict:
        """One stream event's choice, for one engine output."""
        req, tokenizer = self.req, self.tokenizer
        item = {"index": index, "text": out.text, "logprobs": None,
                "finish_reason": out.finish_reason}
        if req.logprobs is not None and out.token_ids:
            item["logprobs"] = completion_logprobs(tokenizer, [out], 0)
        if out.prompt_logprobs is not None:  # echo with logprobs: the first token
            echo = tokenizer.decode(prompt_ids)
            item["text"] = echo + out.text
            item["logprobs"] = join_logprobs(
                prompt_logprobs(tokenizer, prompt_ids, out),
                completion_logprobs(tokenizer, [out], len(echo)),
            )
        return item


class ChatFormat:
    """The chat completions API's choices: an assistant `message`, or `delta`s."""

    object_name, chunk_name = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def __init__(self, tokenizer: Tokenizer, req) -> None:
        self.tokenizer, self.req = tokenizer, req

    def choice(self, index: int, prompt_ids: list[int], text: str,
               outputs: list[RequestOutput], finish_reason: str | None) -> dict:
        logprobs = chat_logprobs(self.tokenizer, outputs) if self.req.logprobs else None
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": logprobs, "finish_reason": finish_reason}

    def opening(self, index: int, prompt_ids: list[int]) -> dict:
        return {"index": index, "delta": {"role": "assistant", "content": ""},
                "logprobs": None, "finish_reason": None}

    def delta(self, index: int, prompt_ids: list[int], out: RequestOutput) -> dict:
        logprobs = None
        if self.req.logprobs and out.token_ids:
            logprobs = chat_logprobs(self.tokenizer, [out])
        return {"index": index, "delta": {"content": out.text} if out.text else {},
                "logprobs": logprobs, "finish_reason": out.finish_reason}


ResponseFormat = CompletionFormat | ChatFormat  # one renderer per API: body and stream chunks
