"""Passing a request to a replica and its answer back: whole, or streamed chunk by chunk.

A stream is written on as each chunk arrives (nothing held beyond that chunk). A
client that goes away cancels the handler (aiohttp's handler cancellation), which
closes the upstream connection, and the replica cancels the request and frees its
pages. A replica's 429 goes back to the client with its Retry-After, unless another
replica of the pool has headroom: then the request is sent there, once. A refused
connection (the replica is down, nothing was sent) is retried the same way; a
replica lost mid-answer ends that request with an error (502, or for a stream a
final error event and [DONE]), since it may have run.

Output guardrails read the streamed text in windows while the chunks pass through;
only the end of the stream (the finishing chunk and [DONE]) waits for the last
checks. A refusal ends the stream with finish_reason "content_filter", so at most a
window and one check's latency of text reach the client before it.
"""

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from gateway.config import PoolConfig
from gateway.guardrails import Guardrail, OutputWindows, input_text
from gateway.metrics import GatewayMetrics
from gateway.replicas import Replica
from gateway.routing import Router
from server.protocol import APIError
from server.responses import json_response

REQUEST_HEADERS = ("Authorization", "X-Tenant", "X-Priority", "X-Request-Id")
RESPONSE_HEADERS = ("Retry-After", "X-Request-Id")
PRIORITY_HEADER_VALUES = ("interactive", "batch")


