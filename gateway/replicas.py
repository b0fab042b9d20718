"""What the gateway knows of each replica: up or not, and its headroom, polled.

Every `poll_interval_s` the gateway asks each replica's `/health` and `/metrics` (the
engine's own gauges: running and waiting requests, free KV pages, the oldest waiting
request's age). A replica that fails its health check, or a connection the proxy
makes, is out until a later poll finds it healthy. Between polls the gateway counts
what it sent, so a burst does not all land on the replica that looked idlest.
"""

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

import aiohttp

log = logging.getLogger("jaxserve.gateway")
PROGRESS_S = 15.0  # how often a loading replica's progress is logged

# the replica's gauges the gateway reads (server/metrics.py)
GAUGES = {
    "jaxserve:num_requests_running": "running",
    "jaxserve:num_requests_waiting": "waiting",
    "jaxserve:kv_pages_free": "pages_free",
    "jaxserve:kv_pages_cached": "pages_cached",
    "jaxserve:kv_pages_total": "pages_total",
    "jaxserve:oldest_waiting_request_age_seconds": "oldest_waiting_s",
}


@dataclass(slots=True)
class Replica:
    """One `jaxserve serve` behind a pool; mutated by the poller and the proxy only."""

    url: str
    pool: str
    up: bool = False
    running: int = 0
    waiting: int = 0
    pages_free: int = 0
    pages_cached: int = 0  # prefix-cached pages: evicted when a request needs them
    pages_total: int = 0
    oldest_waiting_s: float = 0.0
    sent_since_poll: int = 0  # requests sent since the last /metrics: not in its gauges yet
    in_flight: int = 0  # requests the gateway has open to it now
    batch_in_flight: int = 0  # of which batch requests
    last_error: str | None = None
    polled_at: float = 0.0

    @property
    def load(self) -> int:
        """Requests it holds or is about to: fewer means more headroom."""
        return self.running + self.waiting + self.sent_since_poll

    @property
    def pages_available(self) -> int:
        return self.pages_free + self.pages_cached

    @property
    def free_fraction(self) -> float:
        return self.pages_available / self.pages_total if self.pages_total else 0.0

    def headroom_key(self) -> tuple[int, float]:
        """Sorts the replica with the most headroom first: least load, then most free pages."""
        return (self.load, -self.free_fraction)

    def mark_down(self, reason: str) -> None:
        if self.up:
            log.warning("replica %s (pool %s) is out: %s", self.url, self.pool, reason)
        self.up, self.last_error = False, reason

    def state(self) -> dict:
        """For GET /admin/pools."""
        return {
            "url": self.url, "up": self.up, "running": self.running, "waiting": self.waiting,
            "kv_pages_free": self.pages_free,
            "kv_pages_cached": self.pages_cached, "kv_pages_total": self.pages_total,
            "oldest_waiting_s": self.oldest_waiting_s, "in_flight": self.in_flight,
            "batch_in_flight": self.batch_in_flight, "last_error": self.last_error,
            "polled_at": self.polled_at,
        }


def _not_ready(status: int, health: object) -> str:
    """Why a replica's /health is not 200, from its body (server/app.py's health)."""
    if isinstance(health, dict) and health.get("status") == "loading":
        return f"loading: {health.get('compiled')}/{health.get('buckets')} buckets compiled"
    if isinstance(health, dict) and health.get("status"):
        return f"/health answered {status}: {health['status']} {health.get('error', '')}".strip()
    return f"/health answered {status}"


def parse_gauges(text: str) -> dict[str, float]:
    """The GAUGES' values from a Prometheus text exposition (unlabelled samples)."""
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in GAUGES:
            values[GAUGES[name]] = float(value)
    return values


class Poller:
    """Polls every replica at an interval, on the gateway's event loop."""

    def __init__(self, replicas: list[Replica], session: aiohttp.ClientSession,
                 interval_s: float, on_poll=None):
        self.replicas = replicas
        self.session = session
        self.interval_s = interval_s
        self.on_poll = on_poll  # called with the replica after each poll (metrics)
        self._task: asyncio.Task | None = None
        self._shown: dict[str, float] = {}  # replica URL -> when its state was last logged

    def _show_progress(self, replica: Replica) -> None:
        """A replica still loading says how far it is, every PROGRESS_S at most."""
        now = time.monotonic()
        if now - self._shown.get(replica.url, -PROGRESS_S) >= PROGRESS_S:
            self._shown[replica.url] = now
            log.info("replica %s (pool %s) not up yet: %s", replica.url, replica.pool,
                     replica.last_error)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def poll_all(self) -> None:
        await asyncio.gather(*(self.poll(r) for r in self.replicas))

    async def _run(self) -> None:
        while True:
            await self.poll_all()
            await asyncio.sleep(self.interval_s)

    async def poll(self, replica: Replica) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, 2 * self.interval_s))
        try:
            async with self.session.get(replica.url + "/health", timeout=timeout) as r:
                healthy = r.status == 200
                health = {} if healthy else await r.json(content_type=None)
            if healthy:
                async with self.session.get(replica.url + "/metrics", timeout=timeout) as r:
                    text = await r.text() if r.status == 200 else ""
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            replica.mark_down(f"{type(e).__name__}: {e}")
        else:
            if not healthy:
                replica.mark_down(_not_ready(r.status, health))
                self._show_progress(replica)
            else:
                for key, value in parse_gauges(text).items():
                    setattr(replica, key, type(getattr(replica, key))(value))
                if not replica.up:
                    log.info("replica %s (pool %s) is up", replica.url, replica.pool)
                replica.up, replica.last_error = True, None
                replica.sent_since_poll = 0
        replica.polled_at = time.time()
        if self.on_poll is not None:
            self.on_poll(replica)
