"""bench/roofline.py at tiny scale writes a calibration that `jaxserve plan` accepts."""

import json
import subprocess
import sys

from hf_models import save_random_model
from serving import ROOT

from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.planner import kv_bytes_per_token


def test_tiny_roofline_calibrates_the_planner(tmp_path, smollm2_gguf):
    model = tmp_path / "model"
    save_random_model("llama-gqa-tied", model)
    Tokenizer.from_gguf(smollm2_gguf).save(model)
    out = tmp_path / "roofline.json"
    run = subprocess.run(
        [sys.executable, "bench/roofline.py", "--model", str(model), "--batches", "1,2",
         "--steps", "3", "--context", "32", "--prefill", "24", "--page-size", "8",
         "--bandwidth-mb", "16",
         "--matmul-n", "256", "--repeats", "2", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert "| batch | bucket | measured ms" in run.stdout
    data = json.loads(out.read_text())
    calibration = data["measured_over_roofline"]
    points = calibration["points"]
    assert [p["batch"] for p in points] == [1, 2]
    for p in points:
        assert p["measured_ms"] > 0 and p["roofline_ms"] > 0
        assert abs(p["ratio"] - p["measured_ms"] / p["roofline_ms"]) < 1e-9
        assert p["roofline_ms"] == max(p["memory_ms"], p["compute_ms"])
    assert calibration["median"] == (points[0]["ratio"] + points[1]["ratio"]) / 2
    assert data["machine"]["bandwidth_gbps"] > 0 and data["machine"]["matmul_tflops"] > 0
    prefill = data["prefill"]
    assert prefill["tokens"] == 24 and prefill["bucket"][0] >= 24 and prefill["measured_ms"] > 0
    assert abs(prefill["ratio"] - prefill["measured_ms"] / prefill["compute_ms"]) < 1e-9
    assert "prefill of 24 tokens" in run.stdout
    m = data["model"]  # the KV bytes are the engine's, in the dtype it serves
    assert data["kv_bytes_per_token"] == kv_bytes_per_token(
        m["num_layers"], m["num_kv_heads"], m["head_dim"], data["kv_dtype"])

    plan = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "plan", "--model", "smollm2-135m", "--chip", "h100",
         "--calibrate", str(out), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["efficiency"] == calibration["median"]
