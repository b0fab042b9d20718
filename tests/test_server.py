"""A real `jaxserve serve` process on loopback, driven by the official openai client."""

import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def base_url(smollm2_gguf):
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(smollm2_gguf),
         "--port", str(port)],
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, "server exited during start-up"
        try:
            with urllib.request.urlopen(url + "/health", timeout=1):
                break
        except OSError:
            time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("server did not become healthy in 120 s")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused")


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_completion(client):
    out = client.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
    )
    assert "Paris" in out.choices[0].text
    assert out.usage.completion_tokens == 8
    assert out.choices[0].finish_reason == "length"


def test_chat_completion(client):
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct.Q4_1",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=32,
        temperature=0,
    )
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b'{"prompt": "hi", "max_tokens": "ten"}', 400, "max_tokens"),
        (b'{"prompt": "hi", "max_tokens": -1}', 400, None),
        (b'{"prompt": "hi", "temperature": -0.5}', 400, None),
        (b'{"prompt": "hi", "model": "gpt-4"}', 404, "model"),
        (b'{"prompt": ""}', 400, "prompt"),
    ],
)
def test_bad_requests_get_openai_errors(base_url, body, status, param):
    code, payload = _post(base_url + "/v1/completions", body)
    assert code == status
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"]
    if param is not None:
        assert payload["error"]["param"] == param
