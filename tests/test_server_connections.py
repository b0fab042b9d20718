"""Slow, idle and surplus connections against a real `jaxserve serve`, on raw sockets:
each is closed or refused in time, and none delays the streams beside them; nor does a
long prompt's tokenizing.

As in test_server_load.py, the latency bound is relative to a figure measured in
the same test on the same server, the two conditions interleaved round after round
(this shared machine's speed drifts), and every figure is printed (`pytest -s`).
"""

import asyncio
import itertools
import json
import math
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from serving import running_server

pytestmark = pytest.mark.slow  # starts a server

MODEL = "tiny"
READ_TIMEOUT = 2.0  # --request-read-timeout-s
MAX_CONNECTIONS = 300
SLACK = 1.0  # seconds past the timeout a close may take on this loaded machine
FLAGS = ["--max-batch", "8", "--token-budget", "64", "--num-pages", "512", "--max-model-len",
         "512", "--served-model-name", MODEL, "--max-connections", str(MAX_CONNECTIONS),
         "--request-read-timeout-s", str(READ_TIMEOUT)]
TIMEOUT = aiohttp.ClientTimeout(total=120)


@pytest.fixture(scope="module")
def server(tiny_model):
    with running_server(tiny_model, *FLAGS) as (url, _):
        yield url


def address(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def p95(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.95 * len(ordered)) - 1)]


def seconds_until_closed(sock: socket.socket, timeout: float) -> tuple[float, bytes]:
    """Read `sock` until the server closes it: (seconds it took, what came)."""
    start = time.monotonic()
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(1 << 16):
            data += chunk
    except ConnectionResetError:
        pass
    return time.monotonic() - start, data


async def stream_times(session: aiohttp.ClientSession, url: str, payload: dict) -> list[float]:
    """Stream a completion to its end: each chunk's arrival time."""
    times, done = [], False
    async with session.post(url + "/v1/completions", json={**payload, "stream": True}) as resp:
        assert resp.status == 200
        async for line in resp.content:
            if line.startswith(b"data: {"):
                times.append(time.perf_counter())
            done = done or line.strip() == b"data: [DONE]"
    assert done
    return times


def test_idle_and_trickling_connections_are_closed_in_time(server):
    """A connection that sends nothing, or trickles its headers or its body, is closed
    at the read timeout (the body's with a 408); so is a keep-alive connection left
    idle after its answer. One that sends its request at once is served."""
    server_address = address(server)
    trickled = {
        "idle": b"",
        "headers": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nX-Slow: " + b"s" * 100,
        "body": b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n"
                + b" " * 100,
    }
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def trickle(message: bytes) -> tuple[float, bytes]:
        """Send `message` a byte every 0.1 s (a body's headers at once) until the server
        answers or closes; (seconds until closed, what came)."""
        with socket.create_connection(server_address) as sock:
            start = time.monotonic()
            at_once = message.find(b"\r\n\r\n") + 4 if b"\r\n\r\n" in message else 0
            sock.sendall(message[:at_once])
            sock.settimeout(0.1)
            data = b""
            for byte in message[at_once:]:
                try:
                    sock.sendall(bytes([byte]))
                    data = sock.recv(1 << 16)
                except TimeoutError:
                    continue
                except OSError:
                    pass
                break  # an answer, or the close
            _, rest = seconds_until_closed(sock, 10)
            return time.monotonic() - start, data + rest

    def keep_alive() -> tuple[float, bytes]:
        with socket.create_connection(server_address) as sock:
            sock.sendall(request)
            sock.settimeout(10)
            data = b""
            while b'"finish_reason"' not in data:
                data += sock.recv(1 << 16)
            seconds, rest = seconds_until_closed(sock, 10)  # idle after its answer
            return seconds, data + rest

    async def body_():
        jobs = [asyncio.to_thread(trickle, m) for m in trickled.values() for _ in range(3)]
        return await asyncio.gather(*jobs, asyncio.to_thread(keep_alive))

    results = asyncio.run(asyncio.wait_for(body_(), 60))
    print("\nclosed after " + ", ".join(
        f"{kind} {seconds:.2f} s" for kind, (seconds, _) in zip(
            [k for k in trickled for _ in range(3)] + ["keep-alive"], results)
    ))
    for seconds, _ in results:
        assert READ_TIMEOUT - 0.1 <= seconds <= READ_TIMEOUT + SLACK
    for kind, (_, data) in zip([k for k in trickled for _ in range(3)], results):
        if kind == "body":
            assert data.startswith(b"HTTP/1.1 408 "), data
            error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
            assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
        else:
            assert data == b""  # closed without a word: no request was made
    assert results[-1][1].startswith(b"HTTP/1.1 200 ")


