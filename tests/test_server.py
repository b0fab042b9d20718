"""A real `jaxserve serve` process on loopback, driven by the official openai client."""

import json
import urllib.error
import urllib.request

import openai
import pytest
from serving import running_server, save_tiny_chat_model

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
