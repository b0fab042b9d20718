"""The gateway's Prometheus metrics (`jaxserve:gateway_*`), per pool and replica."""

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from gateway.replicas import Replica

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.routed = Counter(
            "jaxserve:gateway_requests_routed", "Requests sent to a replica",
            ["pool", "replica"], registry=r)
        self.retried = Counter(
            "jaxserve:gateway_requests_retried",
            "Requests sent again to another replica (after a 429 or a refused connection)",
            ["pool", "replica"], registry=r)
        self.refused = Counter(
            "jaxserve:gateway_requests_refused",
            "Requests answered by the gateway itself with an error",
            ["pool", "reason"], registry=r)
        self.failed = Counter(
            "jaxserve:gateway_requests_failed",
            "Requests whose replica failed mid-answer (connection lost)",
            ["pool", "replica"], registry=r)
        self.ttft = Histogram(
            "jaxserve:gateway_time_to_first_token_seconds",
            "Arrival at the gateway to the first streamed byte of output, as the client sees it",
            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(
            "jaxserve:gateway_e2e_request_latency_seconds", "Arrival to the answer's end",
            ["pool"], buckets=LATENCY_BUCKETS, registry=r)
        self.guardrail_checks = Counter(
            "jaxserve:gateway_guardrail_checks",
            "Guardrail checks by outcome (allowed, refused, failed_open, failed_closed)",
            ["check", "kind", "outcome"], registry=r)
        self.replica_up = Gauge(
            "jaxserve:gateway_replica_up", "1 while the replica passes its health check",
            ["pool", "replica"], registry=r)
        self.replica_load = Gauge(
            "jaxserve:gateway_replica_load", "Running + waiting requests, as last polled",
            ["pool", "replica"], registry=r)

        self.batch_requests = Gauge(
            "jaxserve:gateway_batch_requests",
            "Batch API requests by state (pending, running, done, failed, expired, cancelled)",
            ["state"], registry=r)

    def polled(self, replica: Replica) -> None:
        self.replica_up.labels(replica.pool, replica.url).set(1 if replica.up else 0)
        self.replica_load.labels(replica.pool, replica.url).set(replica.running + replica.waiting)

    def guardrail(self, check: str, kind: str, outcome: str) -> None:
        self.guardrail_checks.labels(check, kind, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
