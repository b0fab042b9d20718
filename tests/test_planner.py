"""The capacity planner reproduces DESIGN.md's worked example, through the API and the CLI."""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import planner
from jaxserve.cli import main

ROOT = Path(__file__).resolve().parents[1]
REQUIRED_KEYS = {
    "weight_bytes", "kv_bytes_per_token", "kv_bytes_per_sequence", "kv_pool_bytes",
    "max_sequences_by_kv", "roofline", "max_batch_by_tpot", "binding_bound", "queue_bound",
    "replicas_needed",
}
# Llama-3.1-70B, fp8 weights and KV, 8 × H100, 2,000-token context, 400 ms at 40/s.
EXAMPLE_FLAGS = [
    "--model", "llama-3.1-70b", "--weight-dtype", "fp8", "--kv-dtype", "fp8", "--chip", "H100",
    "--num-chips", "8", "--context", "2000", "--queue-budget-ms", "400", "--arrival-rate", "40",
]


def near(want: float, rel: float = 0.03):
    return pytest.approx(want, rel=rel)


def example(**overrides) -> planner.PlanInputs:
    fields = {
        "model": planner.MODELS["llama-3.1-70b"], "chip": planner.CHIPS["h100"], "num_chips": 8,
        "weight_dtype": "fp8", "kv_dtype": "fp8", "context": 2000, "queue_budget_ms": 400,
        "arrival_rate": 40,
    }
    return planner.PlanInputs(**{**fields, **overrides})


def cli_json(*flags: str) -> dict:
    """`jaxserve plan ... --json` run in this process (one subprocess test covers the entry)."""
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        assert main(["plan", *flags, "--json"]) == 0
    return json.loads(buffer.getvalue())


def check_worked_example(result: dict) -> None:
    """Every figure of the worked example, within 3 %, on the JSON form of a plan."""
    assert result["kv_bytes_per_token"] == 163_840
    assert result["kv_bytes_per_sequence"] == near(0.33e9)
    points = {p["batch"]: p for p in result["roofline"]}
    assert sorted(points) == [2**i for i in range(10)]
    for batch, step_ms, tokens_per_s in [(32, 3.0, 10_600), (128, 4.2, 30_000), (512, 8.9, 57_000)]:
        assert points[batch]["step_ms"] == near(step_ms)
        assert points[batch]["tokens_per_s"] == near(tokens_per_s)
    # 8.9 ms is the memory term at 512; the compute term (9.1 ms) is larger: past the ridge.
    assert points[512]["memory_ms"] == near(8.9, rel=0.005)
    assert points[512]["compute_ms"] == near(9.1)
    assert points[512]["compute_ms"] > points[512]["memory_ms"]
    assert points[256]["compute_ms"] < points[256]["memory_ms"]
    assert 256 < result["ridge_batch"] <= 512
    assert result["kv_free_bytes"] == near(530e9)
    assert result["kv_pool_bytes"] == near(505e9)
    assert result["max_sequences_by_kv"] == near(1_500)
    assert result["queue_bound"] == 16


def test_worked_example_through_the_api():
    result = planner.plan(example())
    assert result.num_params == 70_553_706_496
    assert result.weight_bytes == result.num_params  # fp8: one byte each
    # as the engine stores them: embeddings, head and norms stay bf16, and each projection
    # column has an f32 scale (the roofline keeps the example's every-byte-fp8 convention)
    vocab = 2 * 128_256 * 8192 + 80 * 2 * 8192 + 8192
    projections = result.num_params - vocab
    columns = 80 * (8192 + 2 * 1024 + 8192 + 2 * 28672 + 8192)
    assert result.stored_weight_bytes == projections + 4 * columns + 2 * vocab
    assert result.stored_weight_bytes == near(72.7e9, rel=0.001)
    check_worked_example(result.to_json())
    assert planner.queue_bound(0.400, 40) == 16

    long = planner.plan(example(context=32_768))
    assert long.kv_bytes_per_sequence == near(5.4e9)
    assert long.max_sequences_by_kv == near(93)


