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
import os
import signal
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import uvloop
from aiohttp import web

from jaxserve.checkpoint.adapter import Adapter, AdapterError
from jaxserve.config import EngineConfig, SamplingParams
from jaxserve.host.request import RequestRejected
from jaxserve.serving import EngineClient, EngineFailed
from server import heap, openapi, prompts
from server import openai_format as fmt
from server.admission import QueuePolicy
from server.connections import ConnectionLimits, Site, read_body_within
from server.metrics import Metrics
from server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    LoadAdapterRequest,
    UnloadAdapterRequest,
    decode,
)
from server.responses import Choice, Responder, error_objects, json_response, log_request
from server.tenants import TenantPolicy, Tenants

log = logging.getLogger("jaxserve.server")

# a body this long or longer is tokenized off the event loop (`Server._prompt`): the
# tokenizer reads ~2 kB a millisecond here, so a shorter one holds the loop under ~2 ms
LONG_BODY_BYTES = 4096


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
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    max_body_bytes: int = 4 << 20
    drain_timeout_s: float = 30.0
    # a stream write blocked this long means the client stopped reading: drop it
    stream_write_timeout_s: float = 30.0
    # a step running longer fails the engine (None: 10x the slowest warm-up step, >= 30 s)
    step_timeout_s: float | None = None
    default_chat_max_tokens: int = 256  # OpenAI's completions default (16) is kept as is
    heap_trim_interval_s: float = 10.0  # return free heap pages to the OS (heap.py); 0: never
    shared_prefix_cache: bool = False  # with API keys, each tenant has its own prefix cache
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admins only, with keys)
    runtime_lora: bool = False
    engine: EngineConfig = field(default_factory=EngineConfig)


