"""LoRA adapters through the HTTP server: chosen by `model`, listed by /v1/models with
their parent, loaded and unloaded at run time by admins (vLLM's routes), refused with a
clear 400 when they cannot be served, limited per tenant, and counted in /metrics."""

import json
import urllib.error
import urllib.request

import openai
import pytest
from lora_adapters import save_random_adapter
from serving import metric_samples, running_server

MODEL = "tiny"
ADMIN, USER, LIMITED = "sk-admin", "sk-user", "sk-limited"
KEYS = {ADMIN: {"tenant": "ops", "admin": True}, USER: {"tenant": "users"},
        LIMITED: {"tenant": "acme", "adapters": ["a0"]}}
FLAGS = ["--max-batch", "4", "--token-budget", "32", "--num-pages", "128",
         "--max-model-len", "256", "--buckets", "4,32:1,4", "--max-loras", "2",
         "--max-lora-rank", "16", "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    save_random_adapter(tiny_model, root / "a0", 8, ["q_proj", "v_proj"], seed=0, std=0.3)
    save_random_adapter(tiny_model, root / "a1", 16, "all-linear", seed=1, std=0.3)
    save_random_adapter(tiny_model, root / "big", 32, ["q_proj"], seed=2)
    save_random_adapter(tiny_model, root / "embed", 8, ["embed_tokens"], seed=3)
    return root


@pytest.fixture(scope="module")
def server(tiny_model, adapters, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with running_server(tiny_model, *FLAGS, "--lora", f"a0={adapters / 'a0'}",
                        "--enable-runtime-lora", "--api-keys-file", str(keys),
                        "--api-key", "sk-root") as (url, _):
        yield url


def client(url: str, key: str = USER) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def post(url: str, body: dict, key: str | None = ADMIN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def complete(url: str, model: str, key: str = USER) -> str:
    return client(url, key).completions.create(
        model=model, prompt="The capital of France is", max_tokens=8, temperature=0
    ).choices[0].text


def test_an_adapter_is_a_model_with_a_parent(server):
    models = {m.id: m for m in client(server).models.list().data}
    assert set(models) == {MODEL, "a0"}
    assert models["a0"].model_extra["parent"] == MODEL
    assert models["a0"].model_extra["root"].endswith("a0")
    base, tuned = complete(server, MODEL), complete(server, "a0")
    assert tuned != base  # the adapter changes the answer...
    assert complete(server, "a0") == tuned  # ...the same way each time
    chat = client(server).chat.completions.create(
        model="a0", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
    assert chat.model == "a0" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="'a9' does not exist"):
        complete(server, "a9")


def test_runtime_load_and_unload(server, adapters):
    load = server + "/v1/load_lora_adapter"
    unload = server + "/v1/unload_lora_adapter"
    body = {"lora_name": "a1", "lora_path": str(adapters / "a1")}
    assert post(load, body, key=None)[0] == 401
    status, answer = post(load, body, key=USER)
    assert status == 401 and answer["error"]["code"] == "not_admin"
    status, answer = post(load, body)
    assert status == 200 and answer["id"] == "a1" and answer["rank"] == 16
    again = post(load, body)[1]["error"]
    assert again["param"] == "lora_name" and "already a served model's name" in again["message"]
    first = complete(server, "a1")
    assert first not in (complete(server, MODEL), complete(server, "a0"))
    # a0, a1 and the base through 2 slots, in one burst of requests
    texts = [complete(server, m) for m in ("a0", "a1", MODEL, "a1")]
    assert texts[1] == texts[3] == first
    status, answer = post(unload, {"lora_name": "a1"})
    assert status == 200 and answer["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        complete(server, "a1")
    assert post(unload, {"lora_name": "a1"})[0] == 404
    # loaded again: the same weights give the same tokens (and no stale cached pages)
    assert post(load, body)[0] == 200
    assert complete(server, "a1") == first
    assert post(unload, {"lora_name": "a1"})[0] == 200


@pytest.mark.parametrize("name, message", [
    ("big", "rank 32 exceeds --max-lora-rank 16"),
    ("embed", "'embed_tokens' does not exist"),
    ("missing", "not a PEFT adapter directory"),
])
def test_an_adapter_that_cannot_be_served_gets_a_clear_400(server, adapters, name, message):
    status, answer = post(server + "/v1/load_lora_adapter",
                          {"lora_name": name, "lora_path": str(adapters / name)})
    assert status == 400, answer
    assert message in answer["error"]["message"] and answer["error"]["param"] == "lora_path"
    assert post(server + "/v1/load_lora_adapter", {"lora_name": MODEL, "lora_path": "x"}
                )[1]["error"]["param"] == "lora_name"


def test_a_tenant_uses_only_the_adapters_it_may(server, adapters):
    assert post(server + "/v1/load_lora_adapter",
                {"lora_name": "a1", "lora_path": str(adapters / "a1")})[0] == 200
    try:
        assert {m.id for m in client(server, LIMITED).models.list().data} == {MODEL, "a0"}
        assert complete(server, "a0", LIMITED)
        with pytest.raises(openai.NotFoundError, match="do not have access"):
            complete(server, "a1", LIMITED)
    finally:
        post(server + "/v1/unload_lora_adapter", {"lora_name": "a1"})


def test_adapter_metrics(server):
    complete(server, "a0")
    with urllib.request.urlopen(server + "/metrics", timeout=30) as r:
        samples = metric_samples(r.read().decode())
    assert samples['jaxserve:lora_requests_total{adapter="a0"}'] >= 1
    assert samples["jaxserve:lora_swaps_total"] >= 1
    assert samples["jaxserve:lora_adapters_loaded"] >= 1
    assert 1 <= samples["jaxserve:lora_slots_in_use"] <= 2


def test_runtime_loading_is_off_unless_enabled(tiny_model, adapters):
    with running_server(tiny_model, *FLAGS) as (url, _):
        status, answer = post(url + "/v1/load_lora_adapter",
                              {"lora_name": "a0", "lora_path": str(adapters / "a0")}, key=None)
        assert status == 404 and "--enable-runtime-lora" in answer["error"]["message"]
        with pytest.raises(openai.NotFoundError):
            complete(url, "a0", key="none")
