"""The gateway's Batch API (gateway/batch_*.py) on a real SQLite file, over real HTTP,
through the official openai client.

Most tests send the batch's requests to a replica written here (`FakeReplica`), so
capacity, refusals, failures and timing are the test's to set; the slow one runs a
batch on a real `jaxserve serve` process.
"""

import asyncio
import json
import re
import sqlite3
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest
from aiohttp import web

from gateway import batch_api
from gateway.batch_api import add_routes
from gateway.batch_runner import BatchRunner
from gateway.batch_store import SCHEMA, BatchStore
from server.protocol import APIError
from server.responses import json_response

MODEL = "tiny"
CHAT = "/v1/chat/completions"


@web.middleware
async def render_api_errors(request: web.Request, handler) -> web.StreamResponse:
    """The gateway's error middleware, as far as these routes need it."""
    try:
        return await handler(request)
    except APIError as e:
        return json_response(e.body, e.status, e.headers)


class FakeReplica:
    """`send` answering like a replica: the first `refusals` calls get `refusal`; then a
    chat completion echoing the prompt upper-cased after `delay_s`, a 400 for the
    prompt "bad", and an exception for the prompt "raise"."""

    def __init__(self, delay_s: float = 0.0, refusals: int = 0, refusal: int = 429):
        self.delay_s = delay_s
        self.refusals = refusals
        self.refusal = refusal
        self.calls = 0
        self.running = 0
        self.most_running = 0

    async def __call__(self, path: str, body: dict) -> tuple[int, dict]:
        assert path == CHAT
        self.calls += 1
        if self.calls <= self.refusals:
            return self.refusal, {"error": {"message": "busy"}}
        prompt = body["messages"][0]["content"]
        if prompt == "raise":
            raise RuntimeError("the replica's answer could not be read")
        if prompt == "bad":
            return 400, {"error": {"message": "bad request", "type": "invalid_request_error"}}
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.running -= 1
        message = {"role": "assistant", "content": prompt.upper()}
        return 200, {"id": f"chatcmpl-{self.calls}", "object": "chat.completion", "created": 0,
                     "model": body["model"],
                     "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]}


class Gateway:
    """The batch routes and a runner on one database file, served on loopback by an event
    loop in a thread. `spare(model)` is `capacity` less the runner's requests in flight."""

    def __init__(self, db: Path, send, capacity: int = 4, poll_s: float = 0.02):
        self.db = db
        self.send = send
        self.capacity = capacity  # the test changes it while the runner reads it
        self.poll_s = poll_s

    def __enter__(self) -> "Gateway":
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self._start())
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0,
                                    timeout=30)
        return self

    def __exit__(self, *exc) -> None:
        self.run(self._stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    def spare(self, model: str) -> int:
        return max(0, self.capacity - self.runner.in_flight(model))

    async def _start(self) -> None:
        self.store = BatchStore(self.db)
        self.runner = BatchRunner(self.store, self.send, self.spare, self.poll_s)
        app = web.Application(middlewares=[render_api_errors])
        add_routes(app, self.store, self.runner)
        self.site = web.AppRunner(app)
        await self.site.setup()
        await web.TCPSite(self.site, "127.0.0.1", 0).start()
        host, port = self.site.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        await self.runner.start()

    async def _stop(self) -> None:
        await self.runner.stop()
        await self.site.cleanup()
        self.store.close()


@pytest.fixture
def gateway(tmp_path):
    with Gateway(tmp_path / "batches.sqlite", FakeReplica()) as gw:
        yield gw


def chat_lines(n: int, prompts: dict[int, str] | None = None, **body) -> list[dict]:
    """`n` chat requests `req-<i>` saying "hello <i>" (or `prompts[i]`)."""
    prompts = prompts or {}
    return [{"custom_id": f"req-{i}", "method": "POST", "url": CHAT,
             "body": {"model": MODEL, "max_tokens": 8, **body,
                      "messages": [{"role": "user", "content": prompts.get(i, f"hello {i}")}]}}
            for i in range(n)]


def jsonl(lines: list) -> bytes:
    return "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines).encode()


def submit(client: openai.OpenAI, lines: list, window: str = "24h"):
    file = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint=CHAT, completion_window=window)


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout_s: float = 10.0):
    """The batch once `done(batch)` holds."""
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"waited {timeout_s} s: {batch}"
        time.sleep(0.02)


