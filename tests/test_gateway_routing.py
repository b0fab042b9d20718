"""The gateway's choices without replicas: the config file, the pool a request belongs
to (model, prompt length, class) and the replica with the most headroom."""

from pathlib import Path

import pytest

from gateway import config
from gateway.replicas import Replica, parse_gauges
from gateway.routing import Router, count_prompt, open_tokenizer
from server.protocol import APIError

ROOT = Path(__file__).resolve().parents[1]


def _config(gguf: Path) -> config.GatewayConfig:
    return config.parse({
        "pools": [
            {"name": "chat", "model": "m", "replicas": ["http://a", "http://b"],
             "tokenizer": str(gguf), "max_prompt_tokens": 32},
            {"name": "long", "model": "m", "replicas": ["http://c"], "tokenizer": str(gguf),
             "priorities": ["interactive"]},
            {"name": "other", "model": "n", "replicas": ["http://d/"]},
        ],
    })


def test_the_example_platform_file_parses():
    cfg = config.load(ROOT / "examples" / "platform.toml")
    assert cfg.models == ("smollm2", "smollm2-bf16")
    assert [p.name for p in cfg.pools_for("smollm2")] == ["chat", "long"]
    assert all(p.spawn is not None for p in cfg.pools)


@pytest.mark.parametrize("raw, message", [
    ({}, "no \\[\\[pools\\]\\]"),
    ({"pools": [{"name": "a"}]}, "name and a model"),
    ({"pools": [{"name": "a", "model": "m"}]}, "no replicas"),
    ({"pools": [{"name": "a", "model": "m", "replicas": ["u"], "max_prompt_tokens": 9}]},
     "need a tokenizer"),
    ({"pools": [{"name": "a", "model": "m", "replicas": ["u"], "input_check": "x"}]},
     "not under \\[checks\\]"),
    ({"pools": [{"name": "a", "model": "m", "replicas": ["u"], "priorities": ["vip"]}]},
     "priorities"),
    ({"pools": [{"name": "a", "model": "m", "replicas": ["u"]}] * 2}, "repeat"),
    ({"pools": [{"name": "a", "model": "m", "replicas": ["u"]}], "gateway": {"prot": 1}},
     "unknown \\[gateway\\] keys"),
    ({"pools": [{"name": "a", "model": "m", "replicas": ["u"]}],
      "checks": {"x": {"url": "u", "policy": "maybe"}}}, "policy"),
])
def test_a_bad_config_is_refused_with_the_key_at_fault(raw, message):
    with pytest.raises(config.ConfigError, match=message):
        config.parse(raw)


def test_requests_go_to_the_first_pool_that_admits_them(smollm2_gguf):
    cfg = _config(smollm2_gguf)
    router = Router(cfg, {p.name: [Replica(u, p.name) for u in p.replicas] for p in cfg.pools})
    short = {"model": "m", "prompt": "Hello there"}
    long = {"model": "m", "prompt": "word " * 100}
    assert router.pool_for("m", "/v1/completions", short, "interactive").name == "chat"
    assert router.pool_for("m", "/v1/completions", long, "interactive").name == "long"
    assert router.pool_for("n", "/v1/completions", long, "batch").name == "other"
    with pytest.raises(APIError) as e:  # the long pool takes no batch requests
        router.pool_for("m", "/v1/completions", long, "batch")
    assert e.value.status == 400 and "no pool" in str(e.value)
    with pytest.raises(APIError) as e:
        router.pool_for("x", "/v1/completions", short, "interactive")
    assert e.value.status == 404
    assert cfg.pools[2].replicas == ("http://d",)


def test_prompts_are_counted_as_the_replica_counts_them(smollm2_gguf):
    tokenizer = open_tokenizer(str(smollm2_gguf))
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}],
                                         add_generation_prompt=True)
    expected = len(tokenizer.encode(text, add_special_tokens=False))
    assert count_prompt(tokenizer, "/v1/chat/completions", chat) == expected
    assert count_prompt(tokenizer, "/v1/completions", {"prompt": [1, 2, 3]}) == 3
    assert count_prompt(tokenizer, "/v1/completions", {"prompt": ["a", "a b c d"]}) == len(
        tokenizer.encode("a b c d"))


def test_the_replica_with_most_headroom_is_chosen(smollm2_gguf):
    cfg = _config(smollm2_gguf)
    a, b = Replica("http://a", "chat", up=True), Replica("http://b", "chat", up=True)
    router = Router(cfg, {"chat": [a, b], "long": [], "other": []})
    pool = cfg.pools[0]
    a.running, a.pages_free, a.pages_total = 3, 10, 100
    b.running, b.pages_free, b.pages_total = 1, 90, 100
    assert router.replica_for(pool) is b
    b.sent_since_poll = 3  # sent since the last poll: b holds 4 now
    assert router.replica_for(pool) is a
    a.up = False
    assert router.replica_for(pool) is b
    assert router.replica_for(pool, exclude=(b,)) is None
    b.waiting = 1
    assert router.batch_replicas(pool) == []


def test_gauges_are_read_from_the_replicas_metrics():
    text = ("# HELP jaxserve:kv_pages_free KV pages\n# TYPE jaxserve:kv_pages_free gauge\n"
            "jaxserve:kv_pages_free 120.0\njaxserve:num_requests_waiting 2.0\n"
            'jaxserve:request_success_total{finished_reason="stop"} 4.0\n')
    assert parse_gauges(text) == {"pages_free": 120.0, "waiting": 2.0}


def test_a_loading_replica_says_how_far_it_is():
    from gateway.replicas import _not_ready

    assert _not_ready(503, {"status": "loading", "compiled": 12, "buckets": 35}) == (
        "loading: 12/35 buckets compiled")
    assert _not_ready(503, {"status": "failed", "error": "boom"}) == (
        "/health answered 503: failed boom")
    assert _not_ready(502, None) == "/health answered 502"