class Server:
    """Owns the engine (behind its client), tenants, queue policy and metrics; routes
    parse and check a request (server/prompts.py), admit it, submit it, and hand its
    streams to the Responder."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.tenants = Tenants.from_options(config.api_key, config.api_keys_file)
        self.metrics = Metrics()
        self.client: EngineClient | None = None
        self.responder: Responder | None = None
        self.model_name = config.served_model_name
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.warmup: tuple[int, int] = (0, 0)  # buckets compiled, of how many
        # long prompts are tokenized here, off the event loop (`_prompt`); its thread
        # starts now, so that the threads a soak counts when idle are all there are
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="tokenize")
        self._tokenizing.submit(lambda: None).result()

    # ---------------------------------------------------------------- lifecycle

    def load(self) -> None:
        """Load the model, compile every bucket, start the engine (on a worker thread)."""
        from jaxserve.llm import LLM  # jax loads here, off the event loop

        try:
            llm = LLM(self.config.model, self.config.engine, warmup=True,
                      warmup_progress=self._compiled)
        except Exception as e:
            log.exception("model failed to load")
            self.load_error = str(e)
            return
        # admission's rate until one is measured: full batches of chat answers
        client = EngineClient(llm, typical_output_tokens=self.config.default_chat_max_tokens)
        if self.model_name is None:
            path = client.model_path
            self.model_name = path.stem if path.is_file() else path.name
        self.responder = Responder(self.metrics, self.model_name,
                                   self.config.stream_write_timeout_s)
        self.metrics.bind(client.stats)
        # The ~400k objects that loading and compiling leave behind live as long as the
        # server: frozen, the collector never scans them again. Unfrozen, each full
        # collection held the GIL ~200 ms, a pause in every stream.
        gc.freeze()
        limit = client.start(lambda plan, time: self.metrics.observe_step(time),
                             self.config.step_timeout_s)
        log.info("a step running over %.0f s fails the engine (--step-timeout-s)", limit)
        self.client = client
        self.ready = True
        log.info("ready: %s in %s (weights %s, %.0f MiB, on %s; KV %s, %d B/token, %d "
                 "pages), %d buckets compiled", self.model_name, client.dtype,
                 client.weight_dtype, client.weight_bytes / 2**20, client.linear,
                 client.kv_dtype, client.kv_bytes_per_token,
                 client.stats().pages_usable, client.num_buckets)

    def _compiled(self, progress) -> None:
        """Each bucket compiled at start-up, counted for /health (the runner logs it)."""
        self.warmup = (progress.done, progress.total)

    async def drain(self) -> None:
        """Refuse new work (503), let live requests finish, cancel what is left."""
        self.draining = True
        client = self.client
        if client is None:
            return
        deadline = time.monotonic() + self.config.drain_timeout_s
        while client.num_live() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        client.cancel_all()
        while client.num_live() and time.monotonic() < deadline + 5:
            await asyncio.sleep(0.05)

    def stop(self) -> None:
        self._tokenizing.shutdown(wait=False)
        if self.client is not None:
            self.client.stop()

    # ---------------------------------------------------------------- checks

    def _check_ready(self) -> None:
        if self.client is not None and self.client.failure is not None:
            raise APIError(503, f"the engine has failed: {self.client.failure}",
                           code="engine_failed")
        if self.draining:
            raise APIError(503, "server is shutting down", code="draining")
        if not self.ready:
            raise APIError(503, "model is still loading", code="not_ready")

    def _adapter_for(self, model: str | None, policy: TenantPolicy) -> Adapter | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a
        model that is not served, or an adapter the tenant may not use (as OpenAI answers
        for a model one has no access to)."""
        if model is None or model == self.model_name:
            return None
        adapter = self.client.adapter(model)
        if adapter is None or not policy.may_use(model):
            raise APIError(
                404, f"model {model!r} does not exist or you do not have access to it",
                param="model", code="model_not_found",
            )
        return adapter

    def _cache_salt(self, policy: TenantPolicy) -> str:
        """Tenants configured by key get their own prefix-cache key space, so none can
        probe another's prompts by timing (unless --shared-prefix-cache)."""
        if self.tenants.keys and not self.config.shared_prefix_cache:
            return policy.name
        return ""

    # ---------------------------------------------------------------- routes

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        policy = self.tenants.identify(request.headers)
        raw = await request.read()
        req = decode(raw, CompletionRequest)
        adapter = self._adapter_for(req.model, policy)
        ids, params = await self._prompt(len(raw), prompts.completion, req, self.client)
        form = fmt.CompletionFormat(self.client.tokenizer, req)
        return await self._serve(request, policy, ids, params, req, form, adapter)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        self._check_ready()
        policy = self.tenants.identify(request.headers)
        raw = await request.read()
        req = decode(raw, ChatCompletionRequest)
        adapter = self._adapter_for(req.model, policy)
        ids, params = await self._prompt(len(raw), prompts.chat, req, self.client,
                                         self.config.default_chat_max_tokens)
        form = fmt.ChatFormat(self.client.tokenizer, req)
        return await self._serve(request, policy, [ids], params, req, form, adapter)

    async def _prompt(self, body_bytes: int, parse, *args):
        """`parse(*args)`: a request's prompt ids and parameters (server/prompts.py). A
        long body's on the tokenizing thread: the tokenizer lets go of the GIL, so the
        event loop serves other streams meanwhile; a 100 kB prompt held it ~50 ms, a gap
        in every stream (the soak's probe saw each one). A short one's inline, where the
        hop to a thread (~0.1 ms) would cost more than it saves."""
        if body_bytes < LONG_BODY_BYTES:
            return parse(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, parse, *args)

    async def _serve(
        self,
        http: web.Request,
        policy: TenantPolicy,
        prompt_ids: list[list[int]],
        params: SamplingParams,
        req: CompletionRequest | ChatCompletionRequest,
        form: fmt.ResponseFormat,
        adapter: Adapter | None,
    ) -> web.StreamResponse:
        """Admit (tenant limits, then the queue), submit n choices a prompt, answer."""
        client = self.client
        self.tenants.check_limits(policy, max(len(p) for p in prompt_ids), params.max_tokens)
        count = len(prompt_ids) * req.n
        try:
            queue = client.queue_stats(policy.name)
            # only the choices that the next step cannot admit wait: n=16 choices on an
            # idle server take 16 free rows at once and queue for nothing
            self.config.queue.admit(
                queue.must_wait,
                queue.must_wait_prompt_tokens,
                max(0, count - queue.free_rows),
                sum(len(p) for p in prompt_ids) * req.n,
                queue.admission_rate,
                tenant_queued=queue.tenant_must_wait,
                shared=queue.shared,
            )
            self.tenants.acquire(policy, count)
        except APIError as e:
            self.metrics.requests_rejected.labels(e.body["error"]["code"] or "limit").inc()
            raise
        if adapter is not None:
            self.metrics.lora_requests.labels(adapter.name).inc(count)
        start = time.monotonic()
        loop = asyncio.get_running_loop()
        choices: list[Choice] = []
        try:
            for ids in prompt_ids:
                for i in range(req.n):
                    seed = None if params.seed is None else params.seed + i
                    stream = client.submit(
                        ids,
                        dataclasses.replace(params, seed=seed),
                        tenant=policy.name,
                        priority=policy.priority,
                        loop=loop,
                        lazy=not req.stream,
                        cache_salt=self._cache_salt(policy),
                        adapter=adapter,
                    )
                    choices.append(Choice(len(choices), stream, ids))
            response_id = form.id_prefix + uuid.uuid4().hex
            usage_prompt = sum(len(p) for p in prompt_ids)
            if req.stream:
                include_usage = req.stream_options is not None and req.stream_options.include_usage
                return await self.responder.stream(
                    http, response_id, choices, form, start, usage_prompt, include_usage
                )
            return await self.responder.whole(response_id, choices, form, start, usage_prompt)
        except RequestRejected as e:
            self.metrics.requests_rejected.labels("too_long").inc()
            raise prompts.rejected(e, isinstance(req, ChatCompletionRequest)) from None
        except EngineFailed as e:
            raise APIError(503, f"the engine has failed: {e}", code="engine_failed") from None
        finally:
            for c in choices:
                if c.finish_reason is None:
                    client.cancel(c.stream.request_id)
            self.tenants.release(policy, count)
            for c in choices:
                log_request(c, policy.name, start)

    async def models(self, request: web.Request) -> web.Response:
        self._check_ready()
        policy = self.tenants.identify(request.headers)
        client = self.client
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "jaxserve",
                "max_model_len": client.max_model_len, "dtype": client.dtype,
                "weight_dtype": client.weight_dtype, "kv_dtype": client.kv_dtype}
        # each LoRA adapter the caller may use, as vLLM lists them: parent the base model
        adapters = [{**card, "id": a.name, "parent": self.model_name, "root": str(a.path)}
                    for a in client.adapters() if policy.may_use(a.name)]
        return json_response({"object": "list", "data": [card, *adapters]})

    async def health(self, request: web.Request) -> web.Response:
        failure = self.load_error or (self.client and self.client.failure)
        if failure:
            return json_response({"status": "failed", "error": failure}, status=503)
        if self.draining:
            return json_response({"status": "draining"}, status=503)
        if not self.ready:
            compiled, buckets = self.warmup
            body = {"status": "loading", "compiled": compiled, "buckets": buckets}
            return json_response(body, status=503)
        return json_response({"status": "ok"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def admin_requests(self, request: web.Request) -> web.Response:
        self._check_ready()
        self._check_admin(request)
        rows = [dataclasses.asdict(r) for r in self.client.live_requests()]
        return json_response({"object": "list", "data": rows})

    def _check_admin(self, request: web.Request) -> None:
        if self.tenants.keys and not self.tenants.identify(request.headers).admin:
            raise APIError(401, "an admin API key is needed", code="not_admin")

    def _check_runtime_lora(self, request: web.Request) -> None:
        self._check_ready()
        if not self.config.runtime_lora:
            raise APIError(404, "loading LoRA adapters at run time is off (start the server "
                           "with --enable-runtime-lora)", code="runtime_lora_disabled")
        self._check_admin(request)

    async def load_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route: serve a PEFT adapter directory as a new model name."""
        self._check_runtime_lora(request)
        req = decode(await request.read(), LoadAdapterRequest)
        if req.lora_name == self.model_name or self.client.adapter(req.lora_name):
            raise APIError(400, f"{req.lora_name!r} is already a served model's name",
                           param="lora_name")
        loop = asyncio.get_running_loop()
        try:  # reading the weights blocks on the disk: off the event loop
            adapter = await loop.run_in_executor(
                None, self.client.load_adapter, req.lora_name, req.lora_path)
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path", code="invalid_adapter") from None
        log.info("loaded LoRA adapter %s (rank %d) from %s", adapter.name, adapter.rank,
                 adapter.path)
        return json_response({"object": "lora_adapter", "id": adapter.name,
                              "parent": self.model_name, "rank": adapter.rank})

    async def unload_adapter(self, request: web.Request) -> web.Response:
        """vLLM's route: stop serving an adapter; requests running with it finish."""
        self._check_runtime_lora(request)
        req = decode(await request.read(), UnloadAdapterRequest)
        try:
            self.client.unload_adapter(req.lora_name)
        except KeyError:
            raise APIError(404, f"no LoRA adapter named {req.lora_name!r} is loaded",
                           param="lora_name", code="model_not_found") from None
        log.info("unloaded LoRA adapter %s", req.lora_name)
        return json_response({"object": "lora_adapter", "id": req.lora_name,
                              "deleted": True})


def build_app(server: Server) -> web.Application:
    read_body = read_body_within(server.config.connections.request_read_timeout_s)
    app = web.Application(middlewares=[error_objects, read_body],
                          client_max_size=server.config.max_body_bytes)
    app.router.add_post("/v1/completions", server.completions)
    app.router.add_post("/v1/chat/completions", server.chat_completions)
    app.router.add_get("/v1/models", server.models)
    app.router.add_get("/health", server.health)
    app.router.add_get("/metrics", server.metrics_route)
    app.router.add_get("/admin/requests", server.admin_requests)
    app.router.add_post("/v1/load_lora_adapter", server.load_adapter)
    app.router.add_post("/v1/unload_lora_adapter", server.unload_adapter)
    app.router.add_get("/openapi.json", openapi.route(server))
    return app


FAILED_GRACE_S = 2.0  # seconds a failed engine's server stays up, answering 503


async def serve(config: ServerConfig) -> int:
    """Open the port, load the model in the background, serve until SIGTERM/SIGINT or an
    engine failure, drain. Returns the exit status: 1 when the engine failed."""
    server = Server(config)
    runner = web.AppRunner(build_app(server), handler_cancellation=True)
    await runner.setup()
    await Site(runner, config.host, config.port, config.connections).start()
    log.info("listening on http://%s:%d (loading the model)", config.host, config.port)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loader = loop.run_in_executor(None, server.load)
    watcher = asyncio.create_task(_watch_engine(server, stop))
    trimmer = asyncio.create_task(heap.trim_periodically(config.heap_trim_interval_s))
    await stop.wait()
    failed = watcher.done()
    watcher.cancel()
    trimmer.cancel()
    if failed:  # /health says "failed" for a moment, for probes and the clients' last events
        await asyncio.sleep(FAILED_GRACE_S)
    log.info("draining: refusing new requests, finishing live ones")
    await server.drain()
    await runner.cleanup()
    if not loader.done():  # stopped during warm-up: the compiling thread cannot be joined
        log.info("stopped during warm-up")
        logging.shutdown()
        os._exit(0)
    await loader
    server.stop()
    return 1 if failed else 0


async def _watch_engine(server: Server, stop: asyncio.Event) -> None:
    """Stop the server once its engine has failed, so a supervisor restarts the process
    instead of a live port hiding a dead engine."""
    while server.client is None or server.client.failure is None:
        await asyncio.sleep(0.2)
    log.critical("the engine has failed (%s): exiting", server.client.failure)
    stop.set()


def run(config: ServerConfig) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    status = uvloop.run(serve(config))  # libuv's loop: half the CPU a connection costs
    if status:
        raise SystemExit(status)
