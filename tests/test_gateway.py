"""`jaxserve route` in front of real replicas: routing by model and prompt length, the
replica with most headroom, a replica lost and put back, a client's disconnect reaching
the replica, 429s passed on, and guardrails (input refusals never reach a replica)."""

import asyncio
import contextlib
import io
import json
import re
import sys
import time

import aiohttp
import openai
import pytest
from gateways import (
    admitted,
    get_json,
    kill,
    pool_json,
    replica_process,
    running_gateway,
    samples,
    wait_for,
)
from lora_adapters import save_random_adapter
from serving import ROOT, free_port, running_server, server_process

from jaxserve.checkpoint.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

MODEL, VARIANT = "tiny", "tiny-x"
FLAGS = ["--max-batch", "4", "--token-budget", "64", "--num-pages", "256",
         "--max-model-len", "512", "--buckets", "4,64:1,4", "--served-model-name", MODEL]
LONG_PROMPT = "The history of the river valley " * 40  # ~240 tokens: past the chat pool's 64


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("adapter") / "x"
    save_random_adapter(tiny_model, path, 8, ["q_proj", "v_proj"], seed=0, std=0.3)
    return path


@pytest.fixture(scope="module")
def replicas(tiny_model, adapter):
    """A and B serve the chat pool; C serves the long-context pool (one row at a time,
    a queue of 1, so it refuses with 429 early) and the adapter's model."""
    with (running_server(tiny_model, *FLAGS) as (a, _),
          running_server(tiny_model, *FLAGS) as (b, _),
          running_server(tiny_model, *FLAGS, "--max-batch", "1", "--max-queue", "1",
                         "--lora", f"{VARIANT}={adapter}") as (c, _)):
        yield a, b, c


def config(replicas, tiny_model, **chat) -> dict:
    a, b, c = replicas
    tokenizer = str(tiny_model)
    return {
        "gateway": {"poll_interval_s": 0.1},
        "pools": [
            pool_json("chat", MODEL, [a, b], tokenizer=tokenizer, max_prompt_tokens=64, **chat),
            pool_json("long", MODEL, [c], tokenizer=tokenizer),
            pool_json("variant", VARIANT, [c]),
        ],
    }


@pytest.fixture(scope="module")
def gateway(replicas, tiny_model, tmp_path_factory):
    with running_gateway(config(replicas, tiny_model), tmp_path_factory.mktemp("gw")) as (
        url, _,
    ):
        yield url


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_routes_by_model_and_prompt_length(gateway, replicas):
    before = [admitted(u) for u in replicas]
    out = client(gateway).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert out.model == MODEL and out.choices[0].finish_reason == "length"
    client(gateway).completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=4)
    client(gateway).completions.create(model=VARIANT, prompt="Hi", max_tokens=4)
    after = [admitted(u) for u in replicas]
    assert after[0] + after[1] - before[0] - before[1] == 1  # the short chat
    assert after[2] - before[2] == 2  # the long prompt, and the variant
    models = get_json(gateway + "/v1/models")["data"]
    assert [m["id"] for m in models] == [MODEL, VARIANT]
    with pytest.raises(openai.NotFoundError):
        client(gateway).completions.create(model="nope", prompt="Hi", max_tokens=4)


def test_busy_replica_gets_fewer_requests(gateway, replicas):
    a, b, _ = replicas

    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            async def busy() -> None:  # straight to A, not through the gateway
                body = {"model": MODEL, "prompt": "Count", "max_tokens": 480,
                        "ignore_eos": True}
                async with s.post(a + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    await r.read()

            hogs = [asyncio.create_task(busy()) for _ in range(8)]  # 4 run, 4 wait
            while samples(a)["jaxserve:num_requests_running"] < 4:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)  # the gateway has polled A's gauges since
            before = admitted(a), admitted(b)

            async def one() -> None:
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
                async with s.post(gateway + "/v1/completions", json=body) as r:
                    assert r.status == 200, await r.text()

            for _ in range(8):
                await one()
            to_a, to_b = admitted(a) - before[0], admitted(b) - before[1]
            assert samples(a)["jaxserve:num_requests_waiting"] > 0  # A was busy throughout
            assert to_b == 8 and to_a == 0, (to_a, to_b)
            for hog in hogs:
                hog.cancel()
            await asyncio.gather(*hogs, return_exceptions=True)

    asyncio.run(run())