def test_worked_example_through_the_cli():
    out = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "plan", *EXAMPLE_FLAGS, "--json"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    result = json.loads(out)
    assert REQUIRED_KEYS <= result.keys()
    assert {"batch", "step_ms", "tokens_per_s", "compute_ms"} <= result["roofline"][0].keys()
    check_worked_example(result)
    assert result["binding_bound"] in ("tpot", "kv")
    assert result["replicas_needed"] >= 1
    assert result["efficiency"] == planner.DEFAULT_EFFICIENCY


def test_readable_report(capsys):
    assert main(["plan", *EXAMPLE_FLAGS]) == 0
    report = capsys.readouterr().out
    assert "163,840 B" in report and "1,534 sequences fit" in report
    assert "compute-bound from batch 471" in report and "queue bound 16" in report


def test_bf16_kv():
    result = planner.plan(example(weight_dtype="bf16", kv_dtype="bf16", context=8000))
    assert result.kv_bytes_per_token == 327_680 == 320 * 1024
    assert result.kv_bytes_per_sequence == near(2.6e9)
    assert result.weight_bytes == 2 * result.num_params


def test_w8a8_uses_the_fp8_rate():
    fp8 = planner.plan(example(compute_dtype="fp8")).roofline[-1]
    assert fp8["compute_ms"] == near(9.13 / 2, rel=0.01)  # 1,979 TFLOP/s dense
    assert fp8["step_ms"] == fp8["memory_ms"]  # so batch 512 is memory-bound again


def test_custom_chip():
    chip = planner.load_chip("custom", hbm_gb=100, hbm_tbps=2.0, tflops=500)
    model = planner.MODELS["llama-3.1-8b"]
    result = planner.plan(planner.PlanInputs(model=model, chip=chip, context=1000))
    params = 8_030_261_248
    assert result.num_params == params
    kv_per_sequence = 1000 * 2 * 32 * 8 * 128 * 2
    one = result.roofline[0]
    assert one["memory_ms"] == pytest.approx((2 * params + kv_per_sequence) / 2e12 * 1e3)
    assert one["compute_ms"] == pytest.approx(2 * params / 500e12 * 1e3)
    assert result.kv_pool_bytes == int(0.95 * (100e9 - 2 * params - 5e9))
    # the numbers given override a preset, and a custom chip needs all three
    assert planner.load_chip("H100", hbm_gb=94).bandwidth == 3.35e12
    with pytest.raises(ValueError, match="--hbm-gb"):
        planner.load_chip("custom", hbm_gb=100)
    out = cli_json(
        "--model", "llama-3.1-8b", "--chip", "custom", "--hbm-gb", "100", "--hbm-tbps", "2",
        "--tflops", "500", "--context", "1000",
    )
    assert out["kv_pool_bytes"] == result.kv_pool_bytes


SMOLLM2_CONFIG = {
    "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576,
    "intermediate_size": 1536, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 49152, "tie_word_embeddings": True,
}


def test_model_from_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    for spec in (tmp_path, tmp_path / "config.json"):
        model = planner.model_shape(str(spec))
        assert model.head_dim == 64  # hidden_size / num_attention_heads
        assert model.num_params == planner.MODELS["smollm2-135m"].num_params == 134_515_008
    out = cli_json("--model", str(tmp_path), "--chip", "v5e")
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 2
    assert out["weight_bytes"] == 2 * 134_515_008

    broken = {k: v for k, v in SMOLLM2_CONFIG.items() if k != "vocab_size"}
    (tmp_path / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="vocab_size"):
        planner.model_shape(str(tmp_path))
    with pytest.raises(ValueError, match=r"llama-3\.1-8b"):
        planner.model_shape(str(tmp_path / "nowhere"))


