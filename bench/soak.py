"""Soak: mixed load on a live jaxserve for a given time, watching for leaks and drift.

    .venv/bin/python bench/soak.py --duration 3600 [--model PATH] [--server-args "..."]
        [--warmup 60] [--window 60] [--out bench/results/soak.json]
    .venv/bin/python bench/soak.py --url http://127.0.0.1:8000 --pid PID --duration 300

Without --url it starts `jaxserve serve` on --model (default: the default GGUF) with
--server-args (default: a small batch and queue, so that bursts overflow them).

The load, all of it at once from one asyncio client:
- normal: --concurrency clients in a closed loop (a pause of --think s on average
  between requests), taking turns over streamed and whole answers of /v1/completions
  and /v1/chat/completions (4-48 words in, 4-32 tokens out): 200, or 429 while a burst
  fills the queue.
- the TTFT probe: one more client in a closed loop (a pause of --probe-pause s) of the
  same small streamed completion (8 words in, 2 tokens out): ~30 TTFT samples a second,
  enough for a steady p99 over a minute or two.
- bad inputs, one every --bad-every s: malformed JSON, a wrong type, a negative
  max_tokens, an unknown model, an empty chat, a prompt past the context: each a 4xx.
- disconnects, one every --disconnect-every s: a long stream dropped after 2 chunks.
- slow readers, one every --slow-every s: a long stream read 256 bytes every 0.2 s
  through a small receive buffer for --slow-s s, then dropped (the server may cut it).
- bursts, one every --burst-every s: --burst whole answers at once, past the batch and
  the queue: 200 or 429.

Every --sample-every s: the server process's RSS, open file descriptors and threads
(/proc/PID) and its KV pages in use (/metrics). Per --window s: the answers by status and
the TTFT p50/p99 of the streamed requests (normal and probe).

Checks (exit status 1 when one fails):
- rss: what the server keeps grows under --max-rss-mib-per-min past --warmup: the
  Theil-Sen slope (the median of the slopes between every two points) of its RSS at the
  quiet points. At a quiet point the load pauses (no new request of any kind) until the
  engine runs and queues nothing, then the RSS's minimum over --quiet s (past the
  server's 10 s heap trim) is taken: one when warm-up ends, one every --quiet-every s,
  one after the load. Under load RSS follows what the requests hold: the main heap moved
  by ±12 MiB for tens of seconds at a time (measured, /proc/PID/smaps), so the slope of
  each burst period's RSS floor (still reported, not checked) read 0.03 to 2.82 MiB/min
  over 5 minutes with no trend behind it; a leak is what stays once the requests are gone.
- fds, threads: back to their idle counts (before the load) within 30 s of its end,
  once the client has closed its connections.
- unexpected: none of 5xx (a status, or an error event in a stream), a bad input
  accepted, a normal, probe or burst request failing but by 429, a client-side error.
- ttft: the probe's TTFT p99 in the last third of the time past warm-up ≤
  --max-ttft-growth × the first third's, leaving out probes sent while a burst was in the
  server (they queue behind it by design; the windows' table keeps every probe), each
  third's TTFT counted in units of the engine's mean device time a step in that third
  (outside bursts; from /metrics) where the steps slowed, as it is where they sped up.
  Why: on a shared 2-core VM the same server's step time for the same load drifted by
  up to 1.33x between thirds (either way: 0.75x, 1.06x, 1.12x in three runs; a small
  XLA computation in a process of its own, timed at its fastest, kept its speed), and
  the probe's TTFT followed it: the raw ratio (still reported) failed 1.2 in 5 of 7
  five-minute runs that way, with nothing in the server growing. What the check catches
  is the server's own slowing around its steps (HTTP, tokenizing, queueing,
  scheduling), where state that grows would show; the step time's own late ÷ early is
  reported beside it.

Writes the JSON (with the machine, the command and every sample), a markdown summary and
a plot (`soak.png`) beside --out.
"""

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from common import (
    RESULTS,
    cpu_description,
    fmt,
    free_port,
    markdown_table,
    pyplot,
    server_process,
    write_json,
)
from serve import WORDS

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVER_ARGS = "--max-batch 8 --token-budget 64 --max-model-len 512 --max-queue 16"
SETTLE_S = 30.0  # after the load, how long fds and threads have to return to idle
ARENA_HEAP_ALIGN = 64 << 20  # glibc's HEAP_MAX_SIZE on 64-bit: a thread arena's heaps start here


