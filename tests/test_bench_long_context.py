"""bench/long_context.py's pure parts: the two deployments' gateway files and the summary."""

import sys
from types import SimpleNamespace

import pytest
from serving import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import long_context

from gateway import config


def test_both_deployments_are_valid_gateway_files():
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    split = config.parse(long_context.gateway_config("split", urls, "model.gguf"))
    assert [(p.name, p.replicas, p.max_prompt_tokens, p.min_prompt_tokens)
            for p in split.pools] == [("chat", (urls[0],), 2048, 0), ("long", (urls[1],), None,
                                                                     2049)]
    single = config.parse(long_context.gateway_config("single", urls, "model.gguf"))
    assert [(p.replicas, p.bounded) for p in single.pools] == [(tuple(urls), False)]


def test_the_summary_takes_medians_and_ratios_per_deployment():
    def run(ttft, itl):
        return {"ttft_p95_ms": ttft, "itl_p95_ms": itl, "ttft_p50_ms": 1, "itl_p50_ms": 1}

    results = {("split", False): [run(100, 10), run(300, 30), run(200, 20)],
               ("split", True): [run(220, 22)], ("single", False): [run(100, 10)],
               ("single", True): [run(1000, 50)]}
    args = SimpleNamespace(concurrency=4, long_tokens=2500, long_every_s=6, rounds=3, round_s=40)
    report = long_context.summarize(results, args, [0, 1])
    assert report["ratios"]["split"] == {"ttft_p95_ms": pytest.approx(1.1),
                                         "itl_p95_ms": pytest.approx(1.1)}
    assert report["ratios"]["single"]["ttft_p95_ms"] == pytest.approx(10)
    assert "split: with ÷ without" in report["markdown"]
