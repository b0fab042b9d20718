"""GET /openapi.json: a valid OpenAPI 3.1 document of every route, held to a live server.

The fast tests read the document from the app itself (no model) and check that its
response schemas refuse what the server must not send; the slow one runs schemathesis
against a real `jaxserve serve` on the tiny model: no 5xx, and every status, content
type, header and body (JSON and each server-sent event) as documented.
"""

import asyncio
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import requests
import schemathesis
from aiohttp.test_utils import TestClient, TestServer
from serving import running_server

from server import openapi
from server.app import Server, ServerConfig, build_app


def served_document(app) -> tuple[int, str, dict]:
    async def get():
        async with TestClient(TestServer(app)) as client:
            resp = await client.get("/openapi.json")
            return resp.status, resp.content_type, await resp.json()

    return asyncio.run(get())


def test_the_document_is_openapi_and_lists_every_route():
    app = build_app(Server(ServerConfig()))
    status, content_type, doc = served_document(app)
    assert (status, content_type) == (200, "application/json")
    schemathesis.openapi.from_dict(doc).validate()  # raises on an invalid document
    routes = {(r.method.lower(), r.resource.canonical) for r in app.router.routes()
              if r.method != "HEAD"}  # aiohttp adds HEAD to every GET
    assert routes == {(method, path) for path, ops in doc["paths"].items() for method in ops}


def max_tokens(doc: dict, struct: str) -> dict:
    prop = doc["components"]["schemas"][struct]["properties"]["max_tokens"]
    return next(b for b in prop["anyOf"] if b["type"] == "integer")


def test_max_tokens_is_bounded_by_the_loaded_models_context():
    assert "maximum" not in max_tokens(openapi.document(), "CompletionRequest")
    doc = openapi.document(max_model_len=128)
    assert max_tokens(doc, "CompletionRequest") == {"type": "integer", "minimum": 1,
                                                    "maximum": 127}
    assert max_tokens(doc, "ChatCompletionRequest")["maximum"] == 127
    assert "maximum" not in max_tokens(openapi.document(), "CompletionRequest")  # not mutated


CHUNK = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
         "choices": [{"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}]}
USAGE = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
ERROR = {"error": {"message": "m", "type": "server_error", "param": None, "code": None}}


def events(*bodies: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(b).encode() + b"\n\n" for b in bodies) + \
        b"data: [DONE]\n\n"


def answer(content_type: str, body: bytes) -> schemathesis.Response:
    request = requests.Request("POST", "http://127.0.0.1/v1/completions").prepare()
    return schemathesis.Response(200, {"Content-Type": [content_type]}, body, request,
                                 elapsed=0.0, verify=False)


@pytest.mark.parametrize(
    ("content_type", "body", "ok"),
    [
        ("application/json", {**CHUNK, "choices": [{**CHUNK["choices"][0],
                                                    "finish_reason": "length"}],
                              "usage": USAGE}, True),
        ("application/json", {**CHUNK, "usage": USAGE}, False),  # a whole answer is finished
        ("application/json", {**CHUNK, "choices": [], "usage": USAGE, "extra": 1}, False),
        ("text/event-stream", events(CHUNK, {**CHUNK, "choices": [], "usage": USAGE}), True),
        ("text/event-stream", events(CHUNK, ERROR), True),  # the engine failed mid-stream
        ("text/event-stream", events({**CHUNK, "object": "chat.completion.chunk"}), False),
        ("text/event-stream", events({**CHUNK, "choices": [{"index": 0, "text": "hi"}]}),
         False),
        ("text/event-stream", b"data: [DONE!]\n\n", False),
    ],
    ids=["whole", "whole-unfinished", "unknown-field", "stream", "stream-error",
         "stream-wrong-object", "stream-missing-fields", "stream-bad-done"],
)
def test_the_response_schemas_refuse_what_the_server_must_not_send(content_type, body, ok):
    """The schemas are strict enough for schemathesis's checks to mean something."""
    operation = schemathesis.openapi.from_dict(openapi.document())["/v1/completions"]["POST"]
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    if ok:
        operation.validate_response(answer(content_type, raw))
    else:
        with pytest.raises(AssertionError, match="violates schema"):
            operation.validate_response(answer(content_type, raw))


# few buckets: a fast start; a short context: short answers and a real max_tokens bound
FLAGS = ["--max-batch", "16", "--token-budget", "64", "--buckets", "16,64:4,16",
         "--num-pages", "256", "--max-model-len", "128", "--served-model-name", "tiny"]
CHECKS = ["not_a_server_error", "response_schema_conformance", "status_code_conformance",
          "content_type_conformance", "response_headers_conformance", "negative_data_rejection"]
MIN_REQUESTS = 500


def answered(ndjson: str) -> Counter:
    """(method, path, status, content type) of every answered request in a run's events."""
    seen = Counter()
    for line in ndjson.splitlines():
        event = json.loads(line)
        for interaction in event.get("ScenarioFinished", {}).get("recorder", {}).get(
                "interactions", {}).values():
            resp = interaction.get("response")
            if resp is None:
                continue
            request = interaction["request"]
            path = "/" + request["uri"].split("/", 3)[3].split("?")[0]
            content_type = resp["headers"].get("content-type", [""])[0].split(";")[0]
            seen[request["method"], path, resp["status_code"], content_type] += 1
    return seen


@pytest.mark.slow
def test_schemathesis_finds_no_server_error_and_no_schema_violation(tiny_model, tmp_path):
    report, events_path = tmp_path / "report.json", tmp_path / "events.ndjson"
    with running_server(tiny_model, *FLAGS) as (url, _):
        run = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("schemathesis_cli.py")), "run",
             url + "/openapi.json",
             "--checks", ",".join(CHECKS), "--max-examples", "100", "--workers", "2",
             # n=16 answers with logprobs take seconds on a loaded 2-core machine
             "--request-timeout", "60", "--generation-database", "none", "--no-color",
             "--report", "json,ndjson", "--report-json-path", str(report),
             "--report-ndjson-path", str(events_path)],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )
    summary = json.loads(report.read_text())
    assert run.returncode == 0 and summary["exit_code"] == 0, run.stdout[-20000:]
    assert summary["failures"] == [] and summary["errors"] == [], run.stdout[-20000:]
    assert summary["test_cases"]["with_failures"] == 0

    seen = answered(events_path.read_text())
    assert sum(seen.values()) >= MIN_REQUESTS, seen
    assert not [key for key in seen if key[2] >= 500], seen
    # the answers' schemas were tried, not only the 400s: bodies and streams of both APIs
    for path in ("/v1/completions", "/v1/chat/completions"):
        for content_type in ("application/json", "text/event-stream"):
            assert seen["POST", path, 200, content_type], (path, content_type, seen)
    for path in ("/v1/models", "/health", "/metrics", "/admin/requests"):
        assert seen["GET", path, 200, "application/json" if path != "/metrics"
                    else "text/plain"], (path, seen)