def test_disconnect_at_the_gateway_frees_the_replicas_pages(gateway, replicas):
    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 450, "ignore_eos": True,
                    "stream": True}
            async with s.post(gateway + "/v1/completions", json=body) as r:
                for _ in range(5):
                    await r.content.readline()
            # leaving the block closed the connection mid-stream

    asyncio.run(run())

    def idle() -> bool:
        m = [samples(u) for u in replicas[:2]]
        return all(x["jaxserve:num_requests_running"] == 0 and x["jaxserve:kv_pages_free"]
                   + x["jaxserve:kv_pages_cached"] == x["jaxserve:kv_pages_total"] for x in m)

    wait_for(idle, 5.0, "the replica cancelled the request and freed its pages")


def test_a_replicas_429_passes_through_with_retry_after(gateway, replicas):
    async def run() -> list[tuple[int, dict, dict]]:
        async with aiohttp.ClientSession() as s:
            async def one() -> tuple[int, dict, dict]:
                body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 32,
                        "ignore_eos": True}
                async with s.post(gateway + "/v1/completions", json=body) as r:
                    return r.status, dict(r.headers), await r.json()

            return await asyncio.gather(*(one() for _ in range(6)))

    results = asyncio.run(run())
    refused = [(h, body) for status, h, body in results if status == 429]
    assert refused and len(refused) < len(results), [r[0] for r in results]
    for headers, body in refused:
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "rate_limit_error"


def test_a_429_is_retried_once_on_a_replica_with_headroom(replicas, tmp_path):
    a, _, c = replicas
    # polled once, at start: both look idle to the gateway, which tries C (listed first)
    cfg = {"gateway": {"poll_interval_s": 600}, "pools": [pool_json("p", MODEL, [c, a])]}
    with running_gateway(cfg, tmp_path) as (gw, _):

        async def run() -> tuple[int, str]:
            async with aiohttp.ClientSession() as s:
                async def hog() -> None:  # straight to C: its one row, then its queue
                    body = {"model": MODEL, "prompt": "Count", "max_tokens": 480,
                            "ignore_eos": True}
                    async with s.post(c + "/v1/completions", json=body) as r:
                        await r.read()

                hogs = [asyncio.create_task(hog()) for _ in range(2)]
                while samples(c)["jaxserve:num_requests_waiting"] < 1:
                    await asyncio.sleep(0.02)
                before = admitted(a)
                body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
                async with s.post(gw + "/v1/completions", json=body) as r:
                    status = r.status
                to_a = admitted(a) - before
                for h in hogs:
                    h.cancel()
                await asyncio.gather(*hogs, return_exceptions=True)
                return status, to_a

        status, to_a = asyncio.run(run())
        assert (status, to_a) == (200, 1)
        m = samples(gw)
        assert m[f'jaxserve:gateway_requests_retried_total{{pool="p",replica="{a}"}}'] == 1
        assert m[f'jaxserve:gateway_requests_routed_total{{pool="p",replica="{c}"}}'] == 1


def test_a_killed_replica_is_taken_out_and_put_back(tiny_model, tmp_path):
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    logs = [tmp_path / f"replica-{i}.log" for i in range(2)]
    cfg = {"gateway": {"poll_interval_s": 0.1}, "pools": [pool_json("p", MODEL, urls)]}
    with (replica_process(tiny_model, ports[0], *FLAGS, log_path=logs[0]) as doomed,
          replica_process(tiny_model, ports[1], *FLAGS, log_path=logs[1]),
          running_gateway(cfg, tmp_path) as (gw, _)):

        async def stream(s: aiohttp.ClientSession, started: asyncio.Event) -> str:
            """'done', or 'error' when the stream ended with an error event."""
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 500, "ignore_eos": True,
                    "stream": True}  # still streaming when the replica is killed
            async with s.post(gw + "/v1/completions", json=body) as r:
                assert r.status == 200
                started.set()
                async for line in r.content:
                    if line.startswith(b"data: {\"error\""):
                        return "error"
                    if line.startswith(b"data: [DONE]"):
                        return "done"
            return "cut"

        async def run() -> list[str]:
            async with aiohttp.ClientSession() as s:
                events = [asyncio.Event() for _ in range(4)]
                tasks = []
                for e in events:  # one at a time, so headroom spreads them 2 and 2
                    tasks.append(asyncio.create_task(stream(s, e)))
                    await e.wait()
                    await asyncio.sleep(0.15)  # past a poll (0.1 s)
                held = int(samples(urls[0])["jaxserve:num_requests_running"])
                kill(doomed)
                return held, await asyncio.gather(*tasks)

        held, outcomes = asyncio.run(run())
        # the killed replica's streams end with an error event, the others' with [DONE]
        assert held >= 1 and sorted(outcomes) == ["done"] * (4 - held) + ["error"] * held, (
            held, outcomes)
        pool = get_json(gw + "/admin/pools")["pools"][0]["replicas"]
        assert [r["up"] for r in pool] == [False, True]
        for _ in range(4):  # new requests go to the live one
            out = client(gw).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert out.choices[0].finish_reason == "length"
        with replica_process(tiny_model, ports[0], *FLAGS, log_path=logs[0]):
            wait_for(lambda: get_json(gw + "/admin/pools")["pools"][0]["replicas"][0]["up"],
                     10, "the restarted replica is put back")
            before = admitted(urls[0])
            for _ in range(4):
                client(gw).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert admitted(urls[0]) > before


