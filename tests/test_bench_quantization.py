"""bench/quantization.py: its command line and greedy agreement."""

import subprocess
import sys

from serving import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import quantization


def test_help_names_the_weight_dtypes():
    run = subprocess.run([sys.executable, "bench/quantization.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "--weight-dtypes" in run.stdout and "--kv-dtypes" in run.stdout


def test_conditions_pair_each_dtype_with_the_other_in_f32_and_kv_with_auto_too():
    assert quantization.conditions(["auto", "int8"], ["fp8"], kernel=False, int8=False) == {
        "f32": ("f32", "auto", "auto", "auto"), "auto": ("auto", "auto", "auto", "auto"),
        "int8": ("int8", "auto", "auto", "auto"), "kv-fp8": ("f32", "fp8", "auto", "auto"),
        "auto-kv-fp8": ("auto", "fp8", "auto", "auto")}
    assert "auto-kv-fp8" not in quantization.conditions(["int8"], ["fp8"], kernel=False,
                                                        int8=False)


def test_bf16_runs_through_xla_too_where_a_kernel_serves_it():
    conds = quantization.conditions(["bf16"], [], kernel=True, int8=False)
    assert conds == {"f32": ("f32", "auto", "auto", "auto"),
                     "bf16": ("bf16", "auto", "auto", "auto"),
                     "bf16-xla": ("bf16", "auto", "xla", "auto")}
    assert "bf16-xla" not in quantization.conditions(["bf16"], [], kernel=False, int8=False)


def test_auto_runs_with_int8_activations_too_where_the_cpu_has_them():
    conds = quantization.conditions(["auto"], [], kernel=True, int8=True)
    assert conds["auto-int8"] == ("auto", "auto", "auto", "int8")
    assert "auto-int8" not in quantization.conditions(["auto"], [], kernel=True, int8=False)


def test_agreement_counts_tokens_before_the_first_divergence():
    assert quantization.agreement(list("abcd"), list("abxd")) == 2
    assert quantization.agreement(list("abcd"), list("abcd")) == 4
    assert quantization.agreement(list("xbcd"), list("abcd")) == 0
    assert quantization.agreement(list("ab"), list("abcd")) == 2
