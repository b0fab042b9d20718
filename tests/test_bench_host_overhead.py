"""bench/host_overhead.py at tiny scale: every step is timed by the engine's own host/device
split, with a device that costs nothing."""

import json
import subprocess
import sys

from serving import ROOT


def test_tiny_host_overhead_reports_the_engines_host_time(tmp_path, smollm2_gguf):
    out = tmp_path / "host.json"
    run = subprocess.run(
        [sys.executable, "bench/host_overhead.py", "--model", str(smollm2_gguf), "--rows",
         "4,64", "--steps", "5", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "| rows | host ms p50" in run.stdout
    data = json.loads(out.read_text())
    assert [p["rows"] for p in data["points"]] == [4, 64]
    for p in data["points"]:
        assert p["steps"] == 5
        assert 0 < p["host_ms_p50"] <= p["host_ms_p95"]
        assert p["step_with_drain_ms"] >= p["host_ms_p50"] * 0.5
    assert data["points"][1]["target_ms"] == 1.0
    assert data["machine"]