@pytest.fixture(scope="module")
def checkers():
    """The example guardrail checker: one refusing a word, one that never answers."""
    urls = {}
    with (_checker("--deny", r"\bforbidden\b") as urls["rules"],
          _checker("--hang") as urls["hang"]):
        yield urls


@contextlib.contextmanager
def _checker(*args: str):
    """examples/guardrail_checker.py on a free port; its URL."""
    port = free_port()
    cmd = [sys.executable, str(ROOT / "examples" / "guardrail_checker.py"), "--port", str(port),
           *args]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url + "/health", ROOT / ".cache" / f"checker-{port}.log", 30,
                        cwd=ROOT):
        yield url


def _guarded(replicas, tiny_model, checkers, check: str, policy: str, **pool) -> dict:
    cfg = config(replicas, tiny_model, **pool)
    cfg["checks"] = {"c": {"url": checkers[check] + "/check", "timeout_s": 0.5,
                           "policy": policy, "window_chars": 16}}
    return cfg


def test_an_input_refusal_never_reaches_a_replica(replicas, tiny_model, checkers, tmp_path):
    cfg = _guarded(replicas, tiny_model, checkers, "rules", "fail_closed", input_check="c")
    with running_gateway(cfg, tmp_path) as (gw, _):
        before = [admitted(u) for u in replicas]
        with pytest.raises(openai.BadRequestError) as refused:
            client(gw).chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "a forbidden thing"}],
                max_tokens=4)
        assert "matched rule" in str(refused.value)
        ids = Tokenizer.from_dir(tiny_model).encode("so forbidden")  # read as text too
        with pytest.raises(openai.BadRequestError, match="matched rule"):
            client(gw).completions.create(model=MODEL, prompt=ids, max_tokens=4)
        assert [admitted(u) for u in replicas] == before
        out = client(gw).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "a fine thing"}], max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        m = samples(gw)
        assert m['jaxserve:gateway_guardrail_checks_total{check="c",kind="input",'
                 'outcome="refused"}'] == 2


