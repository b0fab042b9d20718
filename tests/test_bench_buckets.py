"""bench/buckets.py at tiny scale: timed buckets, replayed tables, a recommendation."""

import json
import subprocess
import sys

from hf_models import save_random_model
from serving import ROOT

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.host.buckets import BucketTable

sys.path.insert(0, str(ROOT / "bench"))
import buckets


def test_geometric_sizes_end_at_the_limit():
    assert buckets.geometric(1, 16, 2.0) == (1, 2, 4, 8, 16)
    assert buckets.geometric(1, 10, 1.5) == (1, 2, 3, 5, 8, 10)
    assert buckets.geometric(1, 1, 4.0) == (1,)
    tables = buckets.candidate_tables(8, 48)
    assert all(t.max_tokens >= 48 and t.max_rows >= 8 for t in tables.values())


def test_replay_counts_padding_exactly():
    # Two 3-token prompts wanting 2 tokens each, arriving together, budget 8: step 1 runs
    # both prompts (6 tokens in bucket 8x2), step 2 decodes both (2 tokens in 2x2).
    trace = [buckets.TraceRequest(3, 2, 0), buckets.TraceRequest(3, 2, 0)]
    table = BucketTable((1, 2, 4, 8), (1, 2))
    result = buckets.replay(trace, table, max_batch=2, token_budget=8, page_size=4)
    assert result["bucket_uses"] == {"8x2": 1, "2x2": 1}
    assert (result["real_tokens"], result["padded_tokens"]) == (8, 10)
    assert result["token_waste"] == 2 / 8 and result["row_waste"] == 0


def test_tiny_bucket_sweep_reports_every_field(tmp_path, smollm2_gguf):
    model = tmp_path / "model"
    save_random_model("llama-gqa-tied", model)
    Tokenizer.from_gguf(smollm2_gguf).save(model)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(
        json.dumps({"prompt_tokens": p, "output_tokens": o}) + "\n"
        for p, o in [(5, 3), (17, 1), (2, 9), (30, 4), (8, 8), (1, 2)]
    ))
    out = tmp_path / "buckets.json"
    run = subprocess.run(
        [sys.executable, "bench/buckets.py", "--model", str(model), "--max-batch", "2",
         "--token-budget", "8", "--token-sizes", "2,8", "--seq-sizes", "1,2", "--context", "16",
         "--page-size", "8", "--steps", "3", "--trace", str(trace), "--compile-budget-s", "1e9",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "recommended:" in run.stdout
    data = json.loads(out.read_text())
    shapes = [(b["num_tokens"], b["num_seqs"]) for b in data["buckets"]]
    assert shapes == [(2, 1), (8, 1), (2, 2), (8, 2)]
    for b in data["buckets"]:
        assert b["compile_s"] >= 0 and 0 < b["step_ms_p50"] <= b["step_ms_p95"]
        assert b["tokens_per_s"] > 0
        assert b["memory"]["source"] in ("device", "rss") and b["memory"]["peak_bytes"] > 0
    assert data["trace"]["num_requests"] == 6 and data["trace"]["output_tokens"] == 27
    names = [t["name"] for t in data["tables"]]
    assert names == ["pow2", "pow1.5", "coarse", "fine", "custom"]
    for t in data["tables"]:
        assert t["padded_tokens"] >= t["real_tokens"] == data["tables"][0]["real_tokens"]
        assert t["token_waste"] >= 0 and t["compile_s"] > 0 and t["fits_budget"]
    best = min(data["tables"], key=lambda t: (t["token_waste"], t["num_buckets"]))
    assert data["recommended"] == best["name"]
    assert [p.rsplit("_", 1)[-1] for p in data["plots"]] == ["time.png", "waste.png"]


def test_a_custom_table_too_small_for_the_budget_is_refused_before_measuring():
    run = subprocess.run(
        [sys.executable, "bench/buckets.py", "--token-sizes", "1,16,128", "--seq-sizes", "1,16"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "pass --token-budget 128 and --max-batch 16" in run.stderr
    assert "bucket" not in run.stdout  # nothing was measured
