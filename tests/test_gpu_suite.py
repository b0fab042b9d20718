"""bench/gpu_suite.sh: the dry run passes on CPU, a part past its limit is stopped and
recorded while the suite goes on, and the greedy comparison finds the first difference."""

import json
import os
import subprocess
import sys

import pytest
from serving import ROOT  # also puts bench/ on sys.path

pytestmark = pytest.mark.slow  # starts servers or multi-device processes

PARTS = ("env", "kernels", "engine", "serving", "quantized")


def run_suite(*args: str, timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(["bench/gpu_suite.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_dry_run_passes_every_part(tmp_path, smollm2_gguf):
    done = run_suite(str(tmp_path), "--dry-run", timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr + (tmp_path / "suite.log").read_text()
    for part in PARTS:
        data = json.loads((tmp_path / f"{part}.json").read_text())
        assert data["complete"] and data["part"] == part and data["markdown"]
    kernels = json.loads((tmp_path / "kernels.json").read_text())["results"]
    assert {r["section"] for r in kernels} == {"timing", "check"}
    assert all(r["ok"] for r in kernels)
    engine = json.loads((tmp_path / "engine.json").read_text())["results"]
    assert [r["tokens_per_row"] for r in engine].count(1) == len(engine) - 1  # one prefill
    assert all(r["step_ms"] > 0 and r["compile_s"] > 0 for r in engine)
    serving = json.loads((tmp_path / "serving.json").read_text())
    assert len(serving["greedy"]) == 5 and all(a["tokens"] for a in serving["greedy"])
    assert [r["completed"] for r in serving["results"]] == [r["sent"] for r in serving["results"]]
    quantized = json.loads((tmp_path / "quantized.json").read_text())["results"]
    assert [r["variant"] for r in quantized] == [
        v for v in ("bf16", "fp8 KV", "int8 weights", "fp8 weights") for _ in (1, 2)]
    assert all(r["step_ms"] > 0 for r in quantized)
    assert {r["kv_dtype"] for r in quantized} == {"f32", "fp8"}  # dry: f32 activations
    summary = (tmp_path / "summary.md").read_text()
    for part in PARTS:
        assert f"| {part} | ok |" in summary and f"## {part}: ok" in summary


def test_a_part_past_its_limit_is_stopped_and_the_suite_goes_on(tmp_path):
    done = run_suite(str(tmp_path), "--dry-run", "--parts", "engine,env",
                     "--limit", "engine=2", timeout=120)
    assert done.returncode == 1
    summary = (tmp_path / "summary.md").read_text()
    assert "| engine | timed out after 2 s |" in summary
    assert "| env | ok |" in summary  # run after the engine was stopped
    assert "The log's last lines" in summary


def test_bad_arguments_are_refused(tmp_path):
    for args in (["--parts", "kernels,gpu"], ["--limit", "kernels"], ["--limit", "nope=3"]):
        done = run_suite(str(tmp_path), "--dry-run", *args, timeout=60)
        assert done.returncode == 2 and "error" in done.stderr, args


def answer(tokens: list[str], logprobs: list[float], top: list[dict] | None = None) -> dict:
    return {"prompt": "p", "tokens": tokens, "token_logprobs": logprobs,
            "top_logprobs": top or [{t: lp} for t, lp in zip(tokens, logprobs)]}


def test_compare_reports_the_first_difference_and_the_margin_there():
    from gpu_serving import compare

    want = answer(["a", "b", "c"], [-0.1, -0.5, -0.2],
                  [{"a": -0.1}, {"b": -0.5, "x": -0.9}, {"c": -0.2}])
    same, differs = compare(
        [answer(["a", "b", "c"], [-0.1, -0.5, -0.25]), answer(["a", "x", "c"], [-0.12, -0.9, 0])],
        [want, want],
    )
    assert same["identical"] and same["first_difference"] is None
    assert abs(same["max_logprob_gap"] - 0.05) < 1e-9
    assert not differs["identical"] and differs["first_difference"] == 1
    assert abs(differs["max_logprob_gap"] - 0.02) < 1e-9  # over the tokens before it
    assert abs(differs["reference_margin"] - 0.4) < 1e-9
