"""Run a real `jaxserve route` gateway in front of real replicas, for tests."""

import contextlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from serving import ROOT, free_port, metric_samples, server_process


@contextlib.contextmanager
def running_gateway(config: dict, workdir: Path, *flags: str, timeout: float = 120.0,
                    ready: str = "/health", port: int | None = None):
    """Write `config` (JSON), start `jaxserve route` on it, wait for `ready` to answer 200
    (/health: every pool has a replica up), yield (base_url, process), SIGTERM."""
    port = port or free_port()
    path = workdir / f"gateway-{port}.json"
    path.write_text(json.dumps(config))
    cmd = [sys.executable, "-m", "jaxserve.cli", "route", "--config", str(path),
           "--port", str(port), "--batch-db", str(workdir / "batches.sqlite"), *flags]
    with tempfile.NamedTemporaryFile(prefix="gateway-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url + ready, log_path, timeout, cwd=ROOT) as proc:
        proc.log_path = log_path
        yield url, proc


def replica_process(model: Path, port: int, *flags: str, log_path: Path):
    """A `jaxserve serve` on a given port (so that a killed one comes back at the same
    URL), not checked by the invariants fixture: tests that kill replicas use it."""
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model),
           "--port", str(port), "--compilation-cache-dir", str(ROOT / ".cache" / "jax"),
           *flags]
    return server_process(cmd, f"http://127.0.0.1:{port}/health", log_path, 300, cwd=ROOT)


def samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return metric_samples(r.read().decode())


def admitted(url: str) -> float:
    """Requests a replica has admitted so far (its own counter)."""
    return samples(url)["jaxserve:requests_admitted_total"]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.1):
    """Poll until `predicate()` is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout_s:g} s: {what}"
        time.sleep(interval_s)


def pool_json(name: str, model: str, replicas: list[str], **extra) -> dict:
    return {"name": name, "model": model, "replicas": replicas, **extra}


def kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()
