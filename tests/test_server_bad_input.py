"""A catalog of malformed and out-of-range requests against a real `jaxserve serve` process.

Each is answered with the right status and OpenAI's error object, naming the
parameter where one is at fault. A bystander request streams through the whole
catalog and must finish untouched; afterwards the server is healthy and holds
no KV page.
"""

import json
import math
import threading
import time
import urllib.error
import urllib.request

import pytest
from serving import running_server

pytestmark = pytest.mark.slow  # starts servers or multi-device processes

FLAGS = ["--max-batch", "8", "--token-budget", "64", "--num-pages", "512", "--max-model-len", "512"]
MODEL = "tiny"
MAX_BODY = 4096
CONTEXT = 512
VOCAB = 49152

C, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


# (id, method, path, raw body, status, param, code)
CATALOG = [
    ("malformed-json", "POST", C, b'{"prompt": "hi",', 400, None, None),
    ("empty-body", "POST", C, b"", 400, None, None),
    ("json-array", "POST", C, b"[1, 2]", 400, None, None),
    ("json-string", "POST", C, b'"hi"', 400, None, None),
    ("json-null", "POST", CHAT, b"null", 400, None, None),
    ("nan-literal", "POST", C, b'{"prompt": "hi", "temperature": NaN}', 400, None, None),
    ("infinity-literal", "POST", C, b'{"prompt": "hi", "top_p": Infinity}', 400, None, None),
    ("number-1e999", "POST", C, b'{"prompt": "hi", "temperature": 1e999}', 400,
     "temperature", None),
    ("invalid-utf8", "POST", C, b'{"prompt": "\xff\xfe\xfd"}', 400, None, None),
    ("prompt-number", "POST", C, body(prompt=5), 400, "prompt", None),
    ("prompt-bool-id", "POST", C, body(prompt=[True]), 400, "prompt[0]", None),
    ("max-tokens-string", "POST", C, body(prompt="hi", max_tokens="ten"), 400, "max_tokens",
     None),
    ("max-tokens-float", "POST", C, body(prompt="hi", max_tokens=1.5), 400, "max_tokens", None),
    ("temperature-string", "POST", C, body(prompt="hi", temperature="hot"), 400, "temperature",
     None),
    ("n-string", "POST", C, body(prompt="hi", n="two"), 400, "n", None),
    ("stream-string", "POST", C, body(prompt="hi", stream="yes"), 400, "stream", None),
    ("stop-number", "POST", C, body(prompt="hi", stop=5), 400, "stop", None),
    ("seed-float", "POST", C, body(prompt="hi", seed=1.5), 400, "seed", None),
    ("logprobs-string", "POST", C, body(prompt="hi", logprobs="yes"), 400, "logprobs", None),
    ("echo-string", "POST", C, body(prompt="hi", echo="yes"), 400, "echo", None),
    ("stream-options-string", "POST", C, body(prompt="hi", stream_options="x"), 400,
     "stream_options", None),
    ("model-number", "POST", C, body(prompt="hi", model=5), 400, "model", None),
    ("messages-string", "POST", CHAT, body(messages="hi"), 400, "messages", None),
    ("chat-logprobs-int", "POST", CHAT, body(messages=USER, logprobs=3), 400, "logprobs", None),
    ("temperature-negative", "POST", C, body(prompt="hi", temperature=-1), 400, "temperature",
     None),
    ("top-p-zero", "POST", C, body(prompt="hi", top_p=0), 400, "top_p", None),
    ("top-p-above-one", "POST", C, body(prompt="hi", top_p=1.5), 400, "top_p", None),
    ("top-k-negative", "POST", C, body(prompt="hi", top_k=-5), 400, "top_k", None),
    ("n-zero", "POST", C, body(prompt="hi", n=0), 400, "n", None),
    ("n-1000", "POST", C, body(prompt="hi", n=1000), 400, "n", None),
    ("logprobs-50", "POST", C, body(prompt="hi", logprobs=50), 400, "logprobs", None),
    ("logprobs-6", "POST", C, body(prompt="hi", logprobs=6), 400, "logprobs", None),
    ("temperature-2.5", "POST", C, body(prompt="hi", temperature=2.5), 400, "temperature",
     None),
    ("chat-temperature-1e30", "POST", CHAT, body(messages=USER, temperature=1e30), 400,
     "temperature", None),
    ("logit-bias-101", "POST", C, body(prompt="hi", logit_bias={"1": 101}), 400, "logit_bias",
     None),
    ("logit-bias-word-key", "POST", C, body(prompt="hi", logit_bias={"hi": 1}), 400,
     "logit_bias", None),
    ("logit-bias-string-value", "POST", C, body(prompt="hi", logit_bias={"1": "x"}), 400,
     "logit_bias", None),
    ("logit-bias-out-of-vocab", "POST", CHAT, body(messages=USER, logit_bias={"49152": 5}),
     400, "logit_bias", None),
    ("logit-bias-129-tokens", "POST", C,
     body(prompt="hi", logit_bias={str(t): 1 for t in range(129)}), 400, "logit_bias", None),
    ("logprobs-negative", "POST", C, body(prompt="hi", logprobs=-1), 400, "logprobs", None),
    ("chat-top-logprobs-50", "POST", CHAT, body(messages=USER, logprobs=True, top_logprobs=50),
     400, "logprobs", None),
    ("chat-top-logprobs-without-logprobs", "POST", CHAT, body(messages=USER, top_logprobs=50),
     400, "top_logprobs", None),
    ("chat-max-tokens-differ", "POST", CHAT,
     body(messages=USER, max_completion_tokens=2, max_tokens=0), 400, "max_tokens", None),
    ("presence-penalty-3", "POST", C, body(prompt="hi", presence_penalty=3), 400,
     "presence_penalty", None),
    ("frequency-penalty-minus-3", "POST", C, body(prompt="hi", frequency_penalty=-3), 400,
     "frequency_penalty", None),
    ("repetition-penalty-0", "POST", C, body(prompt="hi", repetition_penalty=0), 400,
     "repetition_penalty", None),
    ("min-p-2", "POST", C, body(prompt="hi", min_p=2), 400, "min_p", None),
    ("min-tokens-over-max", "POST", C, body(prompt="hi", min_tokens=5, max_tokens=2), 400,
     "min_tokens", None),
    ("max-tokens-negative", "POST", C, body(prompt="hi", max_tokens=-1), 400, "max_tokens",
     None),
    ("max-tokens-zero", "POST", C, body(prompt="hi", max_tokens=0), 400, "max_tokens", None),
    ("max-completion-tokens-zero", "POST", CHAT, body(messages=USER, max_completion_tokens=0),
     400, "max_tokens", None),
    ("max-tokens-huge", "POST", C, body(prompt="hi", max_tokens=10**20), 400, "max_tokens",
     "context_length_exceeded"),
    ("prompt-beyond-context", "POST", C, body(prompt=[1] * (CONTEXT + 10), max_tokens=1), 400,
     "prompt", "context_length_exceeded"),
    ("prompt-plus-max-tokens-beyond-context", "POST", C,
     body(prompt=[1] * 100, max_tokens=CONTEXT - 50), 400, "max_tokens",
     "context_length_exceeded"),
    ("chat-beyond-context", "POST", CHAT, body(messages=USER, max_tokens=CONTEXT), 400,
     "max_tokens", "context_length_exceeded"),
    ("prompt-empty-string", "POST", C, body(prompt=""), 400, "prompt", None),
    ("prompt-empty-list", "POST", C, body(prompt=[]), 400, "prompt", None),
    ("prompt-empty-id-list", "POST", C, body(prompt=[[]]), 400, "prompt", None),
    ("prompt-missing", "POST", C, body(max_tokens=2), 400, "prompt", None),
    ("messages-empty", "POST", CHAT, body(messages=[]), 400, "messages", None),
    ("messages-missing", "POST", CHAT, body(max_tokens=2), 400, "messages", None),
    ("role-invalid", "POST", CHAT, body(messages=[{"role": "wizard", "content": "hi"}]), 400,
     "messages[0].role", None),
    ("role-missing", "POST", CHAT, body(messages=[{"content": "hi"}]), 400, "messages[0]", None),
    ("content-number", "POST", CHAT, body(messages=[{"role": "user", "content": 5}]), 400,
     "messages[0].content", None),
    ("content-part-text-number", "POST", CHAT,
     body(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]), 400,
     "messages[0].content[0].text", None),
    ("too-many-stops", "POST", C, body(prompt="hi", stop=["a", "b", "c", "d", "e"]), 400,
     "stop", None),
    ("token-id-past-vocab", "POST", C, body(prompt=[1, VOCAB]), 400, "prompt", None),
    ("token-id-negative", "POST", C, body(prompt=[[1, 2], [-1]]), 400, "prompt", None),
    ("prompt-mixed-list", "POST", C, body(prompt=["hi", 1]), 400, "prompt", None),
    ("prompt-ids-and-lists", "POST", C, body(prompt=[1, [2]]), 400, "prompt", None),
    ("echo-max-tokens-zero", "POST", C, body(prompt="hi", echo=True, max_tokens=0), 400,
     "max_tokens", None),
    ("unknown-model", "POST", C, body(prompt="hi", model="gpt-9"), 404, "model",
     "model_not_found"),
    ("unknown-model-chat", "POST", CHAT, body(messages=USER, model="gpt-9"), 404, "model",
     "model_not_found"),
    ("oversized-body", "POST", C, body(prompt="x" * MAX_BODY), 413, None, None),
    ("get-on-post-route", "GET", C, None, 405, None, None),
    ("get-on-chat-route", "GET", CHAT, None, 405, None, None),
    ("post-on-get-route", "POST", "/v1/models", b"{}", 405, None, None),
    ("unknown-route", "GET", "/v1/nope", None, 404, None, None),
    ("unknown-route-post", "POST", "/v2/completions", body(prompt="hi"), 404, None, None),
]


