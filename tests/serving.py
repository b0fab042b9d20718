"""Run a real `jaxserve serve` process on loopback for tests, and a tiny model to serve.

Every server started here is checked whole after each test while it runs (conftest's
autouse fixture) and once more before it is stopped: see `check_invariants`.
"""

import contextlib
import json
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import openai
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


@dataclass(frozen=True)
class LiveServer:
    """A server `running_server` started, as its checks reach it."""

    url: str
    proc: subprocess.Popen
    api_key: str | None  # its --api-key, for /admin/requests and the check's request

    def check(self) -> None:
        """The invariants while it runs; a server that has exited must have been stopped
        (status 0, SIGTERM) by the test itself."""
        status = self.proc.poll()
        if status is None:
            check_invariants(self.url, self.api_key)
        else:
            assert status == 0, f"the server exited with status {status}: {self.proc.log_path}"


LIVE: list[LiveServer] = []  # servers up now, checked after every test


@contextlib.contextmanager
def running_server(model: Path, *flags: str, timeout: float = 300.0, env: dict | None = None,
                   check: bool = True):
    """Start `jaxserve serve`, wait for /health 200, yield (base_url, process), check its
    invariants (unless `check` is False: a test that breaks the server on purpose), SIGTERM."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model),
           "--port", str(port), "--compilation-cache-dir", str(ROOT / ".cache" / "jax"), *flags]
    with tempfile.NamedTemporaryFile(prefix="jaxserve-", suffix=".log", delete=False) as log:
        log_path = Path(log.name)
    url = f"http://127.0.0.1:{port}"
    api_key = flags[flags.index("--api-key") + 1] if "--api-key" in flags else None
    with server_process(cmd, url + "/health", log_path, timeout, cwd=ROOT, env=env) as proc:
        proc.log_path = log_path  # tests read the server's log from here
        server = LiveServer(url, proc, api_key)
        if check:
            LIVE.append(server)
        try:
            yield url, proc
        finally:
            if check:
                LIVE.remove(server)
        if check:
            server.check()


def check_invariants(url: str, api_key: str | None = None, idle_timeout_s: float = 30.0) -> None:
    """Once the server is idle (waited for, up to `idle_timeout_s`): every KV page is free
    or cached, every request admitted has ended (completed, cancelled or failed), no
    request record or output buffer is left, nothing compiled after warm-up; /health is
    200; and then a new request succeeds."""
    deadline = time.monotonic() + idle_timeout_s
    while True:
        broken = _broken_invariants(url, api_key)
        if not broken or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not broken, f"{url}, {idle_timeout_s:g} s after the test: " + "; ".join(broken)
    client = openai.OpenAI(base_url=url + "/v1", api_key=api_key or "unused", max_retries=0,
                           timeout=60)
    model = client.models.list().data[0].id
    out = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert out.choices[0].finish_reason in ("stop", "length"), out


def _broken_invariants(url: str, api_key: str | None) -> list[str]:
    """What is wrong with the server now (an empty list: nothing)."""
    status, _ = _get(url + "/health", api_key)
    _, text = _get(url + "/metrics", api_key)
    admin, live = _get(url + "/admin/requests", api_key)
    m = metric_samples(text)
    admitted = m["jaxserve:requests_admitted_total"]
    finished = {name.split('"')[1]: v for name, v in m.items()
                if name.startswith("jaxserve:requests_finished_total{")}
    pages = {k: m[f"jaxserve:kv_pages_{k}"] for k in ("total", "free", "cached")}
    broken = []
    if status != 200:
        broken.append(f"/health {status}")
    if pages["free"] + pages["cached"] != pages["total"]:
        broken.append(f"KV pages not all free or cached: {pages}")
    if admitted != sum(finished.values()):
        broken.append(f"{admitted:g} requests admitted, {finished} finished")
    for name in ("num_requests_running", "num_requests_waiting", "num_output_streams",
                 "compiles_after_warmup_total"):
        if m[f"jaxserve:{name}"]:
            broken.append(f"{name} {m[f'jaxserve:{name}']:g}")
    rows = json.loads(live).get("data") if admin == 200 else f"/admin/requests {admin}"
    if rows:
        broken.append(f"live requests {rows}")
    return broken


def _get(url: str, api_key: str | None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metric_samples(text: str) -> dict[str, float]:
    """/metrics samples by name, labels kept in the name."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples
