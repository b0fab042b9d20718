"""Who is asking, and what they may ask for: API keys, tenants and their limits.

The tenant is the API key's name (`--api-keys-file`) or, when no keys are
configured, the `X-Tenant` header. Keys are compared in constant time.

A request may lower its own priority class with the `X-Priority: batch` header (the
gateway's batch runner does, so its requests take only spare capacity); no header
raises a request above its key's class.
"""

import dataclasses
import hmac
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from server.protocol import APIError

PRIORITY_CLASSES = {"interactive": 0, "batch": 1}


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """Limits of one tenant; None means unlimited."""

    name: str
    priority: int = 0
    max_concurrent: int | None = None
    max_context: int | None = None  # prompt + max_tokens
    max_output_tokens: int | None = None
    admin: bool = False
    adapters: frozenset[str] | None = None  # LoRA adapters it may use; None: every one

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


class Tenants:
    """Authenticates requests and counts each tenant's requests in flight."""

    def __init__(self, keys: dict[str, TenantPolicy] | None = None):
        self.keys = keys or {}
        self.in_flight: Counter = Counter()

    @staticmethod
    def from_options(api_key: str | None, api_keys_file: str | None) -> "Tenants":
        keys: dict[str, TenantPolicy] = {}
        if api_keys_file:
            for key, raw in json.loads(Path(api_keys_file).read_text()).items():
                priority = raw.get("priority", "interactive")
                if priority not in PRIORITY_CLASSES:
                    raise ValueError(f"{api_keys_file}: unknown priority class {priority!r}")
                keys[key] = TenantPolicy(
                    name=raw.get("tenant", key[:8]),
                    priority=PRIORITY_CLASSES[priority],
                    max_concurrent=raw.get("max_concurrent"),
                    max_context=raw.get("max_context"),
                    max_output_tokens=raw.get("max_output_tokens"),
                    admin=bool(raw.get("admin", False)),
                    adapters=None if raw.get("adapters") is None else frozenset(raw["adapters"]),
                )
        if api_key:
            keys[api_key] = TenantPolicy(name="default", admin=True)
        return Tenants(keys)

    def identify(self, headers) -> TenantPolicy:
        """The caller's policy; 401 when keys are configured and none matches."""
        return _demoted(self._match(headers), headers.get("X-Priority"))

    def _match(self, headers) -> TenantPolicy:
        if not self.keys:
            return TenantPolicy(name=headers.get("X-Tenant", "default")[:64])
        auth = headers.get("Authorization", "")
        given = auth[7:] if auth.startswith("Bearer ") else ""
        match = None
        for key, policy in self.keys.items():  # every key is compared: no early exit
            if hmac.compare_digest(key.encode(), given.encode()):
                match = policy
        if match is None:
            raise APIError(401, "missing or invalid API key", code="invalid_api_key")
        return match


    def check_limits(self, policy: TenantPolicy, prompt_tokens: int, max_tokens: int) -> None:
        if policy.max_output_tokens is not None and max_tokens > policy.max_output_tokens:
            raise APIError(
                400,
                f"max_tokens {max_tokens} exceeds this tenant's limit of "
                f"{policy.max_output_tokens}",
                param="max_tokens",
            )
        if policy.max_context is not None and prompt_tokens + max_tokens > policy.max_context:
            raise APIError(
                400,
                f"prompt ({prompt_tokens} tokens) + max_tokens ({max_tokens}) exceeds this "
                f"tenant's context limit of {policy.max_context}",
                param="max_tokens",
            )

    def acquire(self, policy: TenantPolicy, n: int) -> None:
        """Count n more requests in flight for the tenant, or 429 past its limit."""
        if (
            policy.max_concurrent is not None
            and self.in_flight[policy.name] + n > policy.max_concurrent
        ):
            raise APIError(
                429,
                f"tenant {policy.name!r} has {self.in_flight[policy.name]} requests in flight "
                f"(limit {policy.max_concurrent})",
                code="tenant_concurrency_limit",
                headers={"Retry-After": "1"},
            )
        self.in_flight[policy.name] += n

    def release(self, policy: TenantPolicy, n: int) -> None:
        self.in_flight[policy.name] -= n


def _demoted(policy: TenantPolicy, asked: str | None) -> TenantPolicy:
    """The policy at the class `X-Priority` asks for, if that is not above its own."""
    if asked is None:
        return policy
    if asked not in PRIORITY_CLASSES:
        raise APIError(400, f"X-Priority must be one of {sorted(PRIORITY_CLASSES)}",
                       param="X-Priority")
    return dataclasses.replace(policy, priority=max(policy.priority, PRIORITY_CLASSES[asked]))