def request(url: str, method: str, data: bytes | None, timeout: float = 30):
    """(status, headers, raw body) of one request, errors included."""
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def metric_values(url: str) -> dict[str, float]:
    status, _, raw = request(url + "/metrics", "GET", None)
    assert status == 200
    values = {}
    for line in raw.decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def pages_held(url: str) -> float:
    """KV pages some request holds (cached prefix pages nobody holds are reusable, not held)."""
    m = metric_values(url)
    return m["jaxserve:kv_pages_total"] - m["jaxserve:kv_pages_free"] - m.get(
        "jaxserve:kv_pages_cached", 0.0
    )


@pytest.fixture(scope="module")
def server(tiny_model):
    flags = [*FLAGS, "--served-model-name", MODEL, "--max-body-bytes", str(MAX_BODY)]
    with running_server(tiny_model, *flags) as (url, _):
        yield url


class Bystander(threading.Thread):
    """A long streaming request that runs while the catalog is sent."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.finish_reason = None
        self.num_chunks = 0
        self.started = threading.Event()
        self.error: Exception | None = None

    def run(self) -> None:
        data = body(prompt="A long and quiet story", max_tokens=300, seed=1, stream=True,
                    ignore_eos=True)
        try:
            req = urllib.request.Request(self.url + C, data, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=120) as resp:
                for line in resp:
                    line = line.strip()
                    if not line.startswith(b"data: ") or line == b"data: [DONE]":
                        continue
                    choice = json.loads(line[6:])["choices"][0]
                    self.num_chunks += 1
                    self.started.set()
                    self.finish_reason = choice["finish_reason"] or self.finish_reason
        except Exception as e:  # noqa: BLE001 - reported by the final test
            self.error = e
        finally:
            self.started.set()


@pytest.fixture(scope="module")
def bystander(server):
    thread = Bystander(server)
    thread.start()
    assert thread.started.wait(60)
    yield thread
    thread.join(timeout=120)


@pytest.mark.parametrize(
    ("method", "path", "data", "status", "param", "code"),
    [pytest.param(*case[1:], id=case[0]) for case in CATALOG],
)
def test_bad_input(server, bystander, method, path, data, status, param, code):
    got, headers, raw = request(server + path, method, data)
    assert got == status, raw
    assert headers["Content-Type"].startswith("application/json")
    payload = json.loads(raw)
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    want_type = {404: "not_found_error"}.get(status, "invalid_request_error")
    assert error["type"] == want_type, error
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 2**32 - 1, "n": 2},
        {"top_k": 2**40},
        {"temperature": 1e-30, "logprobs": 1},
        {"temperature": 2, "top_p": 1e-30},
        {"stop": ["", "\u0000"], "stop_token_ids": [10**12]},
    ],
    ids=["seed-negative", "seed-2^64", "seed-wraps-with-n", "top-k-huge", "temperature-tiny",
         "temperature-max-top-p-tiny", "odd-stops"],
)
def test_odd_but_valid_values_are_served(server, bystander, fields):
    """Values the device tensors cannot hold as sent must not fail the step (and every
    live request with it)."""
    status, _, raw = request(server + C, "POST", body(prompt="hi", max_tokens=3, **fields))
    assert status == 200, raw
    out = json.loads(raw)
    assert len(out["choices"]) == fields.get("n", 1)
    assert all(c["finish_reason"] in ("length", "stop") for c in out["choices"])
    for choice in out["choices"]:
        for value in (choice["logprobs"] or {}).get("token_logprobs", []):
            assert value is None or not math.isnan(value)


def test_after_the_catalog(server, bystander):
    bystander.join(timeout=120)
    assert bystander.error is None, bystander.error
    assert bystander.finish_reason == "length" and bystander.num_chunks >= 100

    status, _, raw = request(server + "/health", "GET", None)
    assert (status, json.loads(raw)) == (200, {"status": "ok"})
    deadline = time.monotonic() + 2
    while pages_held(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pages_held(server) == 0
    m = metric_values(server)
    assert m["jaxserve:kv_cache_usage_perc"] == 0
    assert m["jaxserve:num_requests_running"] == m["jaxserve:num_requests_waiting"] == 0
    assert m.get("jaxserve:request_success_total{finished_reason=\"error\"}", 0) == 0

    # unknown fields are ignored, as OpenAI does
    status, _, raw = request(server + C, "POST", body(
        prompt="hi", max_tokens=2, logit_bias={}, suffix="x", best_of=1,
        some_future_field={"nested": [1, 2]}, model=MODEL,
    ))
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 2
    status, _, raw = request(server + CHAT, "POST", body(
        messages=[{"role": "user", "content": "hi", "extra": 1}], max_tokens=2,
        tools=[], parallel_tool_calls=False, response_format={"type": "text"},
    ))
    assert status == 200, raw