@dataclass(frozen=True)
class Mix:
    """What the soak sends, for how long, and the limits it checks."""

    duration_s: float = 300.0
    warmup_s: float = 60.0  # excluded from the RSS slope and the TTFT thirds
    window_s: float = 30.0
    sample_every_s: float = 2.0
    concurrency: int = 4
    think_s: float = 0.1  # a normal client's mean pause between requests
    probe_pause_s: float = 0.02  # the TTFT probe's pause between its requests
    bad_every_s: float = 1.0
    disconnect_every_s: float = 2.0
    slow_every_s: float = 10.0
    slow_s: float = 15.0
    burst_every_s: float = 30.0
    burst: int = 48
    # a quiet point: the load paused until the engine is idle, then the RSS's minimum over
    # quiet_s (past the server's --heap-trim-interval-s, so that a trim runs while idle);
    # one when warm-up ends, one every quiet_every_s after it, and one after the load
    quiet_every_s: float = 60.0
    quiet_s: float = 12.0
    max_rss_mib_per_min: float = 1.0
    max_ttft_growth: float = 1.2
    timeout_s: float = 120.0  # per request
    seed: int = 0


@dataclass
class Event:
    """One request as the client saw it."""

    t: float  # sent, seconds since the load began
    kind: str  # normal, probe, bad, disconnect, slow or burst
    status: int | None = None  # HTTP status; None: no answer
    error: str | None = None  # an error event in a stream, or a client-side failure
    ttft: float | None = None  # seconds, streamed normal and probe requests only
    end: float | None = None  # the answer ended (read, cut or failed), seconds since the start

    @property
    def is_5xx(self) -> bool:
        return (self.status or 0) >= 500 or (self.error or "").startswith("stream error")

    @property
    def unexpected(self) -> bool:
        if self.is_5xx:
            return True
        if self.kind == "bad":
            return self.status is None or not 400 <= self.status < 500
        if self.kind in ("normal", "probe", "burst"):
            return self.status not in (200, 429) or self.error is not None
        return self.status not in (200, 429)  # a dropped or slow stream: cut is fine


@dataclass(frozen=True)
class Sample:
    """The server process and its engine at one moment."""

    t: float
    rss_mib: float
    fds: int
    threads: int
    pages_used: float | None = None  # KV pages held by requests (None: /metrics unread)
    running: float | None = None
    waiting: float | None = None
    rss_anon_mib: float | None = None  # the anonymous part of RSS (heap, XLA's buffers)
    # the engine's steps so far and their device seconds (/metrics' counters)
    steps: float | None = None
    device_s: float | None = None


@dataclass
class QuietPoint:
    """The server's RSS once idle: what it keeps, without what its requests held."""

    t: float  # when the load paused
    rss_mib: float  # the smallest over the idle time
    rss_anon_mib: float
    drained_s: float  # how long the engine took to become idle
    # glibc malloc's live bytes then (server/heap.py; None where /metrics lacks them): an
    # RSS step they do not take is no live malloc block
    heap_in_use_mib: float | None = None
    heap_mmapped_mib: float | None = None
    rss_by_mapping: dict[str, float] = field(default_factory=dict)  # MiB (resident_by_mapping)


# ---------------------------------------------------------------- pure parts


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, in value per minute."""
    if len(points) < 2 or len({t for t, _ in points}) < 2:
        return None
    t, v = np.array(points, dtype=float).T
    return float(np.polyfit(t, v, 1)[0] * 60)


def trend_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Theil-Sen slope of (seconds, value) points, in value per minute: the median of the
    slopes between every two points, so a steady growth reads as itself and one point
    off the line (RSS held at one quiet point by something then let go) moves it little."""
    slopes = [(v1 - v0) / (t1 - t0) * 60 for (t0, v0), (t1, v1)
              in itertools.combinations(sorted(points), 2) if t1 > t0]
    return float(np.median(slopes)) if slopes else None


def rss_floors(samples: list[Sample], warmup_s: float, duration_s: float, period_s: float
               ) -> list[tuple[float, float]]:
    """(the period's middle, the smallest RSS sampled in it) for each whole `period_s` past
    warm-up."""
    floors = []
    for lo in np.arange(warmup_s, duration_s - period_s + 1e-9, period_s):
        seen = [s.rss_mib for s in samples if lo <= s.t < lo + period_s]
        if seen:
            floors.append((float(lo + period_s / 2), min(seen)))
    return floors


