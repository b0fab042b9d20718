"""Which pool takes a request (its model, its prompt's length, its class), and which
replica in that pool (the one with the most headroom).

A prompt is counted only when one of its model's pools has length bounds, with that
pool's tokenizer and, for chat, the model's chat template: the count the replica will
make. Counting happens on the gateway's event loop: a 100,000-token prompt takes tens
of milliseconds to tokenize, far less than its prefill anywhere.
"""

from pathlib import Path

from gateway.config import GatewayConfig, PoolConfig
from gateway.replicas import Replica
from jaxserve.checkpoint.tokenizer import Tokenizer
from server.protocol import APIError


def open_tokenizer(path: str) -> Tokenizer:
    """The tokenizer of a model path as `jaxserve serve --model` takes it (GGUF file,
    Hugging Face directory, or converted checkpoint)."""
    p = Path(path)
    if p.suffix == ".gguf":
        return Tokenizer.from_gguf(p)
    if (p / "tokenizer.json").exists():
        return Tokenizer.from_dir(p)
    raise ValueError(f"{path}: neither a .gguf file nor a directory with tokenizer.json")


def count_prompt(tokenizer: Tokenizer, path: str, body: dict) -> int:
    """Prompt tokens of a request body, as the replica counts them (the longest prompt of
    a batched completions request)."""
    if path.endswith("/chat/completions"):
        messages = []
        for m in body.get("messages") or ():
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            messages.append({"role": m.get("role", "user") if isinstance(m, dict) else "user",
                             "content": content or ""})
        try:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        return len(tokenizer.encode(text, add_special_tokens=False))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) for t in prompt):
            return len(prompt)
        return max((count_prompt(tokenizer, path, {"prompt": p}) for p in prompt), default=0)
    return 0  # the replica will refuse it with its own 400


class Router:
    """Pools by model, tokenizers by pool, and each pool's replicas."""

    def __init__(self, config: GatewayConfig, replicas: dict[str, list[Replica]]):
        self.config = config
        self.replicas = replicas  # pool name -> its replicas
        self.tokenizers = {p.name: open_tokenizer(p.tokenizer) for p in config.pools
                           if p.tokenizer is not None}

    def pool_for(self, model: object, path: str, body: dict, priority: str) -> PoolConfig:
        """The first pool of `model` that admits the request; 404 for a model no pool
        serves, 400 for a prompt or class no pool of it takes."""
        pools = self.config.pools_for(model) if isinstance(model, str) else ()
        if not pools:
            raise APIError(404, f"model {model!r} does not exist or you do not have access "
                           "to it", param="model", code="model_not_found")
        counted = next((p for p in pools if p.bounded), None)
        tokens = None
        if counted is not None:
            tokens = count_prompt(self.tokenizers[counted.name], path, body)
        for pool in pools:
            if pool.admits(tokens, priority):
                return pool
        raise APIError(
            400, f"no pool of model {model!r} takes a {priority} request with a prompt of "
            f"{tokens} tokens", param="messages" if "chat" in path else "prompt",
            code="context_length_exceeded",
        )

    def replica_for(self, pool: PoolConfig, exclude: tuple[Replica, ...] = (),
                    among: list[Replica] | None = None) -> Replica | None:
        """The healthy replica of `pool` (of `among`, when given) with the most headroom,
        other than `exclude`; None when none is up."""
        candidates = self.replicas[pool.name] if among is None else among
        up = [r for r in candidates if r.up and r not in exclude]
        return min(up, key=Replica.headroom_key, default=None)

    def batch_replicas(self, pool: PoolConfig) -> list[Replica]:
        """Replicas of `pool` with spare capacity: up, nobody waiting, pages free."""
        return [r for r in self.replicas[pool.name]
                if r.up and r.waiting == 0 and r.pages_available > 0]
