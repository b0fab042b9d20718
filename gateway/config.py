"""The gateway's configuration file (TOML or JSON): pools, guardrail checks, the batch store.

A pool is one model name served by a list of replicas (`jaxserve serve` URLs), with
optional bounds: the prompt lengths it takes and the priority classes it admits. A
model may have several pools: the first one (in file order) whose bounds admit a
request gets it, which is how a long-context pool takes the long prompts of a model.

    [gateway]
    port = 8000
    batch_db = ".cache/gateway/batches.sqlite"

    [[pools]]
    name = "chat"
    model = "SmolLM2-135M-Instruct"
    replicas = ["http://127.0.0.1:8101"]
    tokenizer = "checkpoints/SmolLM2-135M-Instruct.Q4_1.gguf"
    max_prompt_tokens = 2048
    input_check = "keywords"

    [checks.keywords]
    url = "http://127.0.0.1:8701/check"
    timeout_s = 0.5
    policy = "fail_closed"

`spawn` (a pool's replica arguments, a check's command) is read only by
`jaxserve route --spawn`, which starts them on this machine.
"""

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

PRIORITIES = ("interactive", "batch")
POLICIES = ("fail_open", "fail_closed")


class ConfigError(ValueError):
    """A configuration file that cannot be served, with the key at fault in the message."""


@dataclass(frozen=True, slots=True)
class SpawnedReplicas:
    """How `--spawn` starts a pool's replicas: `count` × `jaxserve serve <args>`."""

    args: tuple[str, ...]
    count: int = 1
    base_port: int = 0  # replica i listens on base_port + i; 0: any free port
    cpus: tuple[str, ...] = ()  # per replica, a `taskset -c` list (e.g. "0"); empty: no pinning


@dataclass(frozen=True, slots=True)
class CheckConfig:
    """A guardrail: an HTTP service asked `POST url {"kind", "model", "text"}` →
    `{"allowed": bool, "reason": str}`, within `timeout_s`; on failure, `policy`."""

    name: str
    url: str
    timeout_s: float = 1.0
    policy: str = "fail_closed"  # or "fail_open"
    window_chars: int = 200  # output checks: streamed text is checked in windows this long
    spawn: tuple[str, ...] = ()  # command that starts it (`--spawn`)


@dataclass(frozen=True, slots=True)
class PoolConfig:
    name: str
    model: str  # the `model` requests name
    replicas: tuple[str, ...]  # base URLs; filled in by --spawn when `spawn` is set
    tokenizer: str | None = None  # a model path: prompts are counted with its tokenizer
    min_prompt_tokens: int = 0
    max_prompt_tokens: int | None = None
    priorities: tuple[str, ...] = PRIORITIES
    input_check: str | None = None  # a name under [checks]
    output_check: str | None = None
    batch_max_in_flight: int = 2  # batch requests one replica runs at once, at most
    spawn: SpawnedReplicas | None = None

    def admits(self, prompt_tokens: int | None, priority: str) -> bool:
        """Whether a request of this length (None: not counted) and class belongs here."""
        if priority not in self.priorities:
            return False
        if prompt_tokens is None:
            return True
        if prompt_tokens < self.min_prompt_tokens:
            return False
        return self.max_prompt_tokens is None or prompt_tokens <= self.max_prompt_tokens

    @property
    def bounded(self) -> bool:
        """Routing to this pool depends on the prompt's length."""
        return self.min_prompt_tokens > 0 or self.max_prompt_tokens is not None


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    pools: tuple[PoolConfig, ...]
    checks: dict[str, CheckConfig] = field(default_factory=dict)
    host: str = "127.0.0.1"
    port: int = 8000
    poll_interval_s: float = 0.25  # replicas' /health and /metrics
    batch_db: str = ".cache/gateway/batches.sqlite"
    batch_poll_s: float = 0.2  # how often the batch runner looks for spare capacity
    # clients' keys pass through to the replicas, which check them; the batch runner's
    # requests present this one (a replica with keys needs one)
    batch_api_key: str | None = None
    stream_write_timeout_s: float = 30.0  # a client not reading this long is dropped

    def pools_for(self, model: str) -> tuple[PoolConfig, ...]:
        return tuple(p for p in self.pools if p.model == model)

    @property
    def models(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.model for p in self.pools))


def load(path: str | Path) -> GatewayConfig:
    """Read and check a TOML (.toml) or JSON file; ConfigError names what is wrong."""
    path = Path(path)
    text = path.read_text()
    try:
        raw = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: {e}") from None
    return parse(raw, where=str(path))


def parse(raw: dict, where: str = "config") -> GatewayConfig:
    gateway = dict(raw.get("gateway", {}))
    checks = {name: _check(name, c, where) for name, c in raw.get("checks", {}).items()}
    pools = tuple(_pool(p, checks, where) for p in raw.get("pools", ()))
    if not pools:
        raise ConfigError(f"{where}: no [[pools]]")
    names = [p.name for p in pools]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: pool names repeat: {names}")
    unknown = set(gateway) - {f.name for f in dataclasses.fields(GatewayConfig)} - {
        "pools", "checks"}
    if unknown:
        raise ConfigError(f"{where}: unknown [gateway] keys {sorted(unknown)}")
    return GatewayConfig(pools=pools, checks=checks, **gateway)


def _check(name: str, raw: dict, where: str) -> CheckConfig:
    if "url" not in raw:
        raise ConfigError(f"{where}: checks.{name} has no url")
    policy = raw.get("policy", "fail_closed")
    if policy not in POLICIES:
        raise ConfigError(f"{where}: checks.{name}.policy must be one of {POLICIES}")
    return CheckConfig(
        name=name, url=raw["url"], timeout_s=float(raw.get("timeout_s", 1.0)), policy=policy,
        window_chars=int(raw.get("window_chars", 200)), spawn=tuple(raw.get("spawn", ())),
    )


def _pool(raw: dict, checks: dict[str, CheckConfig], where: str) -> PoolConfig:
    name = raw.get("name")
    if not name or "model" not in raw:
        raise ConfigError(f"{where}: every pool needs a name and a model")
    spawn = None
    if "spawn" in raw:
        s = raw["spawn"]
        spawn = SpawnedReplicas(args=tuple(s.get("args", ())), count=int(s.get("count", 1)),
                                base_port=int(s.get("base_port", 0)),
                                cpus=tuple(s.get("cpus", ())))
    replicas = tuple(u.rstrip("/") for u in raw.get("replicas", ()))
    if not replicas and spawn is None:
        raise ConfigError(f"pool {name}: no replicas (and no spawn)")
    for key in ("input_check", "output_check"):
        if raw.get(key) is not None and raw[key] not in checks:
            raise ConfigError(f"pool {name}: {key} {raw[key]!r} is not under [checks]")
    priorities = tuple(raw.get("priorities", PRIORITIES))
    if set(priorities) - set(PRIORITIES):
        raise ConfigError(f"pool {name}: priorities must be among {PRIORITIES}")
    pool = PoolConfig(
        name=name, model=raw["model"], replicas=replicas, tokenizer=raw.get("tokenizer"),
        min_prompt_tokens=int(raw.get("min_prompt_tokens", 0)),
        max_prompt_tokens=raw.get("max_prompt_tokens"), priorities=priorities,
        input_check=raw.get("input_check"), output_check=raw.get("output_check"),
        batch_max_in_flight=int(raw.get("batch_max_in_flight", 2)), spawn=spawn,
    )
    if pool.bounded and pool.tokenizer is None:
        raise ConfigError(f"pool {name}: prompt-length bounds need a tokenizer (a model path)")
    return pool