def p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def windows(events: list[Event], samples: list[Sample], width_s: float,
            duration_s: float) -> list[dict]:
    """Per window [start, start + width_s) of the load: answers by outcome, TTFT p50/p99
    (ms) and the last RSS, most fds, threads and pages in use sampled in it."""
    rows = []
    for i in range(max(1, int(np.ceil(duration_s / width_s)))):
        lo, hi = i * width_s, min((i + 1) * width_s, duration_s)
        sent = [e for e in events if lo <= e.t < hi]
        seen = [s for s in samples if lo <= s.t < hi]
        ttft = [e.ttft * 1e3 for e in sent if e.ttft is not None]
        rows.append({
            "start_s": lo,
            "end_s": hi,
            "sent": len(sent),
            "ok": sum(e.status == 200 and e.error is None for e in sent),
            "429": sum(e.status == 429 for e in sent),
            "4xx": sum(e.status is not None and 400 <= e.status < 500 and e.status != 429
                       for e in sent),
            "5xx": sum(e.is_5xx for e in sent),
            "unexpected": sum(e.unexpected for e in sent),
            "ttft_p50_ms": float(np.percentile(ttft, 50)) if ttft else None,
            "ttft_p99_ms": p99(ttft),
            "rss_mib": seen[-1].rss_mib if seen else None,
            "fds": max((s.fds for s in seen), default=None),
            "threads": max((s.threads for s in seen), default=None),
            "pages_used": max((s.pages_used for s in seen if s.pages_used is not None),
                              default=None),
        })
    return rows


def burst_spans(events: list[Event], gap_s: float = 1.0) -> list[tuple[float, float]]:
    """(first sent, last answered) of each burst: its requests, sent within `gap_s` of
    one another."""
    spans: list[list[float]] = []
    for e in sorted((e for e in events if e.kind == "burst"), key=lambda e: e.t):
        end = e.end if e.end is not None else e.t
        if spans and e.t - spans[-1][0] <= gap_s:
            spans[-1][1] = max(spans[-1][1], end)
        else:
            spans.append([e.t, end])
    return [(lo, hi) for lo, hi in spans]


def thirds(warmup_s: float, duration_s: float) -> tuple[tuple[float, float], tuple[float, float]]:
    """The first and the last third of the time past warm-up."""
    third = (duration_s - warmup_s) / 3
    return (warmup_s, warmup_s + third), (duration_s - third, duration_s)


def step_ms(samples: list[Sample], spans: list[tuple[float, float]], lo: float, hi: float
            ) -> float | None:
    """The engine's mean device time a step (ms) between `lo` and `hi`, over the intervals
    between samples that no burst span touches (a burst's full batches take longer steps,
    and a third holds two or three bursts); None without the engine's counters."""
    steps = device = 0.0
    for a, b in itertools.pairwise(samples):
        if a.t < lo or b.t > hi or None in (a.steps, b.steps, a.device_s, b.device_s):
            continue
        if any(s0 <= b.t and a.t <= s1 for s0, s1 in spans):
            continue
        steps += b.steps - a.steps
        device += b.device_s - a.device_s
    return device / steps * 1e3 if steps else None


def ttft_thirds(events: list[Event], warmup_s: float, duration_s: float
                ) -> tuple[float | None, float | None]:
    """TTFT p99 (ms) of the probe's requests sent in the first and the last third past
    warm-up, leaving out those sent while a burst was in the server:
    those wait behind the burst by design, and how many of them a third holds is a matter
    of the bursts' phase (a third holds two or three), not of the server's health."""
    (e0, e1), (l0, l1) = thirds(warmup_s, duration_s)
    bursts = burst_spans(events)

    def probes(lo: float, hi: float) -> list[float]:
        return [e.ttft * 1e3 for e in events
                if e.kind == "probe" and e.ttft is not None and lo <= e.t < hi
                and not any(b0 <= e.t <= b1 for b0, b1 in bursts)]

    return p99(probes(e0, e1)), p99(probes(l0, l1))


