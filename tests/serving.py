"""Run a real `jaxserve serve` process on loopback for tests, and a tiny model to serve."""

import contextlib
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
import transformers

from jaxserve.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    log = tempfile.NamedTemporaryFile("w+", prefix="jaxserve-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.log_path = log.name  # tests read the server's log from here
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited during start-up:\n{Path(log.name).read_text()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout}s")
            try:
                with urllib.request.urlopen(url + "/health", timeout=1) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
