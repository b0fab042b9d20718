"""Run a real `jaxserve serve` process on loopback for tests, and a tiny model to serve."""

import contextlib
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from jaxserve.checkpoint.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import free_port, server_process  # noqa: E402  (the benchmarks' own start-up)


def save_tiny_chat_model(path: Path, gguf: Path) -> Path:
    """A 2-layer random Llama with SmolLM2's vocabulary and tokenizer: text in, text out, fast."""
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    Tokenizer.from_gguf(gguf).save(path)
    return path


@contextlib.contextmanager
def running_server(model: Path, *flags: str, timeout: float = 300.0, env: dict | None = None):
    """Start `jaxserve serve`, wait for /health 200, yield (base_url, process), then SIGTERM."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model),
           "--port", str(port), "--compilation-cache-dir", str(ROOT / ".cache" / "jax"), *flags]
    with tempfile.NamedTemporaryFile(prefix="jaxserve-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url + "/health", log_path, timeout, cwd=ROOT, env=env) as proc:
        proc.log_path = log_path  # tests read the server's log from here
        yield url, proc
