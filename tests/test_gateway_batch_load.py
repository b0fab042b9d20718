"""Batch jobs through a real gateway and replica: they take only spare capacity (an
interactive load's TTFT hardly moves), and a gateway killed mid-batch loses no result
and runs none twice into the output."""

import asyncio
import io
import json
import statistics
import time

import aiohttp
import numpy as np
import openai
import pytest
from gateways import running_gateway, wait_for
from serving import running_server

pytestmark = pytest.mark.slow

MODEL = "tiny"
FLAGS = ["--max-batch", "4", "--token-budget", "64", "--num-pages", "256",
         "--max-model-len", "512", "--buckets", "4,64:1,4", "--served-model-name", MODEL]


@pytest.fixture(scope="module")
def replica(tiny_model):
    with running_server(tiny_model, *FLAGS) as (url, _):
        yield url


def gateway_config(replica: str) -> dict:
    return {"gateway": {"poll_interval_s": 0.1, "batch_poll_s": 0.05},
            "pools": [{"name": "p", "model": MODEL, "replicas": [replica],
                       "batch_max_in_flight": 2}]}


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def submit(url: str, num: int, tag: str, max_tokens: int = 32) -> str:
    """A batch of `num` chat requests (custom ids `tag-i`); its id."""
    lines = [json.dumps({"custom_id": f"{tag}-{i}", "method": "POST",
                         "url": "/v1/chat/completions",
                         "body": {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                                  "messages": [{"role": "user", "content": f"Story {tag} {i}"}]}})
             for i in range(num)]
    c = client(url)
    upload = c.files.create(file=("in.jsonl", io.BytesIO("\n".join(lines).encode())),
                            purpose="batch")
    return c.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                            completion_window="1h").id


def output_ids(url: str, batch_id: str) -> list[str]:
    batch = client(url).batches.retrieve(batch_id)
    assert batch.status == "completed", batch
    lines = client(url).files.content(batch.output_file_id).text.splitlines()
    results = [json.loads(line) for line in lines]
    assert all(r["response"]["status_code"] == 200 for r in results), results[:2]
    return [r["custom_id"] for r in results]


async def interactive(url: str, until, concurrency: int = 2) -> list[float]:
    """A closed loop of streamed chats through the gateway until `until()`; their TTFTs."""
    ttfts: list[float] = []
    async with aiohttp.ClientSession() as s:
        async def loop(i: int) -> None:
            n = 0
            while not until():
                body = {"model": MODEL, "max_tokens": 16, "stream": True,
                        "messages": [{"role": "user", "content": f"Hello {i} {n}"}]}
                start = time.perf_counter()
                async with s.post(url + "/v1/chat/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    first = None
                    async for line in r.content:
                        if first is None and b'"content":"' in line and b'"content":""' not in line:
                            first = time.perf_counter() - start
                assert first is not None
                ttfts.append(first)
                n += 1

        await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return ttfts


# A timing check, out of the default run (`-m timing` runs it): the client, the gateway and
# the replica share this machine's cores, so one pair's ratio ranges 0.7-1.9. Medians
# measured on 2026-12-02 (Zen 5, 2 cores): alone 1.05, 1.02, 1.11; right after
# tests/test_gateway.py 1.10 (passed) and, the session before, twice over 1.2 (failed).
@pytest.mark.timing
def test_batch_requests_take_only_spare_capacity(replica, tmp_path):
    """280 batch requests, in seven batches, each run beside an interactive load, with
    rounds of the same load and no batch in between (this machine's speed drifts by 2×
    within a minute: only neighbouring rounds compare). The median over the pairs of
    TTFT p95 with a batch ÷ without stays within 1.2×."""
    ratios, p95 = [], {"with": [], "without": []}
    with running_gateway(gateway_config(replica), tmp_path) as (gw, _):
        asyncio.run(interactive(gw, _done(gw, submit(gw, 10, "warm"))))  # warm both paths
        for r in range(7):
            for kind in (("without", "with") if r % 2 == 0 else ("with", "without")):
                if kind == "with":
                    batch_id = submit(gw, 40, f"r{r}")
                    start = time.monotonic()
                    ttfts = asyncio.run(interactive(gw, _done(gw, batch_id)))
                    duration = time.monotonic() - start
                    assert sorted(output_ids(gw, batch_id)) == sorted(
                        f"r{r}-{i}" for i in range(40))
                else:
                    ttfts = asyncio.run(interactive(gw, _for(6.0)))
                p95[kind].append(float(np.percentile(ttfts, 95)))
            ratios.append(p95["with"][-1] / p95["without"][-1])
    print(f"TTFT p95 with a batch / without, per pair: {[round(r, 3) for r in ratios]}; "
          f"median {statistics.median(ratios):.3f}")
    assert statistics.median(ratios) <= 1.2, (ratios, p95, duration)


def _for(seconds: float):
    end = time.monotonic() + seconds
    return lambda: time.monotonic() >= end


def _done(url: str, batch_id: str):
    state = {"at": 0.0, "done": False}

    def done() -> bool:  # asked between requests: look at most every 0.5 s
        if not state["done"] and time.monotonic() - state["at"] > 0.5:
            state["at"] = time.monotonic()
            state["done"] = client(url).batches.retrieve(batch_id).status == "completed"
        return state["done"]

    return done


def test_a_gateway_killed_mid_batch_loses_and_repeats_nothing(replica, tmp_path):
    with running_gateway(gateway_config(replica), tmp_path) as (gw, proc):
        batch_id = submit(gw, 60, "k", max_tokens=24)
        wait_for(lambda: client(gw).batches.retrieve(batch_id).request_counts.completed >= 15,
                 60, "a quarter of the batch has run")
        proc.kill()  # no clean stop: requests in flight are lost with it
        proc.wait()
    with running_gateway(gateway_config(replica), tmp_path) as (gw, _):
        wait_for(lambda: client(gw).batches.retrieve(batch_id).status == "completed", 90,
                 "the batch resumed and completed")
        ids = output_ids(gw, batch_id)
    assert sorted(ids) == sorted(f"k-{i}" for i in range(60))  # every one, once
