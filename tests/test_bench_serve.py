"""bench/serve.py against a live jaxserve on the tiny model: every field, counts that add up."""

import asyncio
import contextlib
import itertools
import json
import sys
import threading
from pathlib import Path

import pytest
from aiohttp import web
from serving import ROOT, running_server, save_tiny_chat_model

sys.path.insert(0, str(ROOT / "bench"))
import serve

pytestmark = pytest.mark.slow  # starts servers or multi-device processes

SMALL = ["--max-batch", "4", "--token-budget", "32", "--num-pages", "256"]


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory, smollm2_gguf):
    model = save_tiny_chat_model(tmp_path_factory.mktemp("tiny"), smollm2_gguf)
    with running_server(model, *SMALL) as (url, _):
        yield url


def test_lengths_parse_n_and_min_max():
    assert serve.Lengths.parse("8") == serve.Lengths(8, 8)
    assert serve.Lengths.parse("4:12") == serve.Lengths(4, 12)
    with pytest.raises(ValueError):
        serve.Lengths.parse("0")
    with pytest.raises(ValueError):
        serve.Lengths.parse("9:3")


def test_prompts_share_their_prefix_and_repeat_for_a_seed():
    workload = serve.Workload(
        requests=3, prompt_tokens=serve.Lengths(20, 30), shared_prefix_tokens=10, seed=7
    )
    first, second = [list(zip(range(3), workload.prompts())) for _ in range(2)]
    assert first == second
    prompts = [p.split() for _, (p, _) in first]
    assert all(20 <= len(p) <= 30 for p in prompts)
    assert prompts[0][:10] == prompts[1][:10] == prompts[2][:10]


def test_poisson_run_reports_every_field(tiny_server, tmp_path, capsys):
    workload = serve.Workload(
        requests=6, rate=20.0, prompt_tokens=serve.Lengths(8, 24),
        output_tokens=serve.Lengths(4, 8), shared_prefix_tokens=4,
        ttft_slo_ms=60_000, tpot_slo_ms=60_000,
    )
    out = tmp_path / "serve.json"
    report = serve.run(tiny_server, None, workload, out=out, progress=False)
    saved = json.loads(out.read_text())
    assert saved["num_sent"] == report["num_sent"] == 6
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(saved[name]) == {"mean", "p50", "p95", "p99"}
        assert saved[name]["p50"] <= saved[name]["p95"] <= saved[name]["p99"]
    for name in ("output_tokens_per_s", "total_tokens_per_s", "goodput", "request_throughput",
                 "duration_s", "num_429", "num_errors", "num_completed", "errors", "timeline"):
        assert name in saved, name
    assert saved["num_completed"] + saved["num_429"] + saved["num_errors"] == saved["num_sent"]
    assert saved["num_completed"] == 6, saved["errors"]
    assert saved["output_tokens"] == sum(r["max_tokens"] for r in _drawn(workload))
    assert saved["goodput"] == pytest.approx(saved["request_throughput"])  # loose SLOs
    assert saved["total_tokens_per_s"] > saved["output_tokens_per_s"] > 0
    assert [Path(p).name for p in saved["plots"]] == [
        "serve_latency_cdf.png", "serve_tokens_per_s.png"
    ]
    assert all(Path(p).stat().st_size > 0 for p in saved["plots"])
    serve.print_report(report)
    printed = capsys.readouterr().out
    assert "| TTFT " in printed and "| goodput req/s |" in printed


def test_fixed_concurrency_with_impossible_slos_has_no_goodput(tiny_server):
    workload = serve.Workload(
        requests=4, concurrency=2, prompt_tokens=serve.Lengths(8, 8),
        output_tokens=serve.Lengths(3, 3), ttft_slo_ms=1e-6, tpot_slo_ms=1e-6,
    )
    report = serve.run(tiny_server, None, workload, progress=False)
    assert report["num_completed"] == 4 and report["goodput"] == 0
    assert report["output_tokens"] == 12


@contextlib.contextmanager
def scripted_server(bodies: list | None = None):
    """A server that answers request n (in arrival order) with 200 + a stream of 3 text
    chunks when n % 3 == 0, 429 when n % 3 == 1 and 500 when n % 3 == 2; each request's
    body is added to `bodies`."""
    arrivals = itertools.count()

    async def completions(request: web.Request) -> web.StreamResponse:
        n = next(arrivals)
        if bodies is not None:
            bodies.append(await request.json())
        if n % 3:
            status = 429 if n % 3 == 1 else 500
            return web.json_response({"error": {"message": "no"}}, status=status)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in [{"choices": [{"text": f" w{i}"}]} for i in range(3)] + [
            {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}}
        ]:
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.run_until_complete(runner.cleanup())
        loop.close()


def test_429s_and_errors_are_counted_apart():
    with scripted_server() as url:
        report = serve.run(url, "m", serve.Workload(requests=9, concurrency=2), progress=False)
    assert (report["num_completed"], report["num_429"], report["num_errors"]) == (3, 3, 3)
    assert report["output_tokens"] == 9 and report["prompt_tokens"] == 15
    assert next(iter(report["errors"])).startswith("HTTP 500")


def test_requests_are_greedy_unless_a_temperature_and_top_p_are_given():
    bodies = []
    with scripted_server(bodies) as url:
        serve.run(url, "m", serve.Workload(requests=2, concurrency=1), progress=False)
        serve.run(url, "m", serve.Workload(requests=2, concurrency=1, temperature=0.7,
                                           top_p=0.9), progress=False)
    assert [(b["temperature"], b.get("top_p")) for b in bodies] == [
        (0.0, None), (0.0, None), (0.7, 0.9), (0.7, 0.9)]


def test_refused_and_failed_requests_are_counted(tiny_server):
    bad = serve.run(tiny_server, "no-such-model", serve.Workload(requests=2), progress=False)
    assert bad["num_errors"] == 2 and bad["num_completed"] == 0
    assert next(iter(bad["errors"])).startswith("HTTP 4")
    gone = serve.run("http://127.0.0.1:9", "m", serve.Workload(requests=2), progress=False)
    assert gone["num_errors"] == gone["num_sent"] == 2


def _drawn(workload):
    return [{"max_tokens": m} for _, (_, m) in zip(range(workload.requests), workload.prompts())]
