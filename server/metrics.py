"""Prometheus metrics, named like vLLM's (`jaxserve:` prefix) so dashboards adapt.

Gauges read the engine when scraped; histograms and counters are observed by the
HTTP handlers and the engine's step callback, never inside device code.
"""

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxserve.host.results import StepTime
from jaxserve.serving import EngineStats
from server.heap import heap_bytes

# a step's host part is a fraction of a millisecond on a GPU: finer buckets at the low end
STEP_PART_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1, 2.5)
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FINISH_REASONS = {"stop", "length", "abort", "error"}


class Metrics:
    """Every metric of one server, in its own registry."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.num_requests_running = Gauge(
            "jaxserve:num_requests_running", "Requests in the running batch", registry=r
        )
        self.num_requests_waiting = Gauge(
            "jaxserve:num_requests_waiting", "Requests queued for admission", registry=r
        )
        self.kv_pages_total = Gauge("jaxserve:kv_pages_total", "Usable KV pages", registry=r)
        self.kv_pages_free = Gauge(
            "jaxserve:kv_pages_free", "KV pages on the free list", registry=r
        )
        self.kv_cache_usage_perc = Gauge(
            "jaxserve:kv_cache_usage_perc", "Fraction of KV pages in use (0-1)", registry=r
        )
        self.oldest_waiting_seconds = Gauge(
            "jaxserve:oldest_waiting_request_age_seconds",
            "Age of the longest-waiting queued request (alert on this)",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "jaxserve:time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            "jaxserve:inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_request_latency = Histogram(
            "jaxserve:e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.request_queue_time = Histogram(
            "jaxserve:request_queue_time_seconds",
            "Arrival to admission into the batch",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "jaxserve:step_seconds", "Engine step time", buckets=LATENCY_BUCKETS, registry=r
        )
        self.step_host_seconds = Histogram(
            "jaxserve:step_host_seconds",
            "Host time of an engine step: schedule, pack, transfer, unpack, post-process, emit",
            buckets=STEP_PART_BUCKETS,
            registry=r,
        )
        self.step_device_seconds = Histogram(
            "jaxserve:step_device_seconds",
            "Time an engine step waited on the device for its results",
            buckets=STEP_PART_BUCKETS,
            registry=r,
        )
        self.step_device_idle_seconds = Histogram(
            "jaxserve:step_device_idle_seconds",
            "Host time of an engine step during which the device had nothing to run (at "
            "most; with async scheduling only a launch that found the device done counts)",
            buckets=STEP_PART_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("jaxserve:prompt_tokens", "Prompt tokens", registry=r)
        self.generation_tokens = Counter(
            "jaxserve:generation_tokens", "Generated tokens", registry=r
        )
        self.request_success = Counter(
            "jaxserve:request_success",
            "Finished requests",
            ["finished_reason"],
            registry=r,
        )
        self.response_errors = Counter(
            "jaxserve:response_errors",
            "Answers the server failed to write after the engine produced them (a 500, or a "
            "stream's error event)",
            registry=r,
        )
        self.requests_rejected = Counter(
            "jaxserve:requests_rejected", "Refused requests", ["reason"], registry=r
        )
        self.preemptions = Counter(
            "jaxserve:preemptions", "Preempted sequences (0 by design)", registry=r
        )
        self.kv_pages_cached = Gauge(
            "jaxserve:kv_pages_cached",
            "Cached KV pages no running request owns (evictable)",
            registry=r,
        )
        self.lora_requests = Counter(
            "jaxserve:lora_requests", "Requests admitted, by LoRA adapter", ["adapter"],
            registry=r,
        )
        self.lora_adapters_loaded = Gauge(
            "jaxserve:lora_adapters_loaded", "LoRA adapters served (in host memory)",
            registry=r,
        )
        self.lora_slots_in_use = Gauge(
            "jaxserve:lora_slots_in_use", "Device slots holding a LoRA adapter (--max-loras)",
            registry=r,
        )
        r.register(_HeapBytes())

    def bind(self, stats: Callable[[], EngineStats]) -> None:
        """Let the gauges and engine-kept counters read the live engine when scraped."""
        self.num_requests_running.set_function(lambda: stats().running)
        self.num_requests_waiting.set_function(lambda: stats().waiting)
        self.kv_pages_total.set_function(lambda: stats().pages_usable)
        self.kv_pages_free.set_function(lambda: stats().pages_free)
        self.kv_cache_usage_perc.set_function(
            lambda: stats().pages_used / stats().pages_usable
        )
        self.oldest_waiting_seconds.set_function(lambda: stats().oldest_waiting_seconds)
        self.kv_pages_cached.set_function(lambda: stats().pages_cached)
        self.lora_adapters_loaded.set_function(lambda: stats().adapters_loaded)
        self.lora_slots_in_use.set_function(lambda: stats().adapter_slots_used)
        self.registry.register(_EngineCounters(stats))

    def observe_step(self, time: StepTime) -> None:
        self.step_seconds.observe(time.seconds)
        self.step_host_seconds.observe(time.host_seconds)
        self.step_device_seconds.observe(time.device_seconds)
        self.step_device_idle_seconds.observe(time.device_idle_seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _HeapBytes:
    """jaxserve:heap_bytes{kind}: glibc malloc's bytes in use, free and mmapped, read when
    scraped (server/heap.py); absent where the C library cannot tell."""

    def collect(self):
        sizes = heap_bytes()
        if sizes is None:
            return
        family = GaugeMetricFamily(
            "jaxserve:heap_bytes", "glibc malloc's bytes: in use, free in its arenas, mmapped",
            labels=["kind"])
        for kind, size in sizes.items():
            family.add_metric([kind], size)
        yield family


class _EngineCounters:
    """Counters the engine keeps itself (and the count of its output buffers), exposed
    at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self):
        s = self.stats()
        for name, doc, value in (
            (
                "jaxserve:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache",
                s.prefix_cache_queries,
            ),
            (
                "jaxserve:prefix_cache_hits",
                "Prompt tokens found in the prefix cache",
                s.prefix_cache_hits,
            ),
            (
                "jaxserve:compiles_after_warmup",
                "XLA compiles after warm-up (a shape escaped the buckets)",
                s.compiles_after_warmup,
            ),
            (
                "jaxserve:requests_admitted",
                "Requests the engine took in (past admission and its checks)",
                s.requests_admitted,
            ),
            (
                "jaxserve:lora_swaps",
                "LoRA adapters written into a device slot (the first load of each counts)",
                s.adapter_swaps,
            ),
            (
                "jaxserve:spec_decode_num_draft_tokens",
                "Draft tokens the steps verified (--speculative-config)",
                s.spec_decode_draft_tokens,
            ),
            (
                "jaxserve:spec_decode_num_accepted_tokens",
                "Draft tokens the model accepted: each saved a step of its request",
                s.spec_decode_accepted_tokens,
            ),
        ):
            yield CounterMetricFamily(name, doc, value=value)
        finished = CounterMetricFamily(
            "jaxserve:requests_finished",
            "Requests the engine ended, by reason: stop and length completed, abort cancelled "
            "(by the client, or a full output buffer), error failed. Once idle their sum is "
            "requests_admitted (request_success counts the answers the server delivered)",
            labels=["finished_reason"],
        )
        for reason in sorted(FINISH_REASONS | s.requests_finished.keys()):  # each from the start
            finished.add_metric([reason], s.requests_finished.get(reason, 0))
        yield finished
        yield GaugeMetricFamily(
            "jaxserve:num_output_streams",
            "Requests' output buffers still allocated (0 once idle, or they leak)",
            value=s.output_streams,
        )
