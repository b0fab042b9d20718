"""A real `jaxserve serve` process on loopback, driven by the official openai client."""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest
from serving import ROOT, free_port, running_server, save_tiny_chat_model

pytestmark = pytest.mark.slow  # starts servers or multi-device processes

MODEL = "SmolLM2-135M-Instruct.Q4_1"
SMALL = ["--max-batch", "4", "--token-budget", "32", "--num-pages", "256"]


@pytest.fixture(scope="module")
def real_server(smollm2_gguf):
    with running_server(smollm2_gguf, *SMALL) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server + "/v1", api_key="unused")


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_answers_sensibly(client):
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert "Paris" in out.choices[0].text
    assert out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"


def test_chat_streams_a_sensible_answer_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens > 0 and not chunks[-1].choices


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_bad_request_gets_an_openai_error(real_server):
    code, payload = _post(real_server + "/v1/completions", b'{"prompt": "hi", "n": "two"}')
    assert code == 400 and payload["error"]["param"] == "n"


def test_tiny_model_serves_text(tmp_path_factory, smollm2_gguf):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), smollm2_gguf)
    with running_server(model, *SMALL) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        name = client.models.list().data[0].id
        out = client.completions.create(
            model=name, prompt="Hello", max_tokens=5, seed=1, extra_body={"ignore_eos": True}
        )
        assert out.usage.completion_tokens == 5


def test_health_counts_the_buckets_compiled_while_loading(tmp_path_factory, smollm2_gguf):
    """While it compiles, /health answers 503 with how many buckets are done, and the log
    has a line a bucket with what is left (a fresh cache, so each compile takes a while)."""
    tmp = tmp_path_factory.mktemp("health")
    model = save_tiny_chat_model(tmp, smollm2_gguf)
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model), "--port",
           str(port), "--compilation-cache-dir", str(tmp / "cache"), *SMALL]
    bodies, ready = [], False
    with open(tmp / "log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 300
            while not ready and time.monotonic() < deadline and proc.poll() is None:
                try:
                    with urllib.request.urlopen(url, timeout=5) as resp:
                        ready = resp.status == 200
                except urllib.error.HTTPError as e:
                    bodies.append(json.load(e))
                except OSError:
                    pass
                time.sleep(0.02)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    assert ready, (tmp / "log").read_text()[-2000:]
    assert bodies and all(set(b) == {"status", "compiled", "buckets"} for b in bodies), bodies
    assert all(b["status"] == "loading" and b["compiled"] <= b["buckets"] for b in bodies)
    counts = [b["compiled"] for b in bodies]
    assert counts == sorted(counts)
    assert any(0 < b["compiled"] < b["buckets"] for b in bodies), bodies
    lines = [x for x in (tmp / "log").read_text().splitlines() if "compiled step bucket" in x]
    assert lines and "s left)" in lines[-1]