def checks(mix: Mix, events: list[Event], samples: list[Sample], idle: Sample,
           final: Sample, quiet: list[QuietPoint]) -> dict[str, dict]:
    """Each acceptance check: its figures and whether it passed."""
    slope = trend_per_minute([(p.t, p.rss_mib) for p in quiet])
    anon = trend_per_minute([(p.t, p.rss_anon_mib) for p in quiet])
    floor = slope_per_minute(rss_floors(samples, mix.warmup_s, mix.duration_s,
                                        mix.burst_every_s))
    early, late = ttft_thirds(events, mix.warmup_s, mix.duration_s)
    ratio = late / early if early and late is not None else None
    spans = burst_spans(events)
    steps = [step_ms(samples, spans, lo, hi) for lo, hi in thirds(mix.warmup_s, mix.duration_s)]
    step_ratio = steps[1] / steps[0] if None not in steps else None
    # what the check compares: TTFT in units of the engine's step time, when it is known
    # and the steps slowed; steps that sped up leave the raw ratio (dividing by theirs
    # would hold TTFT, mostly time around the steps, to a speed-up it need not share)
    growth = ratio / max(step_ratio, 1.0) if ratio is not None and step_ratio else ratio
    unexpected = [e for e in events if e.unexpected]
    return {
        "rss": {"mib_per_min": slope, "anon_mib_per_min": anon,
                "quiet_points": [(p.t, p.rss_mib) for p in quiet],
                "floor_mib_per_min": floor, "limit": mix.max_rss_mib_per_min,
                "ok": slope is not None and slope < mix.max_rss_mib_per_min},
        "fds": {"idle": idle.fds, "final": final.fds, "ok": final.fds <= idle.fds},
        "threads": {"idle": idle.threads, "final": final.threads,
                    "ok": final.threads <= idle.threads},
        "unexpected": {
            "count": len(unexpected), "5xx": sum(e.is_5xx for e in events),
            "first": [asdict(e) for e in unexpected[:10]], "ok": not unexpected,
        },
        "ttft": {"early_p99_ms": early, "late_p99_ms": late, "ratio": ratio,
                 "step_ms": steps, "step_ratio": step_ratio, "growth": growth,
                 "limit": mix.max_ttft_growth,
                 "ok": growth is not None and growth <= mix.max_ttft_growth},
    }


# ---------------------------------------------------------------- the server, watched


