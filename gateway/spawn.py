"""`jaxserve route --spawn`: start the pools' replicas and the guardrail checkers here.

For one machine: each pool's `[pools.spawn]` becomes `count` × `jaxserve serve <args>`
(serving the pool's model name, on its own port, pinned to its CPUs when `cpus` is
given), each check's `spawn` command is run as it is, and the gateway routes to them
once they pass their health checks. On other hosts the replicas are started there and
the pool lists their URLs instead: nothing else changes.
"""

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from gateway.config import GatewayConfig, PoolConfig

log = logging.getLogger("jaxserve.gateway")

STOP_TIMEOUT_S = 40.0  # a replica drains live requests for up to 30 s on SIGTERM


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Spawned:
    """The processes `--spawn` started, stopped together."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, config: GatewayConfig) -> GatewayConfig:
        """Start every spawned replica and checker; the config with their URLs filled in."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for name, check in config.checks.items():
            if check.spawn:
                cmd = list(check.spawn)
                if cmd[0] == "python":  # this interpreter: the one with jaxserve's packages
                    cmd[0] = sys.executable
                self._popen(f"check-{name}", cmd)
        pools = tuple(self._start_pool(p, config.host) for p in config.pools)
        return dataclasses.replace(config, pools=pools)

    def _start_pool(self, pool: PoolConfig, host: str) -> PoolConfig:
        spawn = pool.spawn
        if spawn is None:
            return pool
        urls = list(pool.replicas)
        for i in range(spawn.count):
            port = spawn.base_port + i if spawn.base_port else free_port()
            args = list(spawn.args)
            if "--served-model-name" not in args:
                args += ["--served-model-name", pool.model]
            cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--host", host,
                   "--port", str(port), *args]
            if i < len(spawn.cpus) and shutil.which("taskset"):
                cmd = ["taskset", "-c", spawn.cpus[i], *cmd]
            self._popen(f"{pool.name}-{i}", cmd)
            urls.append(f"http://{host}:{port}")
        return dataclasses.replace(pool, replicas=tuple(urls))

    def _popen(self, name: str, cmd: list[str]) -> None:
        path = self.log_dir / f"{name}.log"
        with path.open("ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        log.info("started %s (pid %d), its log: %s", name, proc.pid, path)
        self.procs.append((name, proc))

    def exited(self) -> list[str]:
        """Names of spawned processes that have exited."""
        return [name for name, proc in self.procs if proc.poll() is not None]

    def stop(self) -> None:
        """SIGTERM all (they drain in parallel), then wait; SIGKILL what outlives that."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc in self.procs:
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s: killing it", name, STOP_TIMEOUT_S)
                proc.kill()
                proc.wait()