def ended(client: openai.OpenAI, batch_id: str, status: str, timeout_s: float = 10.0):
    return wait_for(client, batch_id, lambda b: b.status == status, timeout_s)


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def results(client: openai.OpenAI, batch) -> tuple[dict, dict]:
    """(output lines, error lines) by custom_id, each custom_id of the batch in exactly one
    line of the two files."""
    output, errors = read_jsonl(client, batch.output_file_id), read_jsonl(client,
                                                                          batch.error_file_id)
    ids = [line["custom_id"] for line in output + errors]
    assert len(ids) == len(set(ids)) == batch.request_counts.total, ids
    assert len({line["id"] for line in output + errors}) == len(ids)
    return {x["custom_id"]: x for x in output}, {x["custom_id"]: x for x in errors}


def test_a_batch_runs_to_completion(tmp_path):
    replica = FakeReplica(delay_s=0.01)
    path = tmp_path / "input.jsonl"
    path.write_bytes(jsonl(chat_lines(20)))
    with Gateway(tmp_path / "batches.sqlite", replica, capacity=4) as gw:
        with path.open("rb") as f:
            file = gw.client.files.create(file=f, purpose="batch")
        assert (file.purpose, file.bytes, file.filename) == ("batch", path.stat().st_size,
                                                            "input.jsonl")
        batch = gw.client.batches.create(input_file_id=file.id, endpoint=CHAT,
                                         completion_window="24h", metadata={"job": "nightly"})
        assert batch.status == "in_progress" and batch.expires_at - batch.created_at == 86400
        batch = ended(gw.client, batch.id, "completed")
        output, errors = results(gw.client, batch)
        assert not errors and batch.error_file_id is None
        for i in range(20):
            line = output[f"req-{i}"]
            assert line["error"] is None and line["id"].startswith("batch_req_")
            assert line["response"]["status_code"] == 200
            answer = line["response"]["body"]["choices"][0]["message"]["content"]
            assert answer == f"HELLO {i}"
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (20, 20, 0)
        assert batch.metadata == {"job": "nightly"} and batch.model == MODEL
        assert batch.completed_at >= batch.in_progress_at >= batch.created_at
        assert batch.model_extra["at_risk"] is False
        assert 1 <= replica.most_running <= 4 and replica.calls == 20
        assert gw.client.files.retrieve(batch.output_file_id).purpose == "batch_output"
        listed = [f.id for f in gw.client.files.list()]
        assert listed == [batch.output_file_id, file.id]  # newest first
        assert [b.id for b in gw.client.batches.list()] == [batch.id]


def test_batches_are_listed_newest_first_in_pages(gateway):
    ids = [submit(gateway.client, chat_lines(1)).id for _ in range(3)]
    page = gateway.client.batches.list(limit=2)
    assert page.has_more and [b.id for b in page.data] == ids[:0:-1]
    assert [b.id for b in gateway.client.batches.list(limit=2)] == ids[::-1]  # every page
    inputs = [gateway.client.batches.retrieve(i).input_file_id for i in ids]
    files = gateway.client.files.list(purpose="batch", order="asc", limit=1)
    assert [f.id for f in files] == inputs