def process_sample(pid: int, t: float) -> Sample:
    """RSS, open fds and threads of process `pid` now (Linux /proc)."""
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    rss_kib, anon_kib = (int(status[key].split()[0]) for key in ("VmRSS", "RssAnon"))
    return Sample(t, rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")),
                  int(status["Threads"]), rss_anon_mib=anon_kib / 1024)


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    """/metrics as {name with its labels: value}."""
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {name: float(value) for name, value in (
        line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def resident_by_mapping(pid: int) -> dict[str, float]:
    """Process `pid`'s resident MiB by kind of mapping (/proc/PID/smaps): malloc's main
    arena (`[heap]`), its other arenas (anonymous maps that start on a 64 MiB boundary:
    glibc aligns each heap of a thread's arena to its 64 MiB maximum, and whose top
    malloc_trim does not release), other anonymous maps (CPython's arenas, thread stacks,
    malloc's mmapped blocks, XLA's own) and files (code, the model's file while loading)."""
    kinds = {"heap": 0.0, "arenas": 0.0, "anon": 0.0, "files": 0.0}
    kind = None
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's header
            start = int(fields[0].split("-")[0], 16)
            name = fields[5] if len(fields) > 5 else ""
            if name == "[heap]":
                kind = "heap"
            elif name.startswith("/"):
                kind = "files"
            else:
                kind = "arenas" if start % ARENA_HEAP_ALIGN == 0 else "anon"
        elif fields[0] == "Rss:" and kind is not None:
            kinds[kind] += int(fields[1]) / 1024
    return kinds


async def engine_sample(session: aiohttp.ClientSession, url: str, sample: Sample) -> Sample:
    """`sample` with the engine's KV pages in use, running and waiting (from /metrics)."""
    m = await scrape(session, url)
    used = m["jaxserve:kv_pages_total"] - m["jaxserve:kv_pages_free"] - m.get(
        "jaxserve:kv_pages_cached", 0.0)
    return Sample(sample.t, sample.rss_mib, sample.fds, sample.threads, used,
                  m["jaxserve:num_requests_running"], m["jaxserve:num_requests_waiting"],
                  sample.rss_anon_mib, m.get("jaxserve:step_device_seconds_count"),
                  m.get("jaxserve:step_device_seconds_sum"))


# ---------------------------------------------------------------- the load


@dataclass
class Load:
    """The soak's client: one session, its events, and when to stop."""

    url: str
    model: str
    mix: Mix
    session: aiohttp.ClientSession
    headers: dict
    t0: float = field(default_factory=time.monotonic)
    events: list[Event] = field(default_factory=list)
    rng: random.Random = field(default_factory=random.Random)
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # clear: a quiet point

    def __post_init__(self) -> None:
        self.gate.set()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def over(self) -> bool:
        return self.now() >= self.mix.duration_s

    async def go_on(self) -> bool:
        """Whether to send more: once any quiet point is over, until the end."""
        await self.gate.wait()
        return not self.over()

    def event(self, kind: str) -> Event:
        self.events.append(Event(self.now(), kind))
        return self.events[-1]

    def prompt(self) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(4, 48)))

    def body(self, chat: bool, stream: bool, max_tokens: int) -> dict:
        body = {"model": self.model, "max_tokens": max_tokens, "stream": stream,
                "ignore_eos": True}
        if chat:
            return {**body, "messages": [{"role": "user", "content": self.prompt()}]}
        return {**body, "prompt": self.prompt()}

    async def post(self, event: Event, path: str, body: dict | bytes,
                   read_chunks: int | None = None) -> None:
        """Send one request and record its outcome in `event`; read a stream to its end,
        or drop it after `read_chunks` chunks."""
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        try:
            async with self.session.post(self.url + path, headers=self.headers,
                                         **kwargs) as resp:
                event.status = resp.status
                if resp.status != 200 or resp.content_type != "text/event-stream":
                    await resp.read()
                    return
                chunks = 0
                async for raw in resp.content:
                    if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                        continue
                    chunk = json.loads(raw[6:])
                    if "error" in chunk:
                        event.error = f"stream error: {str(chunk['error'])[:200]}"
                        return
                    choices = chunk.get("choices") or [{}]
                    text = choices[0].get("text") or (choices[0].get("delta") or {}).get(
                        "content")
                    if text and event.ttft is None and event.kind in ("normal", "probe"):
                        event.ttft = self.now() - event.t
                    chunks += 1
                    if read_chunks is not None and chunks >= read_chunks:
                        resp.close()  # the client goes away mid-stream
                        return
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            event.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            event.end = self.now()

    async def normal(self, index: int) -> None:
        """A closed-loop client: each request streamed or whole, completions or chat."""
        turn = index
        while await self.go_on():
            chat, stream = bool(turn & 1), bool(turn & 2)
            body = self.body(chat, stream, self.rng.randint(4, 32))
            path = "/v1/chat/completions" if chat else "/v1/completions"
            await self.post(self.event("normal"), path, body)
            turn += 1
            await asyncio.sleep(self.rng.uniform(0, 2 * self.mix.think_s))

    async def probe(self) -> None:
        """The TTFT probe: one client in a closed loop of the same small streamed request
        (8 words in, 2 tokens out), so that its TTFT is the server's responsiveness
        alone, sampled ~30 times a second."""
        while await self.go_on():
            body = {**self.body(False, True, 2), "prompt": " ".join(self.rng.sample(WORDS, 8))}
            await self.post(self.event("probe"), "/v1/completions", body)
            await asyncio.sleep(self.mix.probe_pause_s)

    async def every(self, period_s: float, send) -> None:
        """Start `send()` every `period_s` seconds until the end; wait for all of them."""
        tasks = []
        while await self.go_on():
            tasks.append(asyncio.create_task(send()))
            await asyncio.sleep(period_s)
        await asyncio.gather(*tasks)

    def bad_inputs(self) -> list[tuple[str, dict | bytes]]:
        """(path, body) of requests the server must refuse with a 4xx."""
        c, chat = "/v1/completions", "/v1/chat/completions"
        return [
            (c, b'{"prompt": "hi", "max_tokens": '),
            (c, {"model": self.model, "prompt": "hi", "n": "two"}),
            (c, {"model": self.model, "prompt": "hi", "max_tokens": -1}),
            (c, {"model": "no-such-model", "prompt": "hi"}),
            (chat, {"model": self.model, "messages": []}),
            (c, {"model": self.model, "prompt": "word " * 20_000, "max_tokens": 4}),
        ]

    async def bad(self) -> None:
        path, body = self.rng.choice(self.bad_inputs())
        await self.post(self.event("bad"), path, body)

    async def disconnect(self) -> None:
        body = {**self.body(False, True, 400), "ignore_eos": True}
        await self.post(self.event("disconnect"), "/v1/completions", body, read_chunks=2)

    async def burst(self) -> None:
        await asyncio.gather(*(
            self.post(self.event("burst"), "/v1/completions", self.body(False, False, 16))
            for _ in range(self.mix.burst)
        ))

    async def slow(self) -> None:
        """A stream read a little at a time through a small receive buffer, then dropped."""
        event = self.event("slow")
        parts = urlsplit(self.url)
        payload = json.dumps(self.body(False, True, 400)).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
                f"Connection: close\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n")
        head += "".join(f"{k}: {v}\r\n" for k, v in self.headers.items())
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        writer = None
        try:
            await asyncio.get_running_loop().sock_connect(sock, (parts.hostname, parts.port))
            reader, writer = await asyncio.open_connection(sock=sock, limit=1024)
            writer.write(head.encode() + b"\r\n" + payload)
            status_line = await asyncio.wait_for(reader.readline(), self.mix.timeout_s)
            event.status = int(status_line.split()[1]) if status_line else None
            seen = b""
            deadline = time.monotonic() + self.mix.slow_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    data = await asyncio.wait_for(reader.read(256), left)
                except TimeoutError:
                    break  # nothing came for the rest of its time: a stalled stream, dropped
                if not data:
                    break  # the server cut it, or the answer ended
                seen = (seen + data)[-512:]
                if b'data: {"error"' in seen:
                    event.error = "stream error event"
                await asyncio.sleep(0.2)
        except (OSError, TimeoutError, ValueError, IndexError) as e:
            event.error = event.error or f"{type(e).__name__}: {e}"[:200]
        finally:
            if writer is not None:
                writer.close()
            else:
                sock.close()


