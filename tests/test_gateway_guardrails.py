"""Guardrail checks against the example checker run as a real process (allowed, refused,
hanging, late, unreachable), against in-process servers that answer badly or trickle, and
the pure pieces: output windows and the input text of a request body."""

import asyncio
import contextlib
import json
import random
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from gateway.config import CheckConfig
from gateway.guardrails import Guardrail, OutputWindows, Verdict, input_text

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from common import free_port, server_process  # noqa: E402  (the benchmarks' own start-up)

CHECKER = ROOT / "examples" / "guardrail_checker.py"
TIMEOUT_S = 0.3
MARGIN_S = 0.5  # a failing check returns within TIMEOUT_S + this, on a busy machine too
SLOW_S = 0.8  # the "slow" checker's --delay-s: longer than TIMEOUT_S


@pytest.fixture(scope="module")
def checkers(tmp_path_factory) -> dict[str, str]:
    """Base URLs of example checkers: "rules" denies two patterns, "hang" never answers,
    "slow" denies one pattern, after SLOW_S."""
    flags = {
        "rules": ["--deny", r"pass(word)?", "--deny", "launch code"],
        "hang": ["--hang"],
        "slow": ["--delay-s", str(SLOW_S), "--deny", "password"],
    }
    logs = tmp_path_factory.mktemp("checkers")
    urls = {}
    with contextlib.ExitStack() as stack:
        for name, args in flags.items():
            port = free_port()
            urls[name] = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, str(CHECKER), "--port", str(port), *args]
            stack.enter_context(
                server_process(cmd, urls[name] + "/health", logs / f"{name}.log", timeout_s=30))
        yield urls


async def timed_check(
    url: str, text: str = "hello", kind: str = "input", policy: str = "fail_closed",
    timeout_s: float = TIMEOUT_S,
) -> tuple[Verdict, float, list[tuple[str, str, str]]]:
    """One check by a fresh Guardrail: its verdict, its seconds and the on_outcome calls."""
    calls = []
    config = CheckConfig(name="rules", url=url, timeout_s=timeout_s, policy=policy)
    async with aiohttp.ClientSession() as session:
        guardrail = Guardrail(config, session, on_outcome=lambda *call: calls.append(call))
        start = time.monotonic()
        verdict = await guardrail.check(text, kind, "tiny-model")
        return verdict, time.monotonic() - start, calls


def stats(base_url: str) -> dict[str, int]:
    with urllib.request.urlopen(base_url + "/stats", timeout=5) as resp:
        return json.load(resp)


def test_allowed(checkers):
    before = stats(checkers["rules"])
    verdict, _, calls = asyncio.run(timed_check(checkers["rules"] + "/check", "a fine day"))
    assert verdict == Verdict(True, None, "allowed")
    assert calls == [("rules", "input", "allowed")]
    assert stats(checkers["rules"])["input"] == before["input"] + 1


@pytest.mark.parametrize(("text", "rule"), [("my PassWord is hunter2", "pass(word)?"),
                                            ("the LAUNCH CODE is", "launch code")])
def test_refused_with_the_rule_as_reason(checkers, text, rule):
    before = stats(checkers["rules"])
    verdict, _, calls = asyncio.run(
        timed_check(checkers["rules"] + "/check", text, kind="output"))
    assert verdict == Verdict(False, f"matched rule {rule}", "refused")
    assert calls == [("rules", "output", "refused")]
    assert stats(checkers["rules"])["output"] == before["output"] + 1


@pytest.mark.parametrize("policy", ["fail_open", "fail_closed"])
@pytest.mark.parametrize(("target", "why"), [
    ("hang", "timed out after 0.3s"),
    ("slow", "timed out after 0.3s"),
    ("closed", "connection failed"),
    ("not found", "answered HTTP 404"),
])
def test_failure_is_settled_by_policy_within_timeout(checkers, target, why, policy):
    url = {
        "hang": checkers["hang"] + "/check",
        "slow": checkers["slow"] + "/check",
        "closed": f"http://127.0.0.1:{free_port()}/check",  # nothing listens there
        "not found": checkers["rules"] + "/no-such-path",
    }[target]
    verdict, seconds, calls = asyncio.run(timed_check(url, policy=policy))
    assert seconds < TIMEOUT_S + MARGIN_S
    outcome = policy.replace("fail", "failed")
    assert verdict == Verdict(policy == "fail_open", f"check rules failed: {why}", outcome)
    assert calls == [("rules", "input", outcome)]


def test_hanging_checker_was_asked(checkers):
    before = stats(checkers["hang"])
    asyncio.run(timed_check(checkers["hang"] + "/check", kind="output"))
    assert stats(checkers["hang"])["output"] == before["output"] + 1


def test_late_answer_within_timeout_counts(checkers):
    verdict, seconds, _ = asyncio.run(
        timed_check(checkers["slow"] + "/check", "password", timeout_s=SLOW_S + 2))
    assert verdict == Verdict(False, "matched rule password", "refused")
    assert seconds >= SLOW_S


def test_example_checker_rejects_a_malformed_request(checkers):
    request = urllib.request.Request(checkers["rules"] + "/check", data=b'{"text": 1}')
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=5)
    assert e.value.code == 400