class Proxy:
    def __init__(self, router: Router, session: aiohttp.ClientSession,
                 guardrails: dict[str, Guardrail], metrics: GatewayMetrics,
                 write_timeout_s: float = 30.0, batch_api_key: str | None = None):
        self.router = router
        self.session = session
        self.guardrails = guardrails
        self.metrics = metrics
        self.write_timeout_s = write_timeout_s
        self.batch_api_key = batch_api_key

    # ------------------------------------------------------------------ interactive

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """POST /v1/completions and /v1/chat/completions."""
        start = time.monotonic()
        raw = await request.read()
        body = _json_object(raw)
        priority = request.headers.get("X-Priority", "interactive")
        if priority not in PRIORITY_HEADER_VALUES:
            raise APIError(400, f"X-Priority must be one of {PRIORITY_HEADER_VALUES}",
                           param="X-Priority")
        body, raw = self._with_model(body, raw)
        pool = self.router.pool_for(body["model"], request.path, body, priority)
        await self._check_input(pool, body)
        headers = {h: request.headers[h] for h in REQUEST_HEADERS if h in request.headers}
        async with self._upstream(pool, request.path, raw, headers) as (replica, upstream):
            passed = {h: upstream.headers[h] for h in RESPONSE_HEADERS if h in upstream.headers}
            if upstream.status == 200 and body.get("stream"):
                resp = await self._stream(request, pool, replica, upstream, passed, start)
            else:
                resp = await self._whole(pool, replica, upstream, passed)
        self.metrics.e2e.labels(pool.name).observe(time.monotonic() - start)
        return resp

    def _with_model(self, body: dict, raw: bytes) -> tuple[dict, bytes]:
        """A request without `model` goes to the gateway's only model, as vLLM serves its
        only model; with several models it must say which."""
        if body.get("model") is not None:
            return body, raw
        if len(self.router.config.models) != 1:
            raise APIError(400, "model is required: this gateway serves "
                           f"{list(self.router.config.models)}", param="model")
        body = {**body, "model": self.router.config.models[0]}
        return body, json.dumps(body).encode()

    async def _check_input(self, pool: PoolConfig, body: dict) -> None:
        if pool.input_check is None:
            return
        verdict = await self.guardrails[pool.input_check].check(
            self._input_text(pool, body), "input", body["model"])
        if not verdict.allowed:
            self.metrics.refused.labels(pool.name, "input_check").inc()
            raise APIError(400, f"the request was refused by the input check: {verdict.reason}",
                           code="content_filter")

    def _input_text(self, pool: PoolConfig, body: dict) -> str:
        """What the input check reads; token-id prompts as their text, so they cannot
        pass a check unread (a pool without a tokenizer refuses them)."""
        prompt = body.get("prompt")
        ids = [prompt] if _is_ids(prompt) else prompt
        if not (isinstance(ids, list) and ids and all(_is_ids(p) for p in ids)):
            return input_text(body)
        tokenizer = self.router.tokenizers.get(pool.name)
        if tokenizer is None:
            raise APIError(400, f"pool {pool.name!r} checks its input: send the prompt as "
                           "text (it has no tokenizer to read token ids)", param="prompt")
        return "\n".join(tokenizer.decode(p) for p in ids)

    @contextlib.asynccontextmanager
    async def _upstream(
        self, pool: PoolConfig, path: str, raw: bytes, headers: dict[str, str],
        replicas: list[Replica] | None = None, batch: bool = False,
    ) -> AsyncIterator[tuple[Replica, aiohttp.ClientResponse]]:
        """The replica's response to the request: the pool's replica with the most
        headroom (among `replicas` when given), once more elsewhere after a 429 or a
        refused connection."""
        tried: list[Replica] = []
        while True:
            replica = self.router.replica_for(pool, tuple(tried), replicas)
            if replica is None:
                self.metrics.refused.labels(pool.name, "no_replica").inc()
                raise APIError(503, f"no replica of pool {pool.name!r} is up",
                               code="no_replica", headers={"Retry-After": "1"})
            if tried:
                self.metrics.retried.labels(pool.name, replica.url).inc()
            tried.append(replica)
            last_try = len(tried) == 2
            replica.in_flight += 1
            replica.batch_in_flight += batch
            replica.sent_since_poll += 1
            try:
                self.metrics.routed.labels(pool.name, replica.url).inc()
                try:
                    upstream = await self.session.post(
                        replica.url + path, data=raw,
                        headers={**headers, "Content-Type": "application/json"})
                except aiohttp.ClientConnectorError as e:  # nothing was sent: try another
                    replica.mark_down(f"connection refused: {e}")
                    if last_try or self.router.replica_for(pool, tuple(tried), replicas) is None:
                        raise _lost(pool, replica, self.metrics) from None
                    continue
                except (aiohttp.ClientError, TimeoutError) as e:
                    replica.mark_down(f"{type(e).__name__}: {e}")
                    raise _lost(pool, replica, self.metrics) from None
                if upstream.status == 429 and not last_try and self._has_headroom(
                        pool, tried, replicas):
                    upstream.release()
                    continue
                try:
                    yield replica, upstream
                finally:
                    upstream.close()  # unread (a client gone): the replica sees it go
                return
            finally:
                replica.in_flight -= 1
                replica.batch_in_flight -= batch

    def _has_headroom(self, pool: PoolConfig, tried: list[Replica],
                      replicas: list[Replica] | None) -> bool:
        """Whether another replica (of `replicas`, when given) is up with none waiting: a
        429 is retried there, once."""
        other = self.router.replica_for(pool, tuple(tried), replicas)
        return other is not None and other.waiting == 0

    async def _whole(self, pool: PoolConfig, replica: Replica,
                     upstream: aiohttp.ClientResponse, passed: dict) -> web.Response:
        try:
            data = await upstream.read()
        except (aiohttp.ClientError, TimeoutError) as e:
            replica.mark_down(f"{type(e).__name__}: {e}")
            raise _lost(pool, replica, self.metrics) from None
        if upstream.status == 200 and pool.output_check is not None:
            body = json.loads(data)
            await self._check_whole_output(pool, body)
            return json_response(body, headers=passed)
        return web.Response(body=data, status=upstream.status, headers=passed,
                            content_type=upstream.content_type)

    async def _check_whole_output(self, pool: PoolConfig, body: dict) -> None:
        """A non-streamed answer's choices, each checked whole; a refused one is emptied
        and finishes with "content_filter"."""
        guardrail = self.guardrails[pool.output_check]
        for choice in body.get("choices", ()):
            message = choice.get("message")
            text = message.get("content") if message is not None else choice.get("text")
            if not text:
                continue
            verdict = await guardrail.check(text, "output", body.get("model", pool.model))
            if not verdict.allowed:
                if message is not None:
                    message["content"] = ""
                else:
                    choice["text"] = ""
                choice["finish_reason"] = "content_filter"

    async def _stream(self, request: web.Request, pool: PoolConfig, replica: Replica,
                      upstream: aiohttp.ClientResponse, passed: dict,
                      start: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={**passed, "Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})
        await resp.prepare(request)
        check = None
        if pool.output_check is not None:
            check = StreamCheck(self.guardrails[pool.output_check], pool.model)
        waiting_first = True
        try:
            async for data in _events(upstream):
                if waiting_first and _has_output(data):
                    self.metrics.ttft.labels(pool.name).observe(time.monotonic() - start)
                    waiting_first = False
                if check is not None:
                    ending = await check.see(data)
                    if ending is not None:  # refused: the stream ends here
                        await self._write(resp, ending)
                        return resp
                await self._write(resp, data)
        except (aiohttp.ClientError, TimeoutError) as e:
            # the replica was lost mid-stream: the status line has gone, so an error event
            replica.mark_down(f"{type(e).__name__}: {e}")
            self.metrics.failed.labels(pool.name, replica.url).inc()
            error = APIError(502, f"the replica serving this request failed: {e}",
                             code="replica_failed")
            await self._write(resp, _sse(error.body) + _sse(None))
        except ConnectionError:
            pass  # the client went away: leaving closes the upstream connection
        return resp

    async def _write(self, resp: web.StreamResponse, data: bytes) -> None:
        """A client that does not take a chunk within the write timeout has stopped
        reading: its connection is dropped, and with it the replica's request."""
        try:
            async with asyncio.timeout(self.write_timeout_s):
                await resp.write(data)
        except TimeoutError:
            raise ConnectionResetError("the client stopped reading") from None

    # ------------------------------------------------------------------ batch

    async def send_batch(self, path: str, body: dict) -> tuple[int, dict]:
        """One batch request, at the batch class, to a replica with spare capacity; 429
        when none has any now (the runner tries again later)."""
        try:
            pool = self.router.pool_for(body.get("model"), path, body, "batch")
            spare = [r for r in self.router.batch_replicas(pool)
                     if r.batch_in_flight < pool.batch_max_in_flight]
            if not spare:
                raise APIError(429, "no spare capacity now", headers={"Retry-After": "1"})
            headers = {"X-Priority": "batch"}
            if self.batch_api_key:
                headers["Authorization"] = f"Bearer {self.batch_api_key}"
            raw = json.dumps({**body, "stream": False}).encode()
            async with self._upstream(pool, path, raw, headers, spare, batch=True) as (
                replica, upstream,
            ):
                try:
                    data = await upstream.json(content_type=None)
                except (aiohttp.ClientError, TimeoutError) as e:
                    replica.mark_down(f"{type(e).__name__}: {e}")
                    raise _lost(pool, replica, self.metrics) from None
                except ValueError:
                    raise APIError(502, "the replica's answer was not JSON") from None
                if upstream.status == 200 and pool.output_check is not None:
                    await self._check_whole_output(pool, data)
                return upstream.status, data
        except APIError as e:
            return e.status, e.body

    def batch_capacity(self, model: str) -> int:
        """Batch requests `model`'s pools may run at once now: `batch_max_in_flight` on
        each replica with spare capacity."""
        return sum(p.batch_max_in_flight * len(self.router.batch_replicas(p))
                   for p in self.router.config.pools_for(model) if "batch" in p.priorities)


class StreamCheck:
    """The output check of one stream: windows per choice, one check in flight at a time."""

    def __init__(self, guardrail: Guardrail, model: str):
        self.guardrail = guardrail
        self.model = model
        self.windows: dict[int, OutputWindows] = {}
        self.pending: asyncio.Task | None = None
        self.last: dict | None = None  # the latest chunk: its id, model and object

    async def see(self, event: bytes) -> bytes | None:
        """Look at the next SSE event before it is passed on; the stream's refusal ending
        (bytes) when a check has refused, else None."""
        payload = event.removeprefix(b"data: ").strip()
        finishing = payload == b"[DONE]"
        for choice in self._choices(payload):
            windows = self.windows.get(choice.get("index", 0))
            if windows is None:
                windows = OutputWindows(self.guardrail.config.window_chars)
                self.windows[choice.get("index", 0)] = windows
            text = _choice_text(choice)
            window = windows.feed(text) if text else None
            if window is not None and not await self._check(window):
                return self._refusal()
            finishing |= choice.get("finish_reason") is not None
        if self.pending is not None and (self.pending.done() or finishing):
            if not await self._settle():
                return self._refusal()
        if finishing:  # the end waits for every window, the last one included
            for windows in self.windows.values():
                tail = windows.finish()
                if tail is not None and not (await self._check(tail) and await self._settle()):
                    return self._refusal()
        return None

    def _choices(self, payload: bytes) -> list[dict]:
        """An event's choices (none for [DONE], an error or the usage chunk)."""
        try:
            chunk = json.loads(payload)
        except ValueError:
            return []
        if not isinstance(chunk, dict) or not chunk.get("choices"):
            return []
        self.last = chunk
        return [c for c in chunk["choices"] if isinstance(c, dict)]

    async def _check(self, text: str) -> bool:
        """Start checking `text` once the previous check is in; False if that one refused."""
        allowed = await self._settle()
        self.pending = asyncio.ensure_future(self.guardrail.check(text, "output", self.model))
        return allowed

    async def _settle(self) -> bool:
        if self.pending is None:
            return True
        verdict = await self.pending
        self.pending = None
        return verdict.allowed

    def _refusal(self) -> bytes:
        if self.pending is not None:
            self.pending.cancel()
        last = self.last or {}
        chat = last.get("object") == "chat.completion.chunk"
        choices = [
            {"index": i, "delta": {}, "finish_reason": "content_filter", "logprobs": None}
            if chat else
            {"index": i, "text": "", "finish_reason": "content_filter", "logprobs": None}
            for i in sorted(self.windows or {0: None})
        ]
        chunk = {"id": last.get("id", ""), "object": last.get("object", "text_completion"),
                 "created": last.get("created", int(time.time())),
                 "model": last.get("model", self.model), "choices": choices}
        return _sse(chunk) + _sse(None)


async def _events(upstream: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The SSE events of a stream, each as it arrived (its lines and the blank line)."""
    event = b""
    async for line in upstream.content:
        event += line
        if line in (b"\n", b"\r\n"):
            yield event
            event = b""
    if event:
        yield event


def _is_ids(prompt: object) -> bool:
    """A prompt given as token ids."""
    return isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)


def _has_output(event: bytes) -> bool:
    """Whether an SSE event carries generated text (a chat stream opens with a role-only
    chunk, sent before the prompt is computed): where time to first token ends."""
    payload = event.removeprefix(b"data: ").strip()
    try:
        chunk = json.loads(payload)
    except ValueError:
        return payload == b"[DONE]"
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    return bool(choices) and any(_choice_text(c) or c.get("finish_reason") for c in choices)


def _choice_text(choice: dict) -> str:
    delta = choice.get("delta")
    text = delta.get("content") if isinstance(delta, dict) else choice.get("text")
    return text if isinstance(text, str) else ""


def _sse(body: dict | None) -> bytes:
    return b"data: " + (b"[DONE]" if body is None else json.dumps(body).encode()) + b"\n\n"


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        raise APIError(400, "the body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the body must be a JSON object")
    return body


def _lost(pool: PoolConfig, replica: Replica, metrics: GatewayMetrics) -> APIError:
    metrics.failed.labels(pool.name, replica.url).inc()
    return APIError(502, f"replica {replica.url} of pool {pool.name!r} failed; "
                    f"{replica.last_error}", code="replica_failed")
