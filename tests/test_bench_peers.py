"""bench/peers.py: its command line, the transformers peer at tiny scale, the order of
the runs, the medians and the ratio table."""

import subprocess
import sys

from serving import ROOT, save_tiny_chat_model

sys.path.insert(0, str(ROOT / "bench"))
import peers
import serve


def test_help_lists_the_peers_and_quick_mode():
    run = subprocess.run([sys.executable, "bench/peers.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--quick" in run.stdout and "--peers" in run.stdout


def test_transformers_peer_runs_static_batches(tmp_path, smollm2_gguf):
    model = save_tiny_chat_model(tmp_path / "tiny", smollm2_gguf)
    workloads = {
        c: serve.Workload(requests=2 * c, concurrency=c, prompt_tokens=serve.Lengths(8, 12),
                          output_tokens=serve.Lengths(2, 5))
        for c in (1, 2)
    }
    levels = peers.run_transformers(model, workloads)
    for c, workload in workloads.items():
        report = levels[str(c)]
        drawn = [m for _, (_, m) in zip(range(workload.requests), workload.prompts())]
        assert report["num_sent"] == report["num_completed"] == 2 * c
        assert report["output_tokens"] == sum(drawn)
        assert report["output_tokens_per_s"] > 0 and report["ttft_ms"]["p50"] > 0
        assert report["tpot_ms"]["p50"] > 0


def test_ratios_are_jaxserve_over_each_peer():
    def level(tok_s: float, ms: float) -> dict:
        pcts = {"p50": ms, "p95": 2 * ms}
        return {"output_tokens_per_s": tok_s, "ttft_ms": pcts, "tpot_ms": pcts}

    results = {
        "jaxserve": {"status": "ok", "levels": {"4": level(200.0, 10.0)}},
        "llamacpp": {"status": "ok", "levels": {"4": level(100.0, 40.0)}},
        "transformers": {"status": "unavailable", "reason": "x"},
    }
    table, ratios = peers.ratio_rows(results, [4])
    assert table[0] == ["metric @ concurrency", "jaxserve", "llamacpp", "jaxserve ÷ llamacpp"]
    assert table[1] == ["output tok/s @ 4", "200.0", "100.0", "2.00"]
    assert ratios == {"llamacpp": {"4": {
        "output_tokens_per_s": 2.0, "ttft_ms_p50": 0.25, "ttft_ms_p95": 0.25,
        "tpot_ms_p50": 0.25, "tpot_ms_p95": 0.25,
    }}}


def test_speculative_runs_are_also_compared_with_each_other():
    def level(tok_s: float) -> dict:
        pcts = {"p50": 1.0, "p95": 2.0}
        return {"output_tokens_per_s": tok_s, "ttft_ms": pcts, "tpot_ms": pcts}

    results = {name: {"status": "ok", "levels": {"1": level(tok_s)}} for name, tok_s in
               [("jaxserve", 100.0), ("jaxserve-ngram", 300.0), ("vllm-ngram", 200.0)]}
    table, ratios = peers.ratio_rows(results, [1])
    assert table[0][-1] == "jaxserve-ngram ÷ vllm-ngram"
    assert table[1] == ["output tok/s @ 1", "100.0", "300.0", "200.0", "0.33", "0.50", "1.50"]
    assert ratios["jaxserve-ngram ÷ vllm-ngram"]["1"]["output_tokens_per_s"] == 1.5


def test_runs_go_forward_then_backward():
    assert list(peers._runs(["a", "b", "c"], 3)) == list("abccbaabc")
    assert list(peers._runs(["a", "b", "c"], 3, once={"b"})) == list("abcca" "ac")


def test_medians_are_per_workload_level_and_metric():
    def level(tok_s: float, ms: float) -> dict:
        return {"output_tokens_per_s": tok_s, "ttft_ms": {"p50": ms, "p95": 2 * ms},
                "tpot_ms": {"p50": ms / 10, "p95": ms / 5}}

    repeats = [{"short": {"4": level(t, ms)}} for t, ms in [(100, 30), (300, 10), (200, 50)]]
    assert peers.medians(repeats) == {"short": {"4": {
        "repeats": 3, "output_tokens_per_s": 200, "ttft_ms": {"p50": 30, "p95": 60},
        "tpot_ms": {"p50": 3, "p95": 6}}}}