def test_connections_past_the_limit_are_refused_at_once(server):
    """At --max-connections open, a new connection is answered 503 (an OpenAI error
    object) and closed at once; once some close, new ones are served again."""
    server_address = address(server)
    time.sleep(READ_TIMEOUT + 0.5)  # connections earlier tests left idle are closed
    held = [socket.create_connection(server_address) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # each is accepted, and counted
        for sock in held:  # none of them was refused
            sock.setblocking(False)
            with pytest.raises(BlockingIOError):
                sock.recv(1)
        refusals = []
        for _ in range(5):
            with socket.create_connection(server_address) as extra:
                refusals.append(seconds_until_closed(extra, 5))
        for sock in held[:10]:
            sock.close()
        time.sleep(0.1)
        with socket.create_connection(server_address) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
            _, answer = seconds_until_closed(sock, 5)
    finally:
        for sock in held:
            sock.close()
    print(f"\nrefused in {', '.join(f'{1000 * s:.1f} ms' for s, _ in refusals)}")
    for seconds, data in refusals:
        assert seconds < 0.5
        assert data.startswith(b"HTTP/1.1 503 "), data
        head, body = data.split(b"\r\n\r\n", 1)
        assert b"Retry-After: 1" in head
        error = json.loads(body)["error"]
        assert error["code"] == "too_many_connections" and error["type"] == "service_unavailable"
    assert answer.startswith(b"HTTP/1.1 200 "), answer


# Rounds of the streams alone and beside the slow clients, interleaved (see above).
ROUNDS = 6
NUM_IDLE, NUM_TRICKLING, NUM_STREAMS = 200, 20, 8


def test_idle_and_trickling_connections_do_not_slow_streams(server):
    """8 streams' inter-token latency beside 200 idle and 20 trickling connections,
    each reopened as soon as the server closes it (a slowloris client), stays within
    1.2x (p95) of the same streams alone; every slow connection is closed in time.

    The streams last longer than the read timeout, so the slow connections are
    closed and reopened while tokens flow; they were opened spread over the
    timeout, so that goes on all along. The slow clients run in their own process.
    """
    url = server
    host, port = address(url)
    job = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400,
           "ignore_eos": True, "logprobs": 0}  # logprobs: one chunk per token

    async def streams(session):
        results = await asyncio.gather(*(
            stream_times(session, url, {**job, "seed": i}) for i in range(NUM_STREAMS)
        ))
        gaps = []
        for times in results:
            assert len(times) == job["max_tokens"]
            gaps += [b - a for a, b in itertools.pairwise(times[1:])]  # after the first token
        return gaps

    async def beside_slow_clients(session):
        slow = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("slow_clients.py")), host, str(port),
             str(NUM_IDLE), str(NUM_TRICKLING), str(READ_TIMEOUT)],
            stdout=subprocess.PIPE, text=True,
        )
        try:
            assert await asyncio.to_thread(slow.stdout.readline) == "ready\n"
            ready = time.monotonic()
            gaps = await streams(session)
            # long enough that each kind of connection has been closed by the server
            await asyncio.sleep(ready + READ_TIMEOUT + SLACK - time.monotonic())
        finally:
            slow.terminate()
            out, _ = await asyncio.to_thread(slow.communicate, timeout=30)
        assert slow.returncode == 0, out
        return gaps, json.loads(out)

    async def body():
        alone, beside, reports = [], [], []
        # The server closes a keep-alive connection idle for READ_TIMEOUT; a client that
        # kept it longer (aiohttp's default is 15 s) could send its next request into a
        # connection the server is closing. Real clients keep idle ones shorter than
        # the server's default 30 s; this one keeps them shorter than READ_TIMEOUT.
        connector = aiohttp.TCPConnector(keepalive_timeout=READ_TIMEOUT / 4)
        async with aiohttp.ClientSession(timeout=TIMEOUT, connector=connector) as session:
            for _ in range(ROUNDS):
                alone += await streams(session)
                gaps, report = await beside_slow_clients(session)
                beside += gaps
                reports.append(report)
        return alone, beside, reports

    alone, beside, reports = asyncio.run(asyncio.wait_for(body(), 400))
    lifetimes = {kind: [t for r in reports for t in r["lifetimes"][kind]]
                 for kind in reports[0]["lifetimes"]}
    statuses = {}
    for report in reports:
        for status, count in report["statuses"].items():
            statuses[status] = statuses.get(status, 0) + count
    ratio = p95(beside) / p95(alone)
    print(
        f"\nslow clients: ITL p95 of {NUM_STREAMS} streams alone {1000 * p95(alone):.1f} ms, "
        f"beside {NUM_IDLE} idle and {NUM_TRICKLING} trickling connections "
        f"{1000 * p95(beside):.1f} ms ({ratio:.2f}x; {ROUNDS} rounds); closed by the server: "
        + ", ".join(f"{kind} {len(ts)} after {min(ts):.2f}-{max(ts):.2f} s"
                    for kind, ts in lifetimes.items())
        + f"; answers {statuses}"
    )
    for kind, ts in lifetimes.items():
        assert ts, f"no {kind} connection was closed by the server"
        assert READ_TIMEOUT - 0.1 <= min(ts) and max(ts) <= READ_TIMEOUT + SLACK, kind
    # none refused (the cap is above them all); only the trickled bodies get an answer
    assert set(statuses) == {"none", "HTTP/1.1 408 Request Timeout"}, statuses
    assert ratio <= 1.2


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """A 400 kB prompt (past the context: a 400) keeps the tokenizer busy ~0.2 s; /health,
    asked again and again meanwhile, answers within 50 ms each time. Tokenized on the
    event loop, the answers asked for during it waited for all of it."""
    data = json.dumps({"model": MODEL, "prompt": "word " * 80_000, "max_tokens": 4}).encode()
    status = []

    def long_prompt():
        req = urllib.request.Request(server + "/v1/completions", data,
                                     {"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=60)
        except urllib.error.HTTPError as e:
            status.append(e.code)

    for _ in range(3):
        sender = threading.Thread(target=long_prompt)
        sender.start()
        latencies = []
        while sender.is_alive():
            start = time.monotonic()
            with urllib.request.urlopen(server + "/health", timeout=60) as resp:
                assert resp.status == 200
            latencies.append(time.monotonic() - start)
        sender.join()
        print(f"/health beside a long prompt: {len(latencies)} answers, the slowest in "
              f"{max(latencies) * 1e3:.1f} ms")
        assert max(latencies) < 0.05, sorted(latencies)[-5:]
        assert len(latencies) >= 3, latencies  # asked throughout
    assert status == [400] * 3
