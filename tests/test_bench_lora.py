"""bench/lora.py: its random adapters load, and a tiny run compares the three conditions."""

import json
import subprocess
import sys

import pytest
from serving import ROOT

sys.path.insert(0, str(ROOT / "bench"))
from lora import write_adapter

from jaxserve.checkpoint.adapter import TARGETS, load_adapter
from jaxserve.checkpoint.weights import open_checkpoint


def test_a_random_adapter_covers_every_projection_and_loads(tiny_model, tmp_path):
    config = open_checkpoint(tiny_model).config
    write_adapter(tmp_path / "a", config, rank=4, seed=0)
    adapter = load_adapter("a", tmp_path / "a", config, max_rank=4)
    assert set(adapter.weights) == set(TARGETS) and adapter.scale == 1.0
    a, b = adapter.weights["gate_proj"]
    assert a.shape == (config.num_layers, config.hidden_size, 4)
    assert b.shape == (config.num_layers, 4, config.intermediate_size)
    assert 0.015 < a.std() < 0.025


@pytest.mark.slow
def test_tiny_run_reports_each_condition_and_the_ratio(tiny_model, tmp_path):
    out = tmp_path / "lora.json"
    run = subprocess.run(
        [sys.executable, "bench/lora.py", "--model", str(tiny_model), "--adapters", "2",
         "--rank", "4", "--concurrency", "2", "--requests", "4", "--repeats", "1",
         "--server-args", "--max-batch 2 --token-budget 8 --buckets 2,8:1,2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(out.read_text())
    for condition in ("base", "lora-base", "lora-mix"):
        [figures] = report["runs"][condition]
        assert figures["num_completed"] == 4 and figures["num_errors"] == 0, figures
    assert report["ratio_base_over_mix_tokens_per_s"] > 0
    header = run.stdout.split("| metric", 1)[1].split("\n", 1)[0]
    assert [c.strip() for c in header.split("|")[1:-1]] == [
        "base", "lora-base", "lora-mix", "base ÷ lora-mix"]
    assert out.with_suffix(".md").exists() and out.with_suffix(".png").stat().st_size > 0
