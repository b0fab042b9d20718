"""aiohttp app: OpenAI-compatible completions and chat completions over one model.

Generation runs on a worker thread so the event loop keeps answering (/health,
/v1/models) while a batch is computed.
"""

import asyncio
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import msgspec
from aiohttp import web

from jaxserve import LLM, SamplingParams
from server.protocol import APIError, ChatCompletionRequest, CompletionRequest, decode


def build_app(llm: LLM, model_name: str) -> web.Application:
    executor = ThreadPoolExecutor(max_workers=1)  # one generation at a time on the device

    async def run(prompt, params: SamplingParams):
        loop = asyncio.get_running_loop()
        try:
            (out,) = await loop.run_in_executor(executor, llm.generate, prompt, params)
        except ValueError as e:
            raise APIError(400, str(e), param="prompt") from None
        return out

    def sampling(req, max_tokens: int | None) -> SamplingParams:
        if req.model not in (None, model_name):
            raise APIError(404, f"model {req.model!r} does not exist", param="model")
        if req.stream:
            raise APIError(400, "stream is not supported yet", param="stream")
        try:
            return SamplingParams(
                max_tokens=16 if max_tokens is None else max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
                top_k=req.top_k,
                seed=req.seed,
                stop=req.stop or (),
                ignore_eos=req.ignore_eos,
                min_tokens=req.min_tokens,
            )
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def usage(out) -> dict:
        p, c = len(out.prompt_token_ids), len(out.token_ids)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    async def completions(request: web.Request) -> web.Response:
        req = decode(await request.read(), CompletionRequest)
        out = await run(req.prompt, sampling(req, req.max_tokens))
        reason = out.finish_reason
        choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": reason}
        return _json(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice],
                "usage": usage(out),
            }
        )

    async def chat_completions(request: web.Request) -> web.Response:
        req = decode(await request.read(), ChatCompletionRequest)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        params = sampling(req, req.max_completion_tokens or req.max_tokens)
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        try:
            prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        out = await run(prompt, params)
        message = {"role": "assistant", "content": out.text}
        choice = {"index": 0, "message": message, "finish_reason": out.finish_reason}
        return _json(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice],
                "usage": usage(out),
            }
        )

    async def models(request: web.Request) -> web.Response:
        card = {"id": model_name, "object": "model", "created": 0, "owned_by": "jaxserve"}
        return _json({"object": "list", "data": [card]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    @web.middleware
    async def errors(request: web.Request, handler):
        try:
            return await handler(request)
        except APIError as e:
            return _json(e.body, status=e.status)

    app = web.Application(middlewares=[errors])
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.on_cleanup.append(lambda _: asyncio.to_thread(executor.shutdown))
    return app


def _json(body: dict, status: int = 200) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body), status=status, content_type="application/json"
    )


def run(model: str | None, host: str, port: int, max_batch: int) -> None:
    """Load the model, then serve until interrupted."""
    llm = LLM(model=model, max_batch=max_batch)
    name = llm.model_path.stem if llm.model_path.is_file() else llm.model_path.name
    print(f"serving {name} on http://{host}:{port}", flush=True)
    web.run_app(build_app(llm, name), host=host, port=port, print=None)