@contextlib.asynccontextmanager
async def serving(handler: Callable[[web.Request], Awaitable[web.Response]]
                  ) -> AsyncIterator[str]:
    """An in-process checker that answers /check with `handler`; yields its URL."""
    app = web.Application()
    app.router.add_post("/check", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}/check"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(("status", "body", "why"), [
    (500, b'{"allowed": true}', "answered HTTP 500"),
    (200, b"allowed", "answered no JSON"),
    (200, b"\xff\xfe", "answered no JSON"),
    (200, b'{"allowed": "yes"}', 'answered no boolean "allowed"'),
    (200, b'{"allowed": 1}', 'answered no boolean "allowed"'),
    (200, b"[true]", 'answered no boolean "allowed"'),
    (200, b"{}", 'answered no boolean "allowed"'),
])
def test_bad_answers_are_failures(status, body, why):
    async def handler(request: web.Request) -> web.Response:
        return web.Response(status=status, body=body, content_type="application/json")

    async def run():
        async with serving(handler) as url:
            return await timed_check(url, policy="fail_closed")

    verdict, _, calls = asyncio.run(run())
    assert verdict == Verdict(False, f"check rules failed: {why}", "failed_closed")
    assert calls == [("rules", "input", "failed_closed")]


def test_request_body_and_refusal_without_reason():
    received = []

    async def handler(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.json_response({"allowed": False, "reason": 7})  # not a string: dropped

    async def run():
        async with serving(handler) as url:
            return await timed_check(url, "some text", kind="output")

    verdict, _, _ = asyncio.run(run())
    assert received == [{"kind": "output", "model": "tiny-model", "text": "some text"}]
    assert verdict == Verdict(False, "refused by check rules", "refused")


def test_trickled_answer_is_cut_at_the_timeout():
    """Headers at once, then the body a byte at a time: the deadline covers the body too."""
    async def trickle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200\r\n\r\n")
        with contextlib.suppress(ConnectionError):
            for _ in range(200):  # spaces: valid JSON padding, were it ever finished
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.05)
        writer.close()

    async def run():
        port = free_port()
        async with await asyncio.start_server(trickle, "127.0.0.1", port):
            return await timed_check(f"http://127.0.0.1:{port}/check", policy="fail_open")

    verdict, seconds, _ = asyncio.run(run())
    assert seconds < TIMEOUT_S + MARGIN_S
    assert verdict == Verdict(True, "check rules failed: timed out after 0.3s", "failed_open")


def test_unknown_kind_is_an_error():
    config = CheckConfig(name="rules", url="http://127.0.0.1:1/check")

    async def run():
        async with aiohttp.ClientSession() as session:
            await Guardrail(config, session).check("text", "prompt", "m")

    with pytest.raises(ValueError, match="kind"):
        asyncio.run(run())


def stream_windows(windows: OutputWindows, deltas: list[str]) -> list[str]:
    """Every text a stream of `deltas` has checked, the tail at finish included."""
    out = [w for d in deltas if (w := windows.feed(d)) is not None]
    tail = windows.finish()
    return out if tail is None else [*out, tail]


def test_windows_wait_for_window_chars_then_lead_with_overlap():
    windows = OutputWindows(10, overlap_chars=4)
    assert windows.feed("abc") is None
    assert windows.feed("defghij") == "abcdefghij"  # the first window: nothing to overlap
    assert windows.feed("klmno") is None
    assert windows.feed("pqrst") == "ghijklmnopqrst"
    assert windows.feed("uv") is None
    assert windows.finish() == "qrstuv"
    assert windows.finish() is None


def test_a_big_delta_is_one_window():
    windows = OutputWindows(5, overlap_chars=2)
    assert windows.feed("abcdefghijkl") == "abcdefghijkl"
    assert windows.feed("mnopqrstuvwxyz") == "klmnopqrstuvwxyz"


def test_finish_with_nothing_unchecked():
    assert OutputWindows(5).finish() is None
    windows = OutputWindows(5, overlap_chars=2)
    assert windows.feed("hello") == "hello"
    assert windows.feed("") is None
    assert windows.finish() is None


def test_overlap_catches_a_phrase_split_across_windows():
    text = "x" * 18 + "launch code" + "y" * 30  # the phrase straddles the 20-char window
    deltas = list(text)
    assert not any("launch code" in w for w in stream_windows(OutputWindows(20, 0), deltas))
    assert any("launch code" in w for w in stream_windows(OutputWindows(20, 16), deltas))


def test_windows_cover_the_text_exactly_once_plus_overlap():
    rng = random.Random(0)
    text = "".join(rng.choice("abcdefgh ") for _ in range(1000))
    cuts = sorted(rng.sample(range(1, len(text)), 150))
    deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    checked = stream_windows(OutputWindows(37, overlap_chars=8), deltas)
    seen = 0  # the text is the windows, each less the overlap it repeats
    for window in checked:
        lead = min(8, seen)
        assert window[:lead] == text[seen - lead:seen]
        assert len(window) - lead >= 37 or window is checked[-1]
        seen += len(window) - lead
        assert text[:seen].endswith(window)
    assert seen == len(text)


def test_window_sizes_must_be_sensible():
    with pytest.raises(ValueError):
        OutputWindows(0)
    with pytest.raises(ValueError):
        OutputWindows(10, overlap_chars=-1)


@pytest.mark.parametrize(("body", "text"), [
    ({"messages": [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "Hi"}]}, "Be brief.\nHi"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "look at "},
        {"type": "image_url", "image_url": {"url": "http://x"}},
        {"type": "text", "text": "this"}]}]}, "look at this"),
    ({"messages": [{"role": "assistant", "content": None},
                   {"role": "user", "content": "again"}]}, "again"),
    ({"messages": "not a list"}, ""),
    ({"messages": [{"role": "user", "content": [{"type": "text"}, "junk"]}]}, ""),
    ({"prompt": "Once upon a time"}, "Once upon a time"),
    ({"prompt": ["one", "two"]}, "one\ntwo"),
    ({"prompt": [1, 2, 3]}, ""),
    ({"prompt": [[1, 2], [3]]}, ""),
    ({"model": "m"}, ""),
])
def test_input_text(body, text):
    assert input_text(body) == text
