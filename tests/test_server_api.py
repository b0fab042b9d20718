"""The OpenAI API of a real `jaxserve serve` process, through the official openai client.

One server (a tiny random model, small buckets) serves the whole module. It is
started with both `--api-key` (the admin key the clients use) and
`--api-keys-file` (an admin tenant and a limited one), so authentication,
admin rights and tenant limits are checked on the same process as the API.
"""

import asyncio
import json
import time
import urllib.error
import urllib.request

import openai
import pytest
from serving import running_server

from jaxserve.checkpoint.tokenizer import Tokenizer

pytestmark = pytest.mark.slow  # starts servers or multi-device processes

# f32 weights: echo logprobs are compared with transformers' (auto is bf16 on AMX CPUs)
FLAGS = ["--max-batch", "8", "--token-budget", "64", "--num-pages", "512", "--max-model-len", "512",
         "--weight-dtype", "f32"]
MODEL = "tiny"
KEY = "sk-main"  # --api-key: the default tenant, admin
KEYS = {
    "sk-ops": {"tenant": "ops", "admin": True},
    "sk-alice": {"tenant": "alice", "max_output_tokens": 32, "max_concurrent": 1},
}
METRICS = [
    "jaxserve:num_requests_running",
    "jaxserve:num_requests_waiting",
    "jaxserve:kv_pages_total",
    "jaxserve:kv_pages_free",
    "jaxserve:kv_cache_usage_perc",
    "jaxserve:oldest_waiting_request_age_seconds",
    "jaxserve:time_to_first_token_seconds",
    "jaxserve:inter_token_latency_seconds",
    "jaxserve:e2e_request_latency_seconds",
    "jaxserve:request_queue_time_seconds",
    "jaxserve:step_seconds",
    "jaxserve:step_host_seconds",
    "jaxserve:step_device_seconds",
    "jaxserve:step_device_idle_seconds",
    "jaxserve:prompt_tokens_total",
    "jaxserve:generation_tokens_total",
    "jaxserve:request_success_total",
    "jaxserve:requests_rejected_total",
    "jaxserve:compiles_after_warmup_total",
    "jaxserve:preemptions_total",
    "jaxserve:requests_admitted_total",
    "jaxserve:requests_finished_total",
    "jaxserve:num_output_streams",
    "jaxserve:heap_bytes",
]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(json.dumps(KEYS))
    flags = [*FLAGS, "--served-model-name", MODEL, "--api-key", KEY,
             "--api-keys-file", str(keys_file)]
    with running_server(tiny_model, *flags) as (url, _):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return Tokenizer.from_dir(tiny_model)


def http(url: str, body: dict | None = None, key: str | None = KEY, method: str | None = None):
    """(status, headers, parsed JSON or text) of one request, errors included."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data, headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            status, head, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as e:
        status, head, raw = e.code, e.headers, e.read()
    try:
        return status, head, json.loads(raw)
    except ValueError:
        return status, head, raw.decode()


def assert_error(payload, param=None, code=None):
    """OpenAI's error object: exactly message, type, param, code."""
    assert set(payload) == {"error"}, payload
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error


def metric_values(url: str) -> dict[str, float]:
    """Samples of /metrics by name (labels kept in the name)."""
    status, _, text = http(url + "/metrics", key=None)
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


# ---------------------------------------------------------------- basics


def test_health_models_and_metrics_names(server, client):
    status, _, body = http(server + "/health", key=None)
    assert (status, body) == (200, {"status": "ok"})
    assert [m.id for m in client.models.list().data] == [MODEL]
    status, _, body = http(server + "/v1/models")
    assert status == 200 and body["object"] == "list" and body["data"][0]["id"] == MODEL
    card = body["data"][0]  # what is served, beside OpenAI's fields
    assert (card["dtype"], card["weight_dtype"], card["kv_dtype"]) == ("float32", "float32", "f32")
    assert 0 < card["max_model_len"] <= 2048

    client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, seed=0)
    _, _, text = http(server + "/metrics", key=None)
    declared = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    samples = metric_values(server)
    for name in METRICS:
        exposed = name in declared or any(s.split("{")[0].startswith(name) for s in samples)
        assert exposed, f"{name} missing from /metrics"
    assert samples["jaxserve:compiles_after_warmup_total"] == 0
    assert samples["jaxserve:preemptions_total"] == 0
    assert samples["jaxserve:kv_pages_total"] > 0
    assert samples["jaxserve:generation_tokens_total"] >= 2
    assert samples['jaxserve:request_success_total{finished_reason="length"}'] >= 1


