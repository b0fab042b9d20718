"""The gateway's aiohttp app: the OpenAI routes in front of the pools, the Batch API, and
its own health, metrics and admin view.

    POST /v1/completions, /v1/chat/completions   routed to a pool's replica (proxy.py)
    GET  /v1/models                              every pool's model
    /v1/files, /v1/batches                       the Batch API (batch_api.py)
    GET  /health                                 200 while every pool has a replica up
    GET  /metrics                                jaxserve:gateway_* (metrics.py)
    GET  /admin/pools                            each pool's replicas as last polled
"""

import asyncio
import contextlib
import logging
import signal
import time
from pathlib import Path

import aiohttp
import uvloop
from aiohttp import web

from gateway import batch_api
from gateway.auth import KeyCheck
from gateway.batch_runner import BatchRunner
from gateway.batch_store import REQUEST_STATES, BatchStore
from gateway.config import GatewayConfig
from gateway.guardrails import Guardrail
from gateway.metrics import GatewayMetrics
from gateway.proxy import Proxy
from gateway.replicas import Poller, Replica
from gateway.routing import Router
from gateway.spawn import Spawned
from server.connections import ConnectionLimits, Site
from server.responses import error_objects, json_response

log = logging.getLogger("jaxserve.gateway")


class Gateway:
    """Everything one gateway holds; built and torn down on its event loop."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.metrics = GatewayMetrics()
        self.replicas = {p.name: [Replica(url, p.name) for url in p.replicas]
                         for p in config.pools}
        self.router = Router(config, self.replicas)
        self.created = int(time.time())

    async def start(self) -> None:
        # no pooled-connection limit: each stream holds its own connection upstream
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5))
        guardrails = {name: Guardrail(c, self.session, self.metrics.guardrail)
                      for name, c in self.config.checks.items()}
        self.proxy = Proxy(self.router, self.session, guardrails, self.metrics,
                           self.config.stream_write_timeout_s, self.config.batch_api_key)
        self.poller = Poller([r for rs in self.replicas.values() for r in rs], self.session,
                             self.config.poll_interval_s, self.metrics.polled)
        await self.poller.poll_all()  # a first view before any request is routed
        self.poller.start()
        self.keys = KeyCheck(self.poller.replicas, self.session)
        self.store = BatchStore(self.config.batch_db)
        self.runner = BatchRunner(self.store, self.proxy.send_batch, self._spare,
                                  self.config.batch_poll_s)
        await self.runner.start()

    async def stop(self) -> None:
        await self.runner.stop()
        await self.poller.stop()
        await self.session.close()
        self.store.close()

    def _spare(self, model: str) -> int:
        return max(0, self.proxy.batch_capacity(model) - self.runner.in_flight(model))

    # ------------------------------------------------------------------ routes

    async def models(self, request: web.Request) -> web.Response:
        data = [{"id": model, "object": "model", "created": self.created, "owned_by": "jaxserve",
                 "pools": [p.name for p in self.config.pools_for(model)]}
                for model in self.config.models]
        return json_response({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        down = [name for name, rs in self.replicas.items() if not any(r.up for r in rs)]
        if down:
            return json_response({"status": "degraded", "pools_down": down}, status=503)
        return json_response({"status": "ok"})

    async def metrics_route(self, request: web.Request) -> web.Response:
        counts = self.store.request_states()
        for state in REQUEST_STATES:  # a state none is in any more reads 0
            self.metrics.batch_requests.labels(state).set(counts.get(state, 0))
        return web.Response(body=self.metrics.render(),
                            content_type="text/plain", charset="utf-8")

    async def admin_pools(self, request: web.Request) -> web.Response:
        pools = [{"name": p.name, "model": p.model, "min_prompt_tokens": p.min_prompt_tokens,
                  "max_prompt_tokens": p.max_prompt_tokens, "priorities": list(p.priorities),
                  "input_check": p.input_check, "output_check": p.output_check,
                  "replicas": [r.state() for r in self.replicas[p.name]]}
                 for p in self.config.pools]
        return json_response({"pools": pools})


# the routes the gateway answers itself, for callers a replica would serve
OWN_ROUTES = ("/v1/files", "/v1/batches", "/admin/")


def build_app(gateway: Gateway) -> web.Application:
    @web.middleware
    async def keys(request: web.Request, handler):
        if request.path.startswith(OWN_ROUTES):
            await gateway.keys.check(request.headers.get("Authorization", ""))
        return await handler(request)

    app = web.Application(middlewares=[error_objects, keys], client_max_size=64 << 20)
    app.router.add_post("/v1/completions", lambda r: gateway.proxy.handle(r))
    app.router.add_post("/v1/chat/completions", lambda r: gateway.proxy.handle(r))
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.metrics_route)
    app.router.add_get("/admin/pools", gateway.admin_pools)
    batch_api.add_routes(app, gateway.store, gateway.runner, gateway.config.models)
    return app


async def serve(config: GatewayConfig, spawn: bool = False) -> int:
    """Start (the spawned processes, then) the gateway; serve until SIGTERM or SIGINT."""
    spawned = Spawned(Path(config.batch_db).parent / "logs") if spawn else None
    if spawned is not None:
        config = spawned.start(config)
    try:
        gateway = Gateway(config)
        await gateway.start()
        runner = web.AppRunner(build_app(gateway), handler_cancellation=True)
        await runner.setup()
        await Site(runner, config.host, config.port, ConnectionLimits()).start()
        log.info("gateway on http://%s:%d: %s", config.host, config.port, ", ".join(
            f"pool {p.name} ({p.model}, {len(p.replicas)} replicas)" for p in config.pools))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("stopping")
        await runner.cleanup()
        await gateway.stop()
    finally:
        if spawned is not None:
            with contextlib.suppress(Exception):
                spawned.stop()
    return 0


def run(config: GatewayConfig, spawn: bool = False) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    raise SystemExit(uvloop.run(serve(config, spawn)))
