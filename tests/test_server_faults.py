"""A dead or hung engine is never hidden behind a live port: every request in flight ends
with an error, /health says so, and the process exits non-zero for a supervisor to
restart it. Faults are injected through JAXSERVE_FAULT (jaxserve/host/faults.py)."""

import asyncio
import json
import os
import time
import urllib.error
import urllib.request

import aiohttp
import pytest
from serving import running_server, save_tiny_chat_model

pytestmark = pytest.mark.slow  # starts servers

FLAGS = ["--max-batch", "4", "--token-budget", "32", "--num-pages", "256"]


def health(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


async def stream_outcome(session: aiohttp.ClientSession, url: str) -> tuple[int, list]:
    """(status, the stream's events, parsed) of one streamed completion."""
    body = {"prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            return resp.status, [await resp.json()]
        events = []
        async for line in resp.content:
            if line.startswith(b"data: "):
                data = line[6:].strip()
                events.append(None if data == b"[DONE]" else json.loads(data))
        return resp.status, events


@pytest.mark.parametrize("fault", ["raise", "hang"])
def test_a_failed_engine_errors_every_request_and_exits(tmp_path_factory, smollm2_gguf, fault):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("faults"), smollm2_gguf)
    env = {**os.environ, "JAXSERVE_FAULT": f"step:{fault}:6"}
    with running_server(model, *FLAGS, "--step-timeout-s", "2", env=env,
                        check=False) as (url, proc):  # its engine fails on purpose
        async def load():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                return await asyncio.gather(*(stream_outcome(s, url) for _ in range(4)))

        started = time.monotonic()
        outcomes = asyncio.run(load())
        ended = time.monotonic()
        for status, events in outcomes:
            assert status == 200, events
            assert events[-1] is None and "error" in events[-2], events[-3:]
            assert events[-2]["error"]["message"]
        # the hang is found by the watchdog: within the 2 s limit and its polling
        assert ended - started < (10 if fault == "hang" else 5)
        status, body = health(url)
        assert status == 503 and body["status"] == "failed" and "step" in body["error"], body
        code = proc.wait(timeout=10)
    assert code == 1
    log = proc.log_path.read_text()
    assert "the engine has failed" in log


# (where the fault is, streamed, the counter that counts it)
FAULT_POINTS = [
    ("emit", False, 'jaxserve:request_success_total{finished_reason="error"} 1.0'),
    ("sample", False, 'jaxserve:request_success_total{finished_reason="error"} 1.0'),
    ("serialize", False, "jaxserve:response_errors_total 1.0"),
    ("serialize", True, "jaxserve:response_errors_total 1.0"),
    ("emit", True, 'jaxserve:request_success_total{finished_reason="error"} 1.0'),
]


@pytest.mark.parametrize(("point", "stream", "counter"), FAULT_POINTS,
                         ids=[f"{p}-{'stream' if s else 'json'}" for p, s, _ in FAULT_POINTS])
def test_a_fault_in_one_request_fails_that_request_alone(tmp_path_factory, smollm2_gguf, point,
                                                         stream, counter):
    """One of 8 concurrent requests fails while post-processing its tokens (emit), setting up
    its sampling (sample) or writing its answer (serialize): that one ends with an error
    (a 500, or a stream's error event then [DONE]), the other 7 give the tokens a
    fault-free run gives, the fault is counted once, and every page comes back."""
    model = save_tiny_chat_model(tmp_path_factory.mktemp("isolate"), smollm2_gguf)
    env = {**os.environ, "JAXSERVE_FAULT": f"{point}:raise:req-3"}
    prompts = [f"Count to {i}:" for i in range(8)]

    async def one(session, url, prompt) -> tuple[bool, str]:
        """(whether it succeeded, its text)."""
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        async with session.post(url + "/v1/completions", json=body) as resp:
            if not stream:
                answer = await resp.json()
                if resp.status != 200:
                    assert resp.status == 500 and answer["error"]["message"], answer
                    return False, ""
                return True, answer["choices"][0]["text"]
            assert resp.status == 200
            events = [line[6:].strip() async for line in resp.content
                      if line.startswith(b"data: ")]
            assert events[-1] == b"[DONE]", events
            parsed = [json.loads(e) for e in events[:-1]]
            if "error" in parsed[-1]:
                assert parsed[-1]["error"]["message"], parsed[-1]
                return False, ""
            return True, "".join(c["choices"][0]["text"] for c in parsed if c["choices"])

    async def round_of_8(url: str) -> list[tuple[bool, str]]:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
            return await asyncio.gather(*(one(s, url, p) for p in prompts))

    with running_server(model, *FLAGS, env=env) as (url, _):
        faulty = asyncio.run(round_of_8(url))  # req-1..8: req-3 fails
        clean = asyncio.run(round_of_8(url))  # req-9..16: no fault
        status, body = health(url)
        assert status == 200 and body == {"status": "ok"}
        with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
            metrics = resp.read().decode()
    failed = [i for i, (ok, _) in enumerate(faulty) if not ok]
    assert len(failed) == 1, faulty
    assert all(ok for ok, _ in clean)
    for i, ((_, got), (_, want)) in enumerate(zip(faulty, clean)):
        if i not in failed:
            assert got == want and want
    assert counter in metrics.splitlines()
    used = [x for x in metrics.splitlines() if x.startswith("jaxserve:kv_cache_usage_perc ")]
    assert used == ["jaxserve:kv_cache_usage_perc 0.0"]