async def _watch(load: Load, pid: int, samples: list[Sample], metrics: aiohttp.ClientSession
                 ) -> None:
    while not load.over():
        sample = process_sample(pid, load.now())  # before the scrape's own socket opens
        try:
            sample = await engine_sample(metrics, load.url, sample)
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            pass  # a sample without the engine's figures
        samples.append(sample)
        await asyncio.sleep(load.mix.sample_every_s)


async def quiet_point(load: Load, pid: int, metrics: aiohttp.ClientSession) -> QuietPoint:
    """With no new requests sent: wait until the engine runs and queues none, then take
    the RSS's minimum over `quiet_s`."""
    start = load.now()
    deadline = time.monotonic() + load.mix.timeout_s
    while time.monotonic() < deadline:
        try:
            s = await engine_sample(metrics, load.url, process_sample(pid, load.now()))
            if s.running == 0 and s.waiting == 0:
                break
        except (aiohttp.ClientError, TimeoutError, KeyError, ValueError):
            pass
        await asyncio.sleep(0.5)
    drained = load.now() - start
    idle = []
    until = time.monotonic() + load.mix.quiet_s
    while time.monotonic() < until:
        idle.append(process_sample(pid, load.now()))
        await asyncio.sleep(1.0)
    heap = {}
    try:
        heap = await scrape(metrics, load.url)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        pass

    def mib(kind: str) -> float | None:
        size = heap.get(f'jaxserve:heap_bytes{{kind="{kind}"}}')
        return None if size is None else size / 2**20

    return QuietPoint(start, min(s.rss_mib for s in idle),
                      min(s.rss_anon_mib for s in idle), drained, mib("in_use"), mib("mmapped"),
                      resident_by_mapping(pid))


async def _quiet_points(load: Load, pid: int, metrics: aiohttp.ClientSession,
                        points: list[QuietPoint]) -> None:
    """The quiet points during the load: when warm-up ends, then every `quiet_every_s`."""
    at = load.mix.warmup_s
    while at < load.mix.duration_s:
        await asyncio.sleep(at - load.now())
        if load.over():
            return
        load.gate.clear()
        try:
            points.append(await quiet_point(load, pid, metrics))
        finally:
            load.gate.set()
        at += load.mix.quiet_every_s


