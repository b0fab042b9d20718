"""The aiohttp server: OpenAI-compatible routes over one engine, with admission control.

The HTTP side never touches device arrays: it validates, admits (tenant limits,
bounded queue) and submits to the engine, then reads each request's bounded
output stream. The model loads and warms up after the port is open; /health
answers 503 until then, and again while draining after SIGTERM.
"""

import asyncio
import dataclasses
import gc
import logging
import signal
import socket
import time
import uuid
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.request import RequestRejected
from jaxserve.stream import OutputStream, RequestOutput
from server import openai_format as fmt
from server.admission import QueuePolicy
from server.metrics import Metrics
from server.protocol import (
    ROLES,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    decode,
    sampling_params,
)
from server.tenants import TenantPolicy, Tenants

log = logging.getLogger("jaxserve.server")

STREAM_SEND_BUFFER = 32 << 10  # kernel send buffer of one stream, bytes (Linux doubles it)


class ClientStalled(ConnectionError):
    """A streaming client stopped reading: its writes stayed blocked past the timeout."""


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Everything `jaxserve serve` is told, built once from the command line."""

    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    api_keys_file: str | None = None
    queue: QueuePolicy = field(default_factory=QueuePolicy)
    max_body_bytes: int = 4 << 20
    drain_timeout_s: float = 30.0
    # a stream write blocked this long means the client stopped reading: drop it
    stream_write_timeout_s: float = 30.0
    default_chat_max_tokens: int = 256  # OpenAI's completions default (16) is kept as is
    shared_prefix_cache: bool = False  # with API keys, each tenant has its own prefix cache
    engine: EngineConfig = field(default_factory=EngineConfig)


@dataclass
class _Choice:
    """One engine request behind one choice of an HTTP response."""

    index: int
    stream: OutputStream
    prompt_ids: list[int]
    outputs: list[RequestOutput] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    ttft: float | None = None  # seconds from the HTTP request to the first token

    @property
    def num_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class Server:
    """Owns the LLM, its engine thread, tenants, queue policy and metrics."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.tenants = Tenants.from_options(config.api_key, config.api_keys_file)
        self.metrics = Metrics()
        self.llm = None
        self.model_name = config.served_model_name
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.estimated_admission_rate = 0.0  # from the warm-up, until admissions are measured

    # ---------------------------------------------------------------- lifecycle

    def load(self) -> None:
        """Load the model, compile every bucket, start the engine (on a worker thread)."""
        from jaxserve.llm import LLM  # jax loads here, off the event loop

        try:
            llm = LLM(self.config.model, self.config.engine, warmup=True)
        except Exception as e:
            log.exception("model failed to load")
            self.load_error = str(e)
            return
        if self.model_name is None:
            path = llm.model_path
            self.model_name = path.stem if path.is_file() else path.name
        llm.engine.on_step = lambda out, seconds: self.metrics.step_seconds.observe(seconds)
        self.estimated_admission_rate = self._estimate_admission_rate(llm)
        self.metrics.bind(llm.engine, llm.runner)
        # The ~400k objects that loading and compiling leave behind live as long as the
        # server: frozen, the collector never scans them again. Unfrozen, each full
        # collection held the GIL ~200 ms, a pause in every stream.
        gc.freeze()
        llm.engine.start()
        self.llm = llm
        self.ready = True
        log.info("ready: %s, %d buckets compiled", self.model_name, len(llm.runner.step_times))

    def _estimate_admission_rate(self, llm) -> float:
        """Admissions a second before any are measured: a full batch of decode rows, at
        the warm-up's step time for it, each generating a chat answer's default length."""
        rows = llm.scheduler.max_batch
        step_s = llm.runner.step_times.get(llm.runner.buckets.choose(rows, rows))
        if not step_s:
            return 0.0
        return llm.scheduler.num_shards * rows / (step_s * self.config.default_chat_max_tokens)

    async def drain(self) -> None:
        """Refuse new work (503), let live requests finish, cancel what is left."""
        self.draining = True
        if self.llm is None:
            return
        engine = self.llm.engine
        deadline = time.monotonic() + self.config.drain_timeout_s
        while engine.requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for request_id in list(engine.requests):
            engine.cancel(request_id)
        while engine.requests and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        if self.llm is not None:
            self.llm.engine.stop()
            if self.llm.runner.channel is not None:  # release the other processes
                self.llm.runner.channel.stop()

    # ---------------------------------------------------------------- checks

    def _check_ready(self) -> None:
        if self.draining:
            raise APIError(503, "server is shutting down", code="draining")
        if not self.ready:
            raise APIError(503, "model is still loading", code="not_ready")

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist", param="model", code="model_not_found"
            )

    def _prompt_ids(self, prompt) -> list[list[int]]:
        """Completions `prompt` (string, strings, ids, lists of ids) as lists of ids."""
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
            return [self.llm.encode(p) for p in prompts]
        except RequestRejected as e:
            raise APIError(400, str(e), param="prompt") from None

    def _chat_prompt_ids(self, req: ChatCompletionRequest) -> list[int]:
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
            text = self.llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        return self.llm.tokenizer.encode(text, add_special_tokens=False)

    def _cache_salt(self, policy: TenantPolicy) -> str:
        """Tenants configured by key get their own prefix-cache key space, so none can
        probe another's prompts by timing (unless --shared-prefix-cache)."""
        if self.tenants.keys and not self.config.shared_prefix_cache:
            return policy.name
        return ""

    def _check_length(self, prompts: list[list[int]], params, chat: bool) -> None:
        """The engine's own check of a request's length, before the queue is asked."""
        for ids in prompts:
            try:
                self.llm.engine.check(ids, params)
            except RequestRejected as e:
                raise _rejected(e, chat) from None

    # ---------------------------------------------------------------- routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        policy = self.tenants.identify(request.headers)
        req = decode(await request.read(), CompletionRequest)
        self._check_model(req.model)
        prompts = self._prompt_ids(req.prompt)
        # echo with logprobs scores the prompt too (lm-evaluation-harness's loglikelihood)
        scores = req.logprobs if req.echo else None
        params = sampling_params(
            req, req.max_tokens, req.logprobs, default_max_tokens=16, prompt_logprobs=scores
        )
        self._check_length(prompts, params, chat=False)
        return await self._serve(request, policy, prompts, params, req, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        policy = self.tenants.identify(request.headers)
        req = decode(await request.read(), ChatCompletionRequest)
        self._check_model(req.model)
        ids = self._chat_prompt_ids(req)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens  # 0 is an error, not "unset"
        if max_tokens is None:
            max_tokens = req.max_tokens
        if max_tokens is None:
            room = self.llm.scheduler.max_model_len - len(ids)
            max_tokens = max(1, min(self.config.default_chat_max_tokens, room))
        params = sampling_params(req, max_tokens, logprobs, default_max_tokens=max_tokens)
        self._check_length([ids], params, chat=True)
        return await self._serve(request, policy, [ids], params, req, chat=True)

    async def _serve(
        self,
        http: web.Request,
        policy: TenantPolicy,
        prompts: list[list[int]],
        params: SamplingParams,
        req,
        chat: bool,
    ) -> web.StreamResponse:
        engine = self.llm.engine
        self.tenants.check_limits(policy, max(len(p) for p in prompts), params.max_tokens)
        count = len(prompts) * req.n
        try:
            waiting = engine.must_wait()
            self.config.queue.admit(
                len(waiting),
                sum(len(r.prompt_ids) for r in waiting),
                count,
                sum(len(p) for p in prompts) * req.n,
                engine.admission_rate() or self.estimated_admission_rate,
                tenant_queued=sum(r.tenant == policy.name for r in waiting),
                shared=any(r.tenant != policy.name for r in list(engine.requests.values())),
            )
            self.tenants.acquire(policy, count)
        except APIError as e:
            self.metrics.requests_rejected.labels(e.body["error"]["code"] or "limit").inc()
            raise
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        choices: list[_Choice] = []
        try:
            for ids in prompts:
                for i in range(req.n):
                    seed = None if params.seed is None else params.seed + i
                    stream = engine.submit(
                        ids,
                        dataclasses.replace(params, seed=seed),
                        tenant=policy.name,
                        priority=policy.priority,
                        loop=loop,
                        lazy=not req.stream,
                    )
                    choices.append(_Choice(len(choices), stream, ids))
            form = _format(chat, self.llm.tokenizer, req)
            response_id = form.id_prefix + uuid.uuid4().hex
            usage_prompt = sum(len(p) for p in prompts)
            if req.stream:
                return await self._stream(
                    http, response_id, choices, req, form, start, usage_prompt
                )
            await asyncio.gather(*(self._pump(c, start) for c in choices))
            return self._response(response_id, choices, form, usage_prompt)
        except RequestRejected as e:
            self.metrics.requests_rejected.labels("too_long").inc()
            raise _rejected(e, chat) from None
        finally:
            for c in choices:
                if c.finish_reason is None:
                    engine.cancel(c.stream.request_id)
            self.tenants.release(policy, count)
            for c in choices:
                self._log_request(c, policy, start)

    async def _pump(self, choice: _Choice, start: float, sink: asyncio.Queue | None = None):
        """Read one engine stream to its end, observing latency metrics on the way
        (at the engine's emit times: a lazy stream is read in batches)."""
        m = self.metrics
        last = None
        async for out in choice.stream:
            now = out.time
            if out.queue_seconds is not None:
                m.request_queue_time.observe(out.queue_seconds)
            if out.token_ids:
                if last is None:
                    choice.ttft = now - start
                    m.time_to_first_token.observe(choice.ttft)
                else:
                    m.inter_token_latency.observe(now - last)
                last = now
                m.generation_tokens.inc(len(out.token_ids))
            choice.outputs.append(out)
            choice.text += out.text
            if out.finished:
                choice.finish_reason = out.finish_reason
                m.e2e_request_latency.observe(now - start)
                m.prompt_tokens.inc(len(choice.prompt_ids))
                m.request_success.labels(out.finish_reason).inc()
            if sink is not None:
                await sink.put((choice, out))
        if choice.finish_reason == "error":
            raise APIError(500, "the engine failed while generating this request")

    def _response(
        self, response_id: str, choices: list[_Choice], form: fmt.ResponseFormat,
        prompt_tokens: int,
    ) -> web.Response:
        usage = fmt.usage(prompt_tokens, sum(c.num_tokens for c in choices))
        items = [
            form.choice(c.index, c.prompt_ids, c.text, c.outputs, c.finish_reason)
            for c in choices
        ]
        return _json(fmt.body(form.object_name, response_id, self.model_name, items, usage))

    async def _stream(
        self,
        http: web.Request,
        response_id: str,
        choices: list[_Choice],
        req,
        form: fmt.ResponseFormat,
        start: float,
        prompt_tokens: int,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sock = http.transport.get_extra_info("socket") if http.transport else None
        if sock is not None:
            # Autotuning grows a stalled reader's send buffer to megabytes; capped, the
            # writes below soon block, and with them the pumps (see `sink`).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        await resp.prepare(http)
        # Bounded, so a client that stops reading stops the pumps too: its engine
        # stream then fills and the engine cancels it (an unbounded sink would
        # buffer its whole output here instead).
        sink: asyncio.Queue = asyncio.Queue(maxsize=len(choices))
        pumps = [asyncio.create_task(self._pump(c, start, sink)) for c in choices]

        def chunk(items: list[dict], usage: dict | None = None) -> dict:
            return fmt.body(form.chunk_name, response_id, self.model_name, items, usage)

        async def send(body: dict | None) -> None:
            """One SSE event (None: the final [DONE]); ClientStalled if the client does not
            take it within the write timeout."""
            data = b"[DONE]" if body is None else msgspec.json.encode(body)
            try:
                # a timeout scope, not wait_for: that starts a task for every event
                async with asyncio.timeout(self.config.stream_write_timeout_s):
                    await resp.write(b"data: " + data + b"\n\n")
            except TimeoutError:
                raise ClientStalled(response_id) from None

        try:
            for c in choices:
                opening = form.opening(c.index, c.prompt_ids)
                if opening is not None:
                    await send(chunk([opening]))
            done = 0
            while done < len(choices):
                choice, out = await sink.get()
                done += out.finished
                if out.finish_reason == "error":
                    raise APIError(500, "the engine failed while generating this request")
                item = form.delta(choice.index, choice.prompt_ids, out)
                if out.text or out.finished or item["logprobs"]:
                    await send(chunk([item]))
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = fmt.usage(prompt_tokens, sum(c.num_tokens for c in choices))
                await send(chunk([], usage))
            await send(None)
        except ClientStalled:
            log.info("client of %s stopped reading: closing its connection", response_id)
            if http.transport is not None:
                http.transport.abort()
        except ConnectionError:
            log.info("client of %s went away: cancelling", response_id)
        finally:
            for task in pumps:
                task.cancel()
        return resp

    @staticmethod
    def _log_request(c: _Choice, policy: TenantPolicy, start: float) -> None:
        """One line per finished request; never the prompt text."""
        ttft = "-" if c.ttft is None else f"{c.ttft:.3f}s"
        log.info(
            "request %s tenant=%s prompt_tokens=%d output_tokens=%d ttft=%s e2e=%.3fs finish=%s",
            c.stream.request_id,
            policy.name,
            len(c.prompt_ids),
            c.num_tokens,
            ttft,
            time.monotonic() - start,
            c.finish_reason or "cancelled",
        )

    async def models(self, request: web.Request) -> web.Response:
        self._check_ready()
        self.tenants.identify(request.headers)
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "jaxserve"}
        return _json({"object": "list", "data": [card]})

    async def health(self, request: web.Request) -> web.Response:
        if self.load_error:
            return _json({"status": "failed", "error": self.load_error}, status=503)
        if self.draining or not self.ready:
            return _json({"status": "draining" if self.draining else "loading"}, status=503)
        return _json({"status": "ok"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def admin_requests(self, request: web.Request) -> web.Response:
        self._check_ready()
        if self.tenants.keys and not self.tenants.identify(request.headers).admin:
            raise APIError(401, "an admin API key is needed", code="not_admin")
        rows = [dataclasses.asdict(r) for r in self.llm.engine.live_requests()]
        return _json({"object": "list", "data": rows})


def _format(chat: bool, tokenizer, req) -> fmt.ResponseFormat:
    return fmt.ChatFormat(tokenizer, req) if chat else fmt.CompletionFormat(tokenizer, req)


def _rejected(e: RequestRejected, chat: bool) -> APIError:
    """The 400 of a request the engine can never run; a chat's prompt is its messages."""
    param = "messages" if chat and e.param == "prompt" else e.param
    return APIError(400, str(e), param=param, code=e.code)


def _json(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        headers=headers,
        content_type="application/json",
    )


@web.middleware
async def _errors(request: web.Request, handler):
    """Every error leaves as OpenAI's error object with the right status."""
    try:
        return await handler(request)
    except APIError as e:
        return _json(e.body, e.status, e.headers)
    except web.HTTPRequestEntityTooLarge as e:
        return _json(APIError(413, f"request body too large ({e.text})").body, 413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return _json(APIError(e.status, e.reason).body, e.status)
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return _json(APIError(500, "internal server error").body, 500)


def build_app(server: Server) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=server.config.max_body_bytes)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.metrics_route)
    app.router.add_get("/admin/requests", server.admin_requests)
    return app


async def serve(config: ServerConfig) -> None:
    """Open the port, load the model in the background, serve until SIGTERM/SIGINT, drain."""
    server = Server(config)
    runner = web.AppRunner(build_app(server), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, config.host, config.port).start()
    log.info("listening on http://%s:%d (loading the model)", config.host, config.port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loader = loop.run_in_executor(None, server.load)
    await stop.wait()
    log.info("draining: refusing new requests, finishing live ones")
    await server.drain()
    await runner.cleanup()
    await loader
    server.stop()


def run(config: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve(config))