def test_model_from_a_gguf_file(smollm2_gguf):
    """The default model's own file: its metadata gives the shape of the preset."""
    model = planner.model_shape(str(smollm2_gguf))
    assert model.num_params == planner.MODELS["smollm2-135m"].num_params
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (30, 3, 64)
    out = cli_json("--model", str(smollm2_gguf), "--chip", "v5e", "--kv-dtype", "fp8")
    assert out["kv_bytes_per_token"] == 2 * 30 * 3 * 64


def test_binding_bound_flips_from_tpot_to_kv_as_the_context_grows():
    contexts = [1000, 2000, 4000, 8000, 16_000, 32_768, 65_536]
    bounds = [planner.plan(example(context=c, tpot_slo_ms=60)).binding_bound for c in contexts]
    assert bounds[0] == "tpot" and bounds[-1] == "kv"
    flip = bounds.index("kv")
    assert set(bounds[flip:]) == {"kv"}, bounds


def test_max_batch_by_tpot_is_the_largest_that_fits():
    result = planner.plan(example(tpot_slo_ms=30, efficiency=2.0))
    inputs = result.inputs
    roof = planner.Roofline(
        result.weight_bytes, result.kv_bytes_per_sequence, 2 * result.num_params,
        8 * inputs.chip.bandwidth, 8 * inputs.chip.peak_flops("bf16"),
    )
    b = result.max_batch_by_tpot
    assert 2.0 * roof.step_s(b) <= 0.030 < 2.0 * roof.step_s(b + 1)
    # a TPOT below the weight read alone leaves no batch at all
    nothing = planner.plan(example(tpot_slo_ms=1))
    assert nothing.max_batch_by_tpot == nothing.batch == 0 and nothing.replicas_needed is None


def test_queue_and_replicas():
    result = planner.plan(example(arrival_rate=None, queue_budget_ms=None, ttft_slo_ms=500))
    assert result.replicas_needed is None
    assert result.queue_budget_ms == pytest.approx(500 - result.prefill_ms)
    assert result.queue_bound == int(result.queue_budget_ms / 1e3 * result.service_rate)
    busy = planner.plan(example(arrival_rate=10 * result.service_rate))
    assert busy.replicas_needed == 10
    assert busy.queue_bound_per_replica == planner.queue_bound(0.4, result.service_rate)


def test_calibration_replaces_the_efficiency(tmp_path):
    path = tmp_path / "roofline.json"
    path.write_text(json.dumps({"measured_over_roofline": {"median": 1.8, "points": []}}))
    assert planner.efficiency_from_calibration(path) == 1.8
    out = cli_json(*EXAMPLE_FLAGS, "--efficiency", "3", "--calibrate", str(path))
    assert out["efficiency"] == 1.8
    path.write_text(json.dumps({"measured_over_roofline": 1.8}))
    with pytest.raises(ValueError, match="median"):
        planner.efficiency_from_calibration(path)


def test_bad_input_is_a_message_not_a_traceback(capsys):
    assert main(["plan", "--model", "llama-9", "--json"]) == 2
    assert "llama-3.1-70b" in capsys.readouterr().err


def test_planner_runs_without_jax():
    """planner.py itself imports no jax: load it by path with jax made unimportable."""
    path = str(ROOT / "jaxserve" / "planner.py")
    code = (
        "import sys, importlib.util\n"
        "sys.modules['jax'] = None\n"
        f"spec = importlib.util.spec_from_file_location('planner', {path!r})\n"
        "planner = importlib.util.module_from_spec(spec)\n"
        "sys.modules['planner'] = planner\n"
        "spec.loader.exec_module(planner)\n"
        "m = planner.MODELS['smollm2-135m']\n"
        "print(planner.plan(planner.PlanInputs(m, planner.CHIPS['v5e'])).kv_bytes_per_token)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(2 * 30 * 3 * 64 * 2)
