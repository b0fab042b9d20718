"""Slow, idle and surplus connections: none may hold the server or delay its streams.

aiohttp bounds how large a request's headers may be, not how long they take to come,
nor how many connections are open. Here a connection must send a complete request
in time: its headers within `request_read_timeout_s` of opening (or of its previous
answer: an idle keep-alive connection is closed then too), its body within as long
again, or it is closed. Past `max_connections` open, a new connection is answered 503
at once and closed, so a caller never hangs. Each costs the event loop a timer and a
few callbacks, never a wait.
"""

import asyncio
import logging
import math
import resource
import time
from dataclasses import dataclass

import msgspec
from aiohttp import web

from server.protocol import APIError
from server.responses import json_response

log = logging.getLogger("jaxserve.server")

FD_HEADROOM = 256  # open files kept for the process itself: weights, caches, pipes
BACKLOG = 1024  # connections the kernel holds until accepted: room for a burst
REFUSAL_LOG_S = 10.0  # at most one log line this often about refused connections


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """How many connections may be open, and how long each may take over a request."""

    # Defaults a vLLM or TGI user would not notice: more connections than a benchmark
    # at high concurrency opens (uvicorn has no cap, nginx 512 a worker), and 30 s for a
    # request's headers, and then its body (hyper's header timeout; nginx's are 60 s).
    # Idle keep-alive connections last as long: longer than clients keep idle ones
    # (httpx 5 s, aiohttp 15 s), so the client closes first and never reuses a dead one.
    max_connections: int = 2048
    request_read_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be at least 1, not {self.max_connections}")
        if not self.request_read_timeout_s > 0:
            raise ValueError("--request-read-timeout-s must be above 0, not "
                             f"{self.request_read_timeout_s:g}")


class _Gate:
    """Open connections, counted as each is made and lost (exact, unlike counting at
    accept: a burst is accepted before any connection is made)."""

    def __init__(self, limit: int):
        self.limit = limit
        self.open = 0
        self.refused = 0  # since the last log line
        self.logged_at = -math.inf
        error = APIError(503, f"the server has {limit} connections open, its limit; retry",
                         code="too_many_connections")
        body = msgspec.json.encode(error.body)
        self.refusal = (
            b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            b"Retry-After: 1\r\nConnection: close\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )

    def refuse(self, transport: asyncio.Transport) -> None:
        transport.write(self.refusal)
        transport.close()
        self.refused += 1
        now = time.monotonic()
        if now - self.logged_at >= REFUSAL_LOG_S:
            log.warning("refused %d connection(s): %d open, the limit (--max-connections)",
                        self.refused, self.open)
            self.refused, self.logged_at = 0, now


class _Handler(web.RequestHandler):
    """aiohttp's protocol for one connection, counted by the gate; past the limit it
    answers 503 and closes instead."""

    __slots__ = ("_counted", "_gate")

    def __init__(self, gate: _Gate, manager: web.Server, **kwargs):
        super().__init__(manager, **kwargs)
        self._gate = gate
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self._gate
        if gate.open >= gate.limit:
            gate.refuse(transport)
            return
        gate.open += 1
        self._counted = True
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:  # a refused connection never started
            self._counted = False
            self._gate.open -= 1
            super().connection_lost(exc)


class Site(web.BaseSite):
    """The listening TCP socket, whose connections obey `ConnectionLimits` (aiohttp's
    TCPSite makes plain ones). The runner's cleanup closes it."""

    __slots__ = ("_host", "_limits", "_port")

    def __init__(self, runner: web.AppRunner, host: str, port: int, limits: ConnectionLimits):
        super().__init__(runner, backlog=BACKLOG)
        self._host, self._port, self._limits = host, port, limits

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        gate = _Gate(fit_open_files(self._limits.max_connections))
        manager = self._runner.server
        # aiohttp closes a connection that has sent no complete request's headers when
        # its keep-alive timer fires: from its opening, and again after each answer
        timeout = self._limits.request_read_timeout_s

        def handler() -> _Handler:
            return _Handler(gate, manager, loop=loop, keepalive_timeout=timeout,
                            access_log=None)

        self._server = await loop.create_server(handler, self._host, self._port,
                                                backlog=self._backlog)


def read_body_within(timeout_s: float):
    """Middleware: a request's body must come within `timeout_s` of its headers, or it
    is answered 408 and its connection closed (a body trickled byte by byte would hold
    its handler forever). Handlers then read the body at once, from memory."""

    @web.middleware
    async def read_body(request: web.Request, handler):
        if request.body_exists:
            try:
                async with asyncio.timeout(timeout_s):
                    await request.read()
            except TimeoutError:
                error = APIError(408, f"the request body did not arrive within {timeout_s:g} s",
                                 code="request_timeout")
                response = json_response(error.body, 408)
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
                if request.transport is not None:  # no lingering for the rest of it
                    request.transport.close()
                return response
        return await handler(request)

    return read_body


def fit_open_files(max_connections: int) -> int:
    """How many connections the process may keep open: the soft open-file limit is
    raised (up to the hard one) to fit `max_connections` and FD_HEADROOM, or the cap
    is lowered to fit it, said in the log. Past the open-file limit accept() fails,
    and the loop stops listening for a while: every caller would wait."""
    soft, hard = (math.inf if n == resource.RLIM_INFINITY else n
                  for n in resource.getrlimit(resource.RLIMIT_NOFILE))
    want = max_connections + FD_HEADROOM
    if soft < want:
        soft = min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE,
                           (soft, resource.RLIM_INFINITY if hard == math.inf else hard))
    if soft >= want:
        return max_connections
    fit = max(1, soft - FD_HEADROOM)
    log.warning("the open-file limit (%d, ulimit -n) leaves room for %d connections: "
                "serving at most that many, not %d (--max-connections)", soft, fit,
                max_connections)
    return fit
