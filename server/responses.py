"""From engine streams to an HTTP answer: one JSON body, or SSE events as tokens come.

Each choice of a response is one engine request with its output stream, read (the
latency metrics observed at the engine's emit times) by the answer's own task for one
choice, else by a pump each into a bounded sink. A stream writes through that and a
small socket buffer, so a client that falls behind stops the reading and its outputs
wait in its engine streams, merged (bounded by the request's own output). Only a
client that has not read for the write timeout is dropped, and its requests cancelled:
a reader that lags for a moment loses nothing.
"""

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from jaxserve.host import faults
from jaxserve.host.stream import OutputStream, RequestOutput
from server import openai_format as fmt
from server.metrics import Metrics
from server.protocol import APIError

log = logging.getLogger("jaxserve.server")

STREAM_SEND_BUFFER = 32 << 10  # kernel send buffer of one stream, bytes (Linux doubles it)


class ClientStalled(ConnectionError):
    """A streaming client stopped reading: its writes stayed blocked past the timeout."""


@dataclass
class Choice:
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


def json_response(body: dict, status: int = 200, headers: dict | None = None) -> web.Response:
    return web.Response(
        body=msgspec.json.encode(body),
        status=status,
        headers=headers,
        content_type="application/json",
    )


@dataclass(frozen=True, slots=True)
class Responder:
    """Writes the answers of one server: its model's name, metrics and write timeout."""

    metrics: Metrics
    model_name: str
    # a stream write blocked this long means the client stopped reading: drop it
    write_timeout_s: float

    def _model(self, form: fmt.ResponseFormat) -> str:
        """The model an answer names: the one asked for (a LoRA adapter's name, or the
        base model's), as OpenAI echoes it; the base model when none was named."""
        return form.req.model or self.model_name

    async def pump(self, choice: Choice, start: float, sink: asyncio.Queue | None = None):
        """Read one engine stream to its end (`observed`), into `sink` if given."""
        async for out in self.observed(choice, start):
            if sink is not None:
                await sink.put((choice, out))

    async def observed(self, choice: Choice, start: float):
        """One engine stream's outputs as they come, each recorded on `choice` and its
        latency metrics observed (at the engine's emit times: a lazy stream is read in
        batches); APIError after a final "error" output."""
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
                else:  # merged outputs (a lagging reader): each step gets the mean gap
                    gap = (now - last) / out.num_steps
                    for _ in range(out.num_steps):
                        m.inter_token_latency.observe(gap)
                last = now
                m.generation_tokens.inc(len(out.token_ids))
            choice.outputs.append(out)
            choice.text += out.text
            if out.finished:
                choice.finish_reason = out.finish_reason
                m.e2e_request_latency.observe(now - start)
                m.prompt_tokens.inc(len(choice.prompt_ids))
                m.request_success.labels(out.finish_reason).inc()
            yield out
        if choice.finish_reason == "error":
            raise APIError(500, "the engine failed while generating this request")

    async def whole(
        self, response_id: str, choices: list[Choice], form: fmt.ResponseFormat,
        start: float, prompt_tokens: int,
    ) -> web.Response:
        """Wait for every choice, then answer with one JSON body."""
        await asyncio.gather(*(self.pump(c, start) for c in choices))
        usage = fmt.usage(prompt_tokens, sum(c.num_tokens for c in choices))
        try:
            items = []
            for c in choices:
                faults.before_serialize(c.stream.request_id)
                items.append(form.choice(c.index, c.prompt_ids, c.text, c.outputs,
                                         c.finish_reason))
            body = fmt.body(form.object_name, response_id, self._model(form), items, usage)
            return json_response(body)
        except Exception:
            log.exception("writing the answer of %s failed", response_id)
            raise self._failed(response_id) from None

    async def stream(
        self,
        http: web.Request,
        response_id: str,
        choices: list[Choice],
        form: fmt.ResponseFormat,
        start: float,
        prompt_tokens: int,
        include_usage: bool,
    ) -> web.StreamResponse:
        """Answer with SSE events as tokens come, ending with [DONE]."""
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        sock = http.transport.get_extra_info("socket") if http.transport else None
        if sock is not None:
            # Autotuning grows a stalled reader's send buffer to megabytes; capped, the
            # writes below soon block, and with them the reading of its engine streams.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SEND_BUFFER)
        await resp.prepare(http)
        pumps = []
        if len(choices) == 1:  # read in place: no task and no queue hop a token
            events = ((choices[0], out) async for out in self.observed(choices[0], start))
        else:
            # Bounded, so a client that stops reading stops the pumps too: its outputs
            # then wait merged in its engine streams (an unbounded sink would hold them
            # here, one event a step).
            sink: asyncio.Queue = asyncio.Queue(maxsize=len(choices))
            pumps = [asyncio.create_task(self.pump(c, start, sink)) for c in choices]
            events = _taken(sink)

        def chunk(items: list[dict], usage: dict | None = None) -> dict:
            return fmt.body(form.chunk_name, response_id, self._model(form), items, usage)

        async def send(body: dict | None) -> None:
            """One SSE event (None: the final [DONE]); ClientStalled if the client does not
            take it within the write timeout."""
            data = b"[DONE]" if body is None else msgspec.json.encode(body)
            try:
                # a timeout scope, not wait_for: that starts a task for every event
                async with asyncio.timeout(self.write_timeout_s):
                    await resp.write(b"data: " + data + b"\n\n")
            except TimeoutError:
                raise ClientStalled(response_id) from None

        try:
            for c in choices:
                opening = form.opening(c.index, c.prompt_ids)
                if opening is not None:
                    await send(chunk([opening]))
            done = 0
            async for choice, out in events:
                done += out.finished
                if out.finish_reason == "error":
                    # the status line has gone: the failure is the stream's last event
                    failed = APIError(500, "the engine failed while generating this request")
                    await send(failed.body)
                    await send(None)
                    return resp
                try:
                    faults.before_serialize(choice.stream.request_id)
                    item = form.delta(choice.index, choice.prompt_ids, out)
                    wanted = out.text or out.finished or item["logprobs"]
                    event = chunk([item]) if wanted else None
                except Exception:
                    log.exception("writing the answer of %s failed", response_id)
                    # the status line has gone: the failure is the stream's last event
                    await send(self._failed(response_id).body)
                    await send(None)
                    return resp
                if event is not None:
                    await send(event)
                if done == len(choices):
                    break
            if include_usage:
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
            await events.aclose()
        return resp


    def _failed(self, response_id: str) -> APIError:
        """The 500 of an answer the server could not write (the engine's part went well),
        counted and named by the response's id."""
        self.metrics.response_errors.inc()
        return APIError(500, f"the server failed while writing the answer of {response_id}")


async def _taken(sink: asyncio.Queue):
    """What the pumps put into `sink`, as it comes."""
    while True:
        yield await sink.get()


def log_request(c: Choice, tenant: str, start: float) -> None:
    """One line per finished request; never the prompt text."""
    ttft = "-" if c.ttft is None else f"{c.ttft:.3f}s"
    log.info(
        "request %s tenant=%s prompt_tokens=%d output_tokens=%d ttft=%s e2e=%.3fs finish=%s",
        c.stream.request_id,
        tenant,
        len(c.prompt_ids),
        c.num_tokens,
        ttft,
        time.monotonic() - start,
        c.finish_reason or "cancelled",
    )


@web.middleware
async def error_objects(request: web.Request, handler):
    """Every error leaves as OpenAI's error object with the right status."""
    try:
        return await handler(request)
    except APIError as e:
        return json_response(e.body, e.status, e.headers)
    except web.HTTPRequestEntityTooLarge as e:
        return json_response(APIError(413, f"request body too large ({e.text})").body, 413)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_response(APIError(e.status, e.reason).body, e.status)
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return json_response(APIError(500, "internal server error").body, 500)