async def _first_model(url: str, headers: dict) -> str:
    async with aiohttp.ClientSession(headers=headers) as s, s.get(url + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def soak(url: str, pid: int, mix: Mix, api_key: str | None = None,
               progress: bool = True, keep_events: bool = False) -> dict:
    """Run the mixed load for `mix.duration_s` on the server at `url` (process `pid`);
    the report: samples, windows, idle and final counts, checks (and every request, if
    `keep_events`: a 5-minute run's ~10,000, for re-reading its statistics)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    model = await _first_model(url, headers)
    await asyncio.sleep(1.0)  # the server closes that connection
    idle = process_sample(pid, 0.0)
    samples: list[Sample] = []
    quiet: list[QuietPoint] = []
    timeout = aiohttp.ClientTimeout(total=mix.timeout_s)
    closing = aiohttp.TCPConnector(force_close=True)  # /metrics leaves no connection open
    async with (
        aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session,
        aiohttp.ClientSession(timeout=timeout, connector=closing) as metrics,
    ):
        load = Load(url, model, mix, session, headers, rng=random.Random(mix.seed))
        reporter = asyncio.create_task(_report_progress(load, samples)) if progress else None
        await asyncio.gather(
            _watch(load, pid, samples, metrics),
            _quiet_points(load, pid, metrics, quiet),
            *(load.normal(i) for i in range(mix.concurrency)),
            load.probe(),
            load.every(mix.bad_every_s, load.bad),
            load.every(mix.disconnect_every_s, load.disconnect),
            load.every(mix.slow_every_s, load.slow),
            load.every(mix.burst_every_s, load.burst),
        )
        if reporter is not None:
            reporter.cancel()
        ended = load.now()
        quiet.append(await quiet_point(load, pid, metrics))
    final = process_sample(pid, ended)
    deadline = time.monotonic() + SETTLE_S
    while (final.fds > idle.fds or final.threads > idle.threads) and time.monotonic() < deadline:
        await asyncio.sleep(0.5)
        final = process_sample(pid, load.now())
    return {
        "url": url,
        "model": model,
        "mix": asdict(mix),
        "idle": asdict(idle),
        "final": asdict(final),
        "load_ended_s": ended,
        "settled_s": final.t - ended,
        "counts": dict(Counter(f"{e.kind} {e.status}" for e in load.events)),
        "windows": windows(load.events, samples, mix.window_s, mix.duration_s),
        "checks": checks(mix, load.events, samples, idle, final, quiet),
        "quiet_points": [asdict(p) for p in quiet],
        "samples": [asdict(s) for s in samples],
        **({"events": [asdict(e) for e in load.events]} if keep_events else {}),
    }


async def _report_progress(load: Load, samples: list[Sample]) -> None:
    while True:
        await asyncio.sleep(30)
        s = samples[-1] if samples else None
        state = "" if s is None else (f"; RSS {s.rss_mib:.1f} MiB, {s.fds} fds, "
                                      f"{s.threads} threads, {fmt(s.pages_used, 0)} pages")
        print(f"{load.now():.0f}/{load.mix.duration_s:.0f} s: {len(load.events)} requests"
              f"{state}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- output


def markdown(report: dict) -> str:
    """The windows table and the checks, as printed and written beside the JSON."""
    rows = [
        [f"{w['start_s']:.0f}-{w['end_s']:.0f}", w["sent"], w["ok"], w["429"], w["4xx"],
         w["5xx"], w["unexpected"], fmt(w["ttft_p50_ms"], 0), fmt(w["ttft_p99_ms"], 0),
         fmt(w["rss_mib"]), w["fds"], w["threads"], fmt(w["pages_used"], 0)]
        for w in report["windows"]
    ]
    c = report["checks"]
    verdict = [
        ["RSS at the quiet points: slope past warm-up",
         f"{fmt(c['rss']['mib_per_min'], 3)} MiB/min (its anonymous part: "
         f"{fmt(c['rss']['anon_mib_per_min'], 3)}; under load, the floor's: "
         f"{fmt(c['rss']['floor_mib_per_min'], 3)})",
         f"< {c['rss']['limit']:g}", c["rss"]["ok"]],
        ["fds idle → final", f"{c['fds']['idle']} → {c['fds']['final']}", "≤ idle",
         c["fds"]["ok"]],
        ["threads idle → final", f"{c['threads']['idle']} → {c['threads']['final']}",
         "≤ idle", c["threads"]["ok"]],
        ["unexpected answers (5xx)", f"{c['unexpected']['count']} ({c['unexpected']['5xx']})",
         "0", c["unexpected"]["ok"]],
        ["TTFT p99 late ÷ early (outside bursts), ÷ the step time's late ÷ early",
         f"{fmt(c['ttft']['late_p99_ms'], 0)} ÷ {fmt(c['ttft']['early_p99_ms'], 0)} ms = "
         f"{fmt(c['ttft']['ratio'], 2)}; steps {fmt(c['ttft']['step_ms'][1], 3)} ÷ "
         f"{fmt(c['ttft']['step_ms'][0], 3)} ms = {fmt(c['ttft']['step_ratio'], 2)}; "
         f"{fmt(c['ttft']['growth'], 2)}", f"≤ {c['ttft']['limit']:g}", c["ttft"]["ok"]],
    ]
    return "\n\n".join([
        f"`{report.get('command', '')}` on {report.get('cpu', {}).get('model')}",
        markdown_table(["window s", "sent", "200", "429", "4xx", "5xx", "unexpected",
                        "TTFT p50 ms", "TTFT p99 ms", "RSS MiB", "fds", "threads",
                        "pages used"], rows),
        markdown_table(["quiet point s", "RSS MiB", "anonymous MiB", "malloc in use MiB",
                        "malloc mmapped MiB", "[heap]", "other malloc arenas",
                        "other anonymous", "files", "drained in s"],
                       [[f"{q['t']:.0f}", fmt(q["rss_mib"]), fmt(q["rss_anon_mib"]),
                         fmt(q.get("heap_in_use_mib")), fmt(q.get("heap_mmapped_mib")),
                         *(fmt(q.get("rss_by_mapping", {}).get(k)) for k in (
                             "heap", "arenas", "anon", "files")),
                         fmt(q["drained_s"])] for q in report["quiet_points"]]),
        markdown_table(["check", "measured", "limit", "passed"],
                       [[*row[:3], "yes" if row[3] else "NO"] for row in verdict]),
    ])


def plot(report: dict, path: Path) -> str | None:
    """RSS, fds and threads, pages in use and TTFT over time, one panel each."""
    plt = pyplot()
    if plt is None:
        return None
    samples, mix = report["samples"], report["mix"]
    t = [s["t"] for s in samples]
    fig, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    axes[0].plot(t, [s["rss_mib"] for s in samples], label="RSS")
    floors = rss_floors([Sample(**s) for s in samples], mix["warmup_s"], mix["duration_s"],
                        mix["burst_every_s"])
    if len(floors) >= 2:
        ft, rss = np.array(floors).T
        axes[0].plot(ft, rss, ".", label="floor of each burst period")
    quiet = report["quiet_points"]
    if len(quiet) >= 2:
        qt, rss = np.array([(q["t"], q["rss_mib"]) for q in quiet]).T
        axes[0].plot(qt, rss, "o", label="at the quiet points (checked)")
        slope = report["checks"]["rss"]["mib_per_min"] / 60  # the check's, per second
        line = np.median(rss - slope * qt) + slope * qt
        axes[0].plot(qt, line, "--", label="their trend (Theil-Sen)")
    axes[0].legend()
    axes[0].set(ylabel="RSS MiB")
    axes[1].plot(t, [s["fds"] for s in samples], label="open fds")
    axes[1].plot(t, [s["threads"] for s in samples], label="threads")
    axes[1].legend()
    axes[2].plot(t, [s["pages_used"] for s in samples], label="KV pages in use")
    axes[2].plot(t, [s["running"] for s in samples], label="running")
    axes[2].plot(t, [s["waiting"] for s in samples], label="waiting")
    axes[2].legend()
    mid = [(w["start_s"] + w["end_s"]) / 2 for w in report["windows"]]
    for key in ("ttft_p50_ms", "ttft_p99_ms"):
        axes[3].plot(mid, [w[key] for w in report["windows"]], marker="o",
                     label=key[:-3].replace("ttft_", "TTFT "))
    axes[3].set(ylabel="TTFT ms", xlabel="s since the load began")
    axes[3].legend()
    for ax in axes:
        ax.axvline(mix["warmup_s"], color="grey", linestyle=":")
        ax.grid(alpha=0.3)
    axes[0].set_title(f"soak: {report['model']}, {mix['duration_s']:.0f} s (dotted: warm-up)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


def run(url: str, pid: int, mix: Mix, out: Path | None = None, api_key: str | None = None,
        command: str = "", progress: bool = True, keep_events: bool = False) -> dict:
    """Soak the server, then write `out` (JSON), its .md and .png beside it, if given."""
    report = {"command": command, "cpu": cpu_description(),
              **asyncio.run(soak(url, pid, mix, api_key, progress, keep_events))}
    report["passed"] = all(c["ok"] for c in report["checks"].values())
    if out is not None:
        report["plot"] = plot(report, out.with_suffix(".png"))
        write_json(out, report)
        out.with_suffix(".md").write_text(markdown(report) + "\n")
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a live server (with --pid); default: start one")
    parser.add_argument("--pid", type=int, help="the live server's process id")
    parser.add_argument("--model", type=Path, default=GGUF, help="to start a server on")
    parser.add_argument("--server-args", default=SERVER_ARGS, help="flags of the server started")
    parser.add_argument("--api-key")
    defaults = Mix()
    for name, value in asdict(defaults).items():
        flag = "--" + name.removesuffix("_s").replace("_", "-")
        parser.add_argument(flag, dest=name, type=type(value), default=value,
                            help="default: %(default)s")
    parser.add_argument("--keep-events", action="store_true", help="every request in the JSON")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args()
    mix = Mix(**{k: getattr(args, k) for k in asdict(defaults)})
    command = "bench/soak.py " + shlex.join(sys.argv[1:])
    if args.url:
        if args.pid is None:
            parser.error("--url needs --pid (the soak reads the process's RSS, fds, threads)")
        report = run(args.url, args.pid, mix, args.out, args.api_key, command,
                     keep_events=args.keep_events)
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(args.model),
               "--port", str(port), "--compilation-cache-dir", str(ROOT / ".cache" / "jax"),
               *shlex.split(args.server_args)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        log = ROOT / ".cache" / "soak-server.log"
        with server_process(cmd, url + "/health", log, cwd=ROOT) as proc:
            report = run(url, proc.pid, mix, args.out, args.api_key, command,
                         keep_events=args.keep_events)
    print(markdown(report))
    print(f"wrote {args.out}")
    if not report["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