# ---------------------------------------------------------------- completions


def test_completion_sync_and_stream_agree(client, tokenizer):
    prompt = "Once upon a time"
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "seed": 7,
            "extra_body": {"ignore_eos": True}}
    out = client.completions.create(**args)
    (choice,) = out.choices
    assert choice.finish_reason == "length" and choice.index == 0
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert out.usage.completion_tokens == 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.model == MODEL and out.object == "text_completion"

    chunks = list(
        client.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text  # same seed, same text, streamed or not
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_seed_reproducible_and_n_choices_differ(client):
    args = {"model": MODEL, "prompt": "The weather today", "max_tokens": 10, "temperature": 1.0}
    first = client.completions.create(**args, seed=123)
    again = client.completions.create(**args, seed=123)
    other = client.completions.create(**args, seed=124)
    assert first.choices[0].text == again.choices[0].text
    assert first.choices[0].text != other.choices[0].text

    many = client.completions.create(**args, seed=5, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    texts = [c.text for c in many.choices]
    assert len(set(texts)) == 3, texts
    assert 3 <= many.usage.completion_tokens <= 30  # every choice counts
    assert [c.text for c in client.completions.create(**args, seed=5, n=3).choices] == texts


def test_stop_string_truncates(client):
    args = {"model": MODEL, "prompt": "A list of words:", "max_tokens": 24, "seed": 11,
            "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**args).choices[0].text
    middle = len(full) // 2
    stop = full[middle : middle + 3]
    cut = full.find(stop)
    assert stop and cut > 0, full
    out = client.completions.create(**args, stop=[stop, "\x00never"])
    assert out.choices[0].text == full[:cut]
    assert out.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(**args, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == full[:cut]
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logit_bias_steers_both_apis(client, tokenizer):
    word = tokenizer.encode(" sea", add_special_tokens=False)[0]
    bias = {str(word): 100}
    out = client.completions.create(
        model=MODEL, prompt="A list of words:", max_tokens=5, temperature=0,
        logit_bias=bias, extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == tokenizer.decode([word] * 5)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A list of words:"}], max_tokens=5,
        temperature=0.7, seed=3, logit_bias=bias, stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == (
        tokenizer.decode([word] * 5))


def test_completion_logprobs(client):
    out = client.completions.create(
        model=MODEL, prompt="Numbers:", max_tokens=6, seed=3, logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0
        # alternatives are keyed by text, so two ids with one text may merge
        assert 1 <= len(top) <= 2
        assert max(top.values()) >= chosen - 1e-4


def test_echo_lists_of_prompts_and_token_ids(client, tokenizer):
    echo = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, seed=1,
                                     echo=True)
    assert echo.choices[0].text.startswith("Hello world")
    plain = client.completions.create(model=MODEL, prompt="Hello world", max_tokens=3, seed=1)
    assert echo.choices[0].text == "Hello world" + plain.choices[0].text
    streamed = list(client.completions.create(
        model=MODEL, prompt="Hello world", max_tokens=3, seed=1, echo=True, stream=True
    ))
    assert "".join(c.choices[0].text for c in streamed) == echo.choices[0].text

    prompts = ["Hello world", "Bonjour"]
    many = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, seed=1, n=2)
    assert [c.index for c in many.choices] == [0, 1, 2, 3]
    assert many.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert many.choices[0].text == plain.choices[0].text  # prompt 0, choice 0: seed 1

    ids = tokenizer.encode("Hello world")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=3, seed=1)
    assert by_ids.choices[0].text == plain.choices[0].text
    two = client.completions.create(
        model=MODEL, prompt=[ids, tokenizer.encode("Bonjour")], max_tokens=3, seed=1
    )
    assert [c.text for c in two.choices] == [many.choices[0].text, many.choices[2].text]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, tokenizer,
                                                                    tiny_model):
    """lm-evaluation-harness's loglikelihood request: every prompt token's logprob.

    The prompt spans two prefill chunks (token budget 64), and the same prompt was
    sent just before, so its pages sit in the prefix cache: scoring must not take them.
    """
    import torch
    import transformers

    text = " ".join(f"word{i} is number {i}." for i in range(14))
    ids = tokenizer.encode(text)
    assert 64 < len(ids) < 200
    client.completions.create(model=MODEL, prompt=text, max_tokens=1)  # fills the cache
    args = {"model": MODEL, "prompt": text, "max_tokens": 2, "echo": True, "logprobs": 1,
            "temperature": 0}
    out = client.completions.create(**args)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(text)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 2
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.tokens[: len(ids)] == [tokenizer.decode([i]) for i in ids]

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    want = torch.log_softmax(logits, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1 : len(ids)])
    assert torch.abs(got - want).max() < 1e-4
    for chosen, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert max(top.values()) >= chosen - 1e-4  # the greedy alternative is the best

    streamed = list(client.completions.create(**args, stream=True))
    chunks = [c.choices[0] for c in streamed if c.choices and c.choices[0].logprobs]
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    assert [t for c in chunks for t in c.logprobs.token_logprobs] == lp.token_logprobs


# ---------------------------------------------------------------- chat


def test_chat_sync_stream_usage_and_logprobs(client):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say something."}]
    args = {"model": MODEL, "messages": messages, "max_tokens": 8, "seed": 9,
            "extra_body": {"ignore_eos": True}}
    out = client.chat.completions.create(**args, logprobs=True, top_logprobs=2)
    (choice,) = out.choices
    assert out.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 8
    content = choice.logprobs.content
    assert len(content) == 8
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-4
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob

    chunks = list(client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_async_client_concurrent_requests_match_sync(server, client):
    """AsyncOpenAI, every kind of request at once: seeded outputs equal the sync ones."""
    completion = {"model": MODEL, "prompt": "In the beginning", "max_tokens": 8, "seed": 21,
                  "extra_body": {"ignore_eos": True}}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "seed": 22, "extra_body": {"ignore_eos": True}}
    want_completion = client.completions.create(**completion).choices[0].text
    want_chat = client.chat.completions.create(**chat).choices[0].message.content

    async def run():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0,
                                     timeout=60)

        async def stream_completion():
            stream = await aclient.completions.create(**completion, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        async def stream_chat():
            stream = await aclient.chat.completions.create(**chat, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        async def plain_completion():
            return (await aclient.completions.create(**completion)).choices[0].text

        async def plain_chat():
            return (await aclient.chat.completions.create(**chat)).choices[0].message.content

        async with aclient:
            return await asyncio.wait_for(
                asyncio.gather(stream_completion(), plain_completion(), stream_chat(),
                               plain_chat(), stream_completion(), plain_chat()),
                timeout=120,
            )

    got = asyncio.run(run())
    assert got == [want_completion, want_completion, want_chat, want_chat, want_completion,
                   want_chat]


# ---------------------------------------------------------------- operators and auth


def test_admin_requests_lists_live_requests(server, client):
    stream = client.completions.create(model=MODEL, prompt="Tell a long story", max_tokens=400,
                                       seed=1, stream=True, extra_body={"ignore_eos": True})
    try:
        next(iter(stream))
        status, _, body = http(server + "/admin/requests")
        assert status == 200 and body["object"] == "list"
        (row,) = [r for r in body["data"] if r["tenant"] == "default"]
        assert set(row) == {"request_id", "tenant", "priority", "phase", "pages",
                            "num_generated", "age_seconds"}
        assert row["phase"] in ("prefill", "decode") and row["pages"] > 0
        assert row["priority"] == 0 and row["age_seconds"] >= 0
    finally:
        stream.close()
    deadline = time.monotonic() + 5
    while http(server + "/admin/requests")[2]["data"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert http(server + "/admin/requests")[2]["data"] == []  # the dropped stream is cancelled


def test_x_priority_lowers_a_request_to_the_batch_class(server, client):
    stream = client.completions.create(
        model=MODEL, prompt="Tell a long story", max_tokens=400, stream=True,
        extra_body={"ignore_eos": True}, extra_headers={"X-Priority": "batch"})
    try:
        next(iter(stream))
        (row,) = [r for r in http(server + "/admin/requests")[2]["data"]
                  if r["tenant"] == "default"]
        assert row["priority"] == 1
    finally:
        stream.close()
    with pytest.raises(openai.BadRequestError, match="X-Priority"):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=2,
                                  extra_headers={"X-Priority": "urgent"})


def test_api_keys(server):
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    for key in (None, "sk-wrong", "Bearer", ""):
        status, _, body = http(server + "/v1/completions", completion, key=key)
        assert status == 401
        assert_error(body, code="invalid_api_key")
        assert body["error"]["type"] == "authentication_error"
        status, _, body = http(server + "/v1/models", key=key)
        assert status == 401
        assert_error(body, code="invalid_api_key")
    for key in (KEY, "sk-ops", "sk-alice"):
        assert http(server + "/v1/completions", completion, key=key)[0] == 200
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=server + "/v1", api_key="sk-wrong", max_retries=0).models.list()
    assert e.value.status_code == 401

    for key in (KEY, "sk-ops"):
        assert http(server + "/admin/requests", key=key)[0] == 200
    for key, code in (("sk-alice", "not_admin"), (None, "invalid_api_key")):
        status, _, body = http(server + "/admin/requests", key=key)
        assert status == 401
        assert_error(body, code=code)
    assert http(server + "/health", key=None)[0] == 200  # probes need no key
    assert http(server + "/metrics", key=None)[0] == 200


def test_tenant_limits(server):
    status, _, body = http(server + "/v1/completions",
                           {"model": MODEL, "prompt": "Hi", "max_tokens": 64}, key="sk-alice")
    assert status == 400
    assert_error(body, param="max_tokens")
    assert "32" in body["error"]["message"]

    alice = openai.OpenAI(base_url=server + "/v1", api_key="sk-alice", max_retries=0, timeout=60)
    stream = alice.completions.create(model=MODEL, prompt="Hi", max_tokens=32, stream=True,
                                      extra_body={"ignore_eos": True})
    try:
        next(iter(stream))  # alice's one concurrent request is running
        status, headers, body = http(server + "/v1/completions",
                                     {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
                                     key="sk-alice")
        assert status == 429
        assert_error(body, code="tenant_concurrency_limit")
        assert body["error"]["type"] == "rate_limit_error"
        assert int(headers["Retry-After"]) >= 1
        # the limit is alice's alone
        assert http(server + "/v1/completions", {"model": MODEL, "prompt": "Hi",
                                                 "max_tokens": 2}, key="sk-ops")[0] == 200
    finally:
        stream.close()
    deadline = time.monotonic() + 5
    while True:  # the dropped stream gives its place back
        status = http(server + "/v1/completions",
                      {"model": MODEL, "prompt": "Hi", "max_tokens": 2}, key="sk-alice")[0]
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert status == 200
    samples = metric_values(server)
    assert samples['jaxserve:requests_rejected_total{reason="tenant_concurrency_limit"}'] >= 1


def test_tenants_keyed_by_api_key_do_not_share_a_prefix_cache(server):
    """A tenant's prompt is found in its own prefix cache, never in another's (else one
    could learn another's prompts from its TTFT)."""
    prompt = list(range(100, 180))  # five full pages of 16

    def hits_after(key: str) -> float:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        assert http(server + "/v1/completions", body, key=key)[0] == 200
        return metric_values(server)["jaxserve:prefix_cache_hits_total"]

    first = hits_after("sk-ops")
    again = hits_after("sk-ops")
    assert again - first >= 64  # ops finds its own prompt
    other = hits_after("sk-alice")
    assert other == again, "alice hit ops's cached prompt"
    assert hits_after("sk-alice") - other >= 64