def test_an_output_refusal_ends_the_stream_with_content_filter(
    replicas, tiny_model, checkers, tmp_path,
):
    # what the tiny model writes (greedy), so that a rule can refuse a word of it
    prompt = "Tell me a story"
    text = client(replicas[0]).completions.create(
        model=MODEL, prompt=prompt, max_tokens=48, temperature=0).choices[0].text
    opening = text.strip()[:10]  # in the first window: the refusal comes well before the end
    with (_checker("--deny", re.escape(opening)) as rule,
          running_gateway(_guarded(replicas, tiny_model, {"rules": rule}, "rules",
                                   "fail_closed", output_check="c"), tmp_path) as (gw, _)):
        chunks = list(client(gw).completions.create(
            model=MODEL, prompt=prompt, max_tokens=48, temperature=0, stream=True))
        assert chunks[-1].choices[0].finish_reason == "content_filter"
        streamed = "".join(c.choices[0].text for c in chunks)
        assert streamed != text and text.startswith(streamed)
        whole = client(gw).completions.create(model=MODEL, prompt=prompt, max_tokens=48,
                                              temperature=0)
        assert whole.choices[0].finish_reason == "content_filter"
        assert whole.choices[0].text == ""


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
def test_a_hanging_checker_follows_the_pools_policy(
    replicas, tiny_model, checkers, tmp_path, policy,
):
    cfg = _guarded(replicas, tiny_model, checkers, "hang", policy, input_check="c")
    with running_gateway(cfg, tmp_path) as (gw, _):
        start = time.monotonic()
        messages = [{"role": "user", "content": "Hi"}]
        if policy == "fail_open":
            out = client(gw).chat.completions.create(model=MODEL, messages=messages,
                                                     max_tokens=2)
            assert out.choices[0].finish_reason == "length"
        else:
            with pytest.raises(openai.BadRequestError, match="failed"):
                client(gw).chat.completions.create(model=MODEL, messages=messages,
                                                   max_tokens=2)
        assert time.monotonic() - start < 5
        m = samples(gw)
        outcome = "failed_open" if policy == "fail_open" else "failed_closed"
        assert m[f'jaxserve:gateway_guardrail_checks_total{{check="c",kind="input",'
                 f'outcome="{outcome}"}}'] == 1


def test_spawn_starts_the_replicas_and_checkers_and_stops_them(tiny_model, tmp_path):
    """`jaxserve route --spawn`: the pool's replicas and its checker start with the
    gateway, serve through it, and stop with it."""
    port = free_port()
    flags = [f for f in FLAGS if f not in ("--served-model-name", MODEL)]
    cfg = {
        "gateway": {"poll_interval_s": 0.1},
        "pools": [{"name": "p", "model": MODEL, "replicas": [], "input_check": "c",
                   "spawn": {"args": ["--model", str(tiny_model), *flags,
                                      "--compilation-cache-dir", str(ROOT / ".cache" / "jax")],
                             "count": 2}}],
        "checks": {"c": {"url": f"http://127.0.0.1:{port}/check",
                         "spawn": ["python", "examples/guardrail_checker.py", "--port",
                                   str(port), "--deny", "forbidden"]}},
    }
    with running_gateway(cfg, tmp_path, "--spawn", timeout=300) as (gw, _):
        urls = [r["url"] for r in get_json(gw + "/admin/pools")["pools"][0]["replicas"]]
        assert len(urls) == 2
        out = client(gw).completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert out.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError):
            client(gw).completions.create(model=MODEL, prompt="forbidden", max_tokens=2)
    for url in [*urls, f"http://127.0.0.1:{port}"]:
        with pytest.raises(OSError):
            get_json(url + "/health")


def test_the_gateways_own_routes_take_the_replicas_keys(tiny_model, tmp_path):
    """Replicas with keys: the Batch API and /admin at the gateway want a key a replica
    accepts; inference requests are checked by the replica itself; batch requests run
    with the gateway's batch_api_key."""
    with running_server(tiny_model, *FLAGS, "--api-key", "sk-replica") as (url, _):
        cfg = {"gateway": {"poll_interval_s": 0.1, "batch_api_key": "sk-replica"},
               "pools": [pool_json("p", MODEL, [url])]}
        with running_gateway(cfg, tmp_path) as (gw, _):
            def as_(key: str) -> openai.OpenAI:
                return openai.OpenAI(base_url=gw + "/v1", api_key=key, max_retries=0,
                                     timeout=60)

            with pytest.raises(openai.AuthenticationError):
                as_("sk-wrong").batches.list()
            with pytest.raises(openai.AuthenticationError):
                as_("sk-wrong").completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            good = as_("sk-replica")
            out = good.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert out.choices[0].finish_reason == "length"
            line = {"custom_id": "a", "method": "POST", "url": "/v1/completions",
                    "body": {"model": MODEL, "prompt": "Hi", "max_tokens": 2}}
            upload = good.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())),
                                       purpose="batch")
            batch = good.batches.create(input_file_id=upload.id, endpoint="/v1/completions",
                                        completion_window="1h")
            wait_for(lambda: good.batches.retrieve(batch.id).status == "completed", 30,
                     "the batch ran with the gateway's key")
            assert good.batches.retrieve(batch.id).request_counts.completed == 1
            assert samples(gw)['jaxserve:gateway_batch_requests{state="done"}'] == 1