BAD_INPUTS = {
    "not JSON": (["{not json"], "line 2 of the input file: not valid JSON"),
    "no custom_id": ([{"method": "POST", "url": CHAT, "body": {"model": MODEL}}], "custom_id"),
    "custom_id twice": ([{**chat_lines(1)[0]}], "custom_id 'req-0' repeats"),
    "wrong url": ([{**chat_lines(1)[0], "custom_id": "x", "url": "/v1/completions"}],
                  "is not the batch's endpoint"),
    "stream": ([{**chat_lines(1, stream=True)[0], "custom_id": "x"}], "body.stream"),
    "GET": ([{**chat_lines(1)[0], "custom_id": "x", "method": "GET"}], "method must be"),
    "no model": ([{"custom_id": "x", "method": "POST", "url": CHAT, "body": {}}],
                 "body.model"),
    "not an object": (["[1, 2]"], "not a JSON object"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_input_files_are_checked_whole_when_the_batch_is_created(gateway, case):
    extra, message = BAD_INPUTS[case]
    with pytest.raises(openai.BadRequestError) as e:
        submit(gateway.client, chat_lines(1) + extra)
    assert message in e.value.message and e.value.body["param"] == "input_file_id"
    assert not gateway.client.batches.list().data


def test_an_empty_input_file_is_refused(gateway):
    with pytest.raises(openai.BadRequestError, match="no requests"):
        submit(gateway.client, [])


def test_batch_parameters_are_checked(gateway):
    file = gateway.client.files.create(file=("in.jsonl", jsonl(chat_lines(2))), purpose="batch")
    create = gateway.client.batches.create
    with pytest.raises(openai.BadRequestError) as e:
        create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h")
    assert e.value.body["param"] == "endpoint"
    for window in ("soon", "0h", "24", "-1h"):
        with pytest.raises(openai.BadRequestError) as e:
            create(input_file_id=file.id, endpoint=CHAT, completion_window=window)
        assert e.value.body["param"] == "completion_window"
    with pytest.raises(openai.BadRequestError) as e:
        create(input_file_id=file.id, endpoint=CHAT, completion_window="24h",
               metadata={"k": 1})
    assert e.value.body["param"] == "metadata"
    with pytest.raises(openai.BadRequestError) as e:
        gateway.client.files.create(file=("in.jsonl", jsonl(chat_lines(2))), purpose="fine-tune")
    assert e.value.body["param"] == "purpose"
    assert not gateway.client.batches.list().data


def test_an_upload_over_the_size_limit_is_refused(gateway, monkeypatch):
    monkeypatch.setattr(batch_api, "MAX_FILE_BYTES", 100)
    with pytest.raises(openai.APIStatusError) as e:
        gateway.client.files.create(file=("in.jsonl", jsonl(chat_lines(5))), purpose="batch")
    assert e.value.status_code == 413 and e.value.body["param"] == "file"


def test_unknown_ids_are_404(gateway):
    c = gateway.client
    calls = [
        lambda: c.files.retrieve("file-nope"),
        lambda: c.files.content("file-nope"),
        lambda: c.batches.retrieve("batch_nope"),
        lambda: c.batches.cancel("batch_nope"),
        lambda: c.batches.create(input_file_id="file-nope", endpoint=CHAT,
                                 completion_window="24h"),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.body["type"] == "not_found_error" and "nope" in e.value.message


def test_each_key_sees_only_its_own_files_and_batches(gateway):
    mine = gateway.client
    theirs = openai.OpenAI(base_url=gateway.url + "/v1", api_key="another", max_retries=0,
                           timeout=30)
    batch = submit(mine, chat_lines(2))
    done = ended(mine, batch.id, "completed")
    for call in (lambda: theirs.batches.retrieve(batch.id),
                 lambda: theirs.batches.cancel(batch.id),
                 lambda: theirs.files.retrieve(batch.input_file_id),
                 lambda: theirs.files.content(done.output_file_id),
                 lambda: theirs.batches.create(input_file_id=batch.input_file_id, endpoint=CHAT,
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert theirs.batches.list().data == [] and theirs.files.list().data == []
    assert [b.id for b in mine.batches.list().data] == [batch.id]
    assert len(read_jsonl(mine, done.output_file_id)) == 2


def post_json(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json",
                                  "Authorization": "Bearer unused"})  # the client's key
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_complete_within_is_completion_window_by_another_name(gateway):
    file = gateway.client.files.create(file=("in.jsonl", jsonl(chat_lines(1))), purpose="batch")
    url = gateway.url + "/v1/batches"
    status, batch = post_json(url, {"input_file_id": file.id, "endpoint": CHAT,
                                    "completeWithin": "90s"})
    assert status == 200 and batch["completion_window"] == "90s"
    assert batch["expires_at"] - batch["created_at"] in (89, 90, 91)
    status, same = post_json(url, {"input_file_id": file.id, "endpoint": CHAT,
                                   "completion_window": "1.5m", "completeWithin": "90s"})
    assert status == 200 and same["expires_at"] - same["created_at"] in (89, 90, 91)
    status, error = post_json(url, {"input_file_id": file.id, "endpoint": CHAT,
                                    "completion_window": "2d", "completeWithin": "90s"})
    assert status == 400 and error["error"]["param"] == "completeWithin"


def test_nothing_starts_while_there_is_no_spare_capacity(tmp_path):
    replica = FakeReplica(delay_s=0.05)
    with Gateway(tmp_path / "batches.sqlite", replica, capacity=0) as gw:
        batch = submit(gw.client, chat_lines(8))
        time.sleep(0.5)  # 25 polls
        assert replica.calls == 0
        batch = gw.client.batches.retrieve(batch.id)
        assert batch.status == "in_progress" and batch.request_counts.completed == 0
        gw.capacity = 2
        batch = ended(gw.client, batch.id, "completed")
        assert batch.request_counts.completed == 8 and replica.most_running == 2


@pytest.mark.parametrize("refusal", [429, 502, 503])
def test_refused_requests_run_again(tmp_path, refusal):
    replica = FakeReplica(refusals=3, refusal=refusal)
    with Gateway(tmp_path / "batches.sqlite", replica, capacity=2) as gw:
        batch = ended(gw.client, submit(gw.client, chat_lines(5)).id, "completed")
        output, errors = results(gw.client, batch)
        assert not errors and {x["response"]["status_code"] for x in output.values()} == {200}
        assert replica.calls == 5 + 3


def test_a_failure_ends_one_request_only(tmp_path):
    """A replica's 4xx is that request's result (output file); an exception while
    sending or storing fails that request (error file); the others complete."""
    replica = FakeReplica()
    with Gateway(tmp_path / "batches.sqlite", replica) as gw:
        lines = chat_lines(6, prompts={1: "raise", 4: "bad"})
        batch = ended(gw.client, submit(gw.client, lines).id, "completed")
        output, errors = results(gw.client, batch)
        assert list(errors) == ["req-1"]
        assert errors["req-1"]["error"]["code"] == "batch_request_failed"
        assert "RuntimeError" in errors["req-1"]["error"]["message"]
        assert output["req-4"]["response"]["status_code"] == 400
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (6, 4, 2)


def test_a_store_written_before_owners_opens_with_its_batches(tmp_path):
    """A batch database from before files and batches had owners (no `owner` columns)
    gains them on open; what it held belongs to no key and is still read."""
    db = tmp_path / "old.sqlite"
    with sqlite3.connect(db) as old:
        old.executescript(re.sub(r",\s*owner TEXT NOT NULL DEFAULT ''[^\n]*", "", SCHEMA))
        old.execute("INSERT INTO files (id, purpose, filename, bytes, created_at, content)"
                    " VALUES ('file-old', 'batch', 'a.jsonl', 2, 0, x'7b7d')")
    old.close()
    store = BatchStore(db)
    try:
        assert store.get_file("file-old", owner="").filename == "a.jsonl"
        assert [f.id for f in store.list_files(owner="")] == ["file-old"]
        assert store.list_batches(owner="") == []
    finally:
        store.close()
    BatchStore(db).close()  # opened again: nothing left to add


def test_a_stopped_runner_picks_up_where_it_left_off(tmp_path):
    db = tmp_path / "batches.sqlite"
    first = FakeReplica(delay_s=0.05)
    with Gateway(db, first, capacity=2) as gw:
        batch = submit(gw.client, chat_lines(20))
        wait_for(gw.client, batch.id, lambda b: b.request_counts.completed >= 5)
    store = BatchStore(db)
    counts = store.get_batch(batch.id).counts
    store.close()
    assert counts.remaining == 20 - counts.completed > 0  # the stop requeued its sends
    second = FakeReplica()
    with Gateway(db, second, capacity=2) as gw:
        batch = ended(gw.client, batch.id, "completed")
        output, _ = results(gw.client, batch)
        assert len(output) == 20
        assert second.calls == counts.remaining  # nothing finished ran again


def test_a_gateway_that_died_loses_no_result(tmp_path):
    """Requests left running go back to pending on open; finished ones stay."""
    db = tmp_path / "batches.sqlite"
    store = BatchStore(db)
    owner = batch_api.owner_of("Bearer unused")  # the test gateway's client
    file = store.create_file(jsonl(chat_lines(5)), "in.jsonl", "batch", owner)
    batch_id = store.create_batch(file.id, CHAT, "24h", owner=owner).id
    running = store.pending(MODEL, 3)
    for request in running:
        assert store.mark_running(request.key)
    store.mark_done(running[0].key, 200, {"id": "chatcmpl-0", "choices": []})
    other = store.create_batch(file.id, CHAT, "24h", owner=owner).id  # cancelled, 2 running
    for request in store.pending(MODEL, 10)[-2:]:
        store.mark_running(request.key)
    store.cancel(other)
    store.close()  # no requeue: as if the process had died

    store = BatchStore(db)
    assert [r.custom_id for r in store.pending(MODEL, 10)] == ["req-1", "req-2", "req-3",
                                                                "req-4"]
    counts = store.get_batch(batch_id).counts
    assert (counts.completed, counts.remaining) == (1, 4)
    assert store.settled() == [other]  # its running requests will not run again
    store.close()
    replica = FakeReplica()
    with Gateway(db, replica) as gw:
        batch = ended(gw.client, batch_id, "completed")
        output, _ = results(gw.client, batch)
        assert output["req-0"]["response"]["body"]["id"] == "chatcmpl-0"
        assert output["req-0"]["response"]["request_id"] == "chatcmpl-0"
        assert replica.calls == 4
        cancelled = ended(gw.client, other, "cancelled")
        _, errors = results(gw.client, cancelled)
        assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}


def test_at_the_deadline_what_did_not_run_expires(tmp_path):
    with Gateway(tmp_path / "batches.sqlite", FakeReplica(), capacity=0) as gw:
        batch = submit(gw.client, chat_lines(5), window="2s")
        assert batch.expires_at - batch.created_at == 2
        batch = ended(gw.client, batch.id, "expired", timeout_s=5)
        assert time.time() >= batch.expires_at and batch.expired_at is not None
        output, errors = results(gw.client, batch)
        assert not output and batch.output_file_id is None
        assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
        assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 5)


def test_a_batch_too_slow_for_its_window_is_at_risk_before_it_expires(tmp_path):
    replica = FakeReplica(delay_s=0.25)  # 4 requests a second: 20 take 5 s
    with Gateway(tmp_path / "batches.sqlite", replica, capacity=1) as gw:
        batch = submit(gw.client, chat_lines(20), window="3s")
        assert batch.model_extra["at_risk"] is False  # nothing measured yet
        assert batch.model_extra["estimated_completion_at"] is None
        batch = wait_for(gw.client, batch.id, lambda b: b.request_counts.completed >= 2)
        assert time.time() < batch.expires_at and batch.status == "in_progress"
        assert batch.model_extra["at_risk"] is True
        assert batch.model_extra["estimated_completion_at"] > batch.expires_at
        batch = ended(gw.client, batch.id, "expired", timeout_s=5)
        output, errors = results(gw.client, batch)
        assert 5 <= len(output) < 20 and len(errors) == 20 - len(output)
        assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
        assert batch.model_extra["at_risk"] is False
        assert replica.running == 0  # the send running at the deadline was stopped


def test_cancel_ends_what_has_not_started_and_waits_for_the_rest(tmp_path):
    replica = FakeReplica(delay_s=0.3)
    with Gateway(tmp_path / "batches.sqlite", replica, capacity=2) as gw:
        batch = submit(gw.client, chat_lines(10))
        wait_for(gw.client, batch.id,
                 lambda b: b.request_counts.completed >= 2 and replica.running == 2)
        batch = gw.client.batches.cancel(batch.id)
        assert batch.status == "cancelling" and batch.cancelling_at is not None
        batch = ended(gw.client, batch.id, "cancelled")
        output, errors = results(gw.client, batch)
        assert len(output) >= 4  # the two running when it was cancelled finished
        assert {e["error"]["code"] for e in errors.values()} == {"batch_cancelled"}
        assert gw.client.batches.cancel(batch.id).status == "cancelled"

        gw.capacity = 0
        idle = gw.client.batches.cancel(submit(gw.client, chat_lines(3)).id)
        assert idle.status == "cancelled" and idle.output_file_id is None
        done = submit(gw.client, chat_lines(1))
        gw.capacity = 1
        done = ended(gw.client, done.id, "completed")
        with pytest.raises(openai.BadRequestError, match="completed"):
            gw.client.batches.cancel(done.id)


def replica_send(url: str):
    """`send` to a real replica: its HTTP status and JSON body."""

    async def send(path: str, body: dict) -> tuple[int, dict]:
        async with aiohttp.ClientSession() as session, session.post(url + path,
                                                                    json=body) as r:
            return r.status, await r.json()

    return send


@pytest.mark.slow
def test_a_batch_on_a_real_replica(tiny_model, tmp_path):
    from serving import running_server  # torch and transformers: only when a test needs them

    flags = ["--max-batch", "8", "--token-budget", "64", "--num-pages", "512",
             "--max-model-len", "512", "--served-model-name", MODEL]
    with running_server(tiny_model, *flags) as (url, _):
        lines = chat_lines(20) + [{**chat_lines(1, temperature=5.0)[0], "custom_id": "hot"}]
        with Gateway(tmp_path / "batches.sqlite", replica_send(url), capacity=4) as gw:
            batch = ended(gw.client, submit(gw.client, lines).id, "completed", timeout_s=60)
            output, errors = results(gw.client, batch)
    assert not errors and len(output) == 21
    assert output["hot"]["response"]["status_code"] == 400
    assert output["hot"]["response"]["body"]["error"]["param"] == "temperature"
    for i in range(20):
        response = output[f"req-{i}"]["response"]
        assert response["status_code"] == 200
        assert response["body"]["object"] == "chat.completion"
        assert response["request_id"] == response["body"]["id"]
        assert isinstance(response["body"]["choices"][0]["message"]["content"], str)
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (21, 20, 1)
