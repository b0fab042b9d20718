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


def test_conditions_pair_each_dtype_with_the_other_in_f32():
    assert quantization.conditions(["auto", "int8"], ["fp8"]) == {
        "auto": ("auto", "auto"), "int8": ("int8", "auto"), "kv-fp8": ("auto", "fp8")}


def test_agreement_counts_tokens_before_the_first_divergence():
    assert quantization.agreement(list("abcd"), list("abxd")) == 2
    assert quantization.agreement(list("abcd"), list("abcd")) == 4
    assert quantization.agreement(list("xbcd"), list("abcd")) == 0
    assert quantization.agreement(list("ab"), list("abcd")) == 2
