"""Admission as a closed-loop client meets it, against a server at default flags: never a
429 while the client keeps --max-batch requests in flight, and past that a 429 only when
the server's own estimated wait is past its budget."""

import asyncio
import re

import aiohttp
import pytest
from serving import running_server

pytestmark = pytest.mark.slow  # starts servers or multi-device processes

MAX_BATCH = 16  # the default --max-batch
BUDGET_S = 5.0  # the default --queue-wait-budget-ms, in seconds
BODY = {"prompt": "one two three four five six seven eight", "max_tokens": 16,
        "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    # the real model: its steps are long enough that a burst of requests waits together
    with running_server(smollm2_gguf) as (url, _):  # every engine and queue flag at its default
        yield url


async def closed_loop(url: str, concurrency: int, requests: int) -> dict[int, list[dict]]:
    """`concurrency` clients sending one completion after another, `requests` in all;
    the answers by status."""
    left = iter(range(requests))
    answers: dict[int, list[dict]] = {}

    async def client(session):
        for _ in left:
            async with session.post(url + "/v1/completions", json=BODY) as response:
                answers.setdefault(response.status, []).append(await response.json())

    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return answers


def test_a_closed_loop_at_max_batch_is_never_refused(server):
    answers = asyncio.run(closed_loop(server, MAX_BATCH, 100))
    assert set(answers) == {200} and len(answers[200]) == 100


def test_past_max_batch_a_429_comes_only_with_a_wait_past_the_budget(server):
    answers = asyncio.run(closed_loop(server, 2 * MAX_BATCH, 100))
    assert set(answers) <= {200, 429} and len(answers.get(200, [])) > 0
    for body in answers.get(429, []):
        message = body["error"]["message"]
        wait = re.search(r"an estimated wait of ([\d.]+)s", message)
        assert wait and float(wait[1]) > BUDGET_S, message


def test_choices_that_fit_the_free_rows_do_not_count_as_queued(server):
    """On an idle server, 2 prompts × n=16 (32 sequences, twice --max-batch): the first 16
    take free rows at once, so only 16 wait: within the bound, answered, not refused."""
    async def one():
        body = {**BODY, "prompt": ["one two", "three four"], "n": 16, "max_tokens": 4}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            async with session.post(server + "/v1/completions", json=body) as response:
                return response.status, await response.json()

    status, body = asyncio.run(one())
    assert status == 200, body
    assert len(body["choices"]) == 32
