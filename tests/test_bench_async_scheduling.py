"""bench/async_scheduling.py at tiny scale: both modes run alternated, the same tokens,
and the engine's split of each step (host, device wait, device idle) reported."""

import json
import subprocess
import sys

from serving import ROOT


def test_tiny_async_scheduling_bench_compares_both_modes(tmp_path, tiny_model):
    out = tmp_path / "async.json"
    run = subprocess.run(
        [sys.executable, "bench/async_scheduling.py", "--model", str(tiny_model),
         "--requests", "6", "--max-tokens", "5", "--max-batch", "4", "--repeats", "2",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, run.stderr
    assert "| mode  | output tok/s" in run.stdout and "greedy tokens the same: True" in run.stdout
    data = json.loads(out.read_text())
    assert data["same_tokens"] and len(data["pairs"]) == 2 and data["machine"]
    for mode in ("sync", "async"):
        runs = data["runs"][mode]
        assert len(runs) == 2
        for r in runs:
            assert r["output_tokens_per_s"] > 0 and r["steps"] > 0
            assert 0 <= r["device_idle_s"] <= r["host_s"] + r["device_wait_s"]
    # planned after reading, the device waits through every host second
    sync = data["runs"]["sync"][0]
    assert abs(sync["device_idle_s"] - sync["host_s"]) < 1e-9
    assert out.with_suffix(".png").exists()
