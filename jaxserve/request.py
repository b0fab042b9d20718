"""What a client asked for, as the engine and scheduler see it (no jax)."""

from dataclasses import dataclass

from jaxserve.config import SamplingParams


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt to complete; `seed` is always set (drawn at submission if not given)."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    seed: int
    arrival_time: float = 0.0
    tenant: str = "default"
    priority: int = 0  # lower runs first (0 = interactive, 1 = batch)
    cache_salt: str = ""  # prefix-cache key space: the tenant when tenants are isolated

    @property
    def max_total_tokens(self) -> int:
        return len(self.prompt_ids) + self.params.max_tokens


class RequestRejected(ValueError):
    """A request that can never be served (too long for the model or the page pool)."""
