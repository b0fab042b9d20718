"""bench/fairness.py: the loads' sizes, the summary and ratios, and a --quick run."""

import json
import sys

import pytest
from serving import ROOT

sys.path.insert(0, str(ROOT / "bench"))
import fairness
from serve import Outcome


def probe(ttft: float, gaps: list[float], status: str = "ok") -> Outcome:
    times, t = [], 10.0 + ttft
    for gap in [0.0, *gaps]:
        t += gap
        times.append(t)
    return Outcome(10.0, 16, len(times), status=status, ttft=ttft, chunk_times=times,
                   error=None if status == "ok" else "HTTP 500: x")


def test_the_flood_holds_its_rows_and_its_share_of_the_queue_and_the_equal_load_its_rows():
    # 8 rows, 1 reserved: 7 rows; a queue of 16 keeps 2 places for others: 14
    assert fairness.load_in_flight(8, 1, 16) == {"flood": 21, "equal": 7}
    assert fairness.load_in_flight(64, 8, 100) == {"flood": 56 + 88, "equal": 56}


def test_summary_pools_every_probe_and_skips_the_failed():
    outcomes = [probe(0.010, [0.002, 0.004]), probe(0.030, [0.006]), probe(9.0, [], "error")]
    summary = fairness.summarize_condition(outcomes, [(7, 14), (7, 13), (6, 14)])
    assert summary["num_probes"] == 3 and summary["num_ok"] == 2
    assert summary["errors"] == ["HTTP 500: x"]
    assert summary["ttft_ms"]["p50"] == pytest.approx(20.0)
    assert summary["itl_ms"]["p50"] == pytest.approx(4.0)  # of 2, 4 and 6 ms
    assert (summary["load_rows_p50"], summary["load_queued_p50"]) == (7, 14)
    alone = fairness.summarize_condition([probe(0.010, [0.002])], [])
    assert alone["load_rows_p50"] is None


def conditions(**ttft_p50: float) -> dict:
    def one(ttft: float) -> dict:
        return {"ttft_ms": {"p50": ttft, "p95": 2 * ttft}, "itl_ms": {"p50": 5.0, "p95": 10.0},
                "num_ok": 10, "num_probes": 10, "load_rows_p50": None, "load_queued_p50": None}
    return {name: one(value) for name, value in ttft_p50.items()}


def test_ratios_are_beside_the_flood_over_alone_and_over_the_equal_load():
    ratios = fairness.ratios(conditions(alone=10.0, flood=30.0, equal=20.0))
    assert ratios["flood_over_alone"] == {
        "ttft_ms_p50": 3.0, "ttft_ms_p95": 3.0, "itl_ms_p50": 1.0, "itl_ms_p95": 1.0
    }
    assert ratios["flood_over_equal"]["ttft_ms_p50"] == pytest.approx(1.5)
    assert fairness.ratios(conditions(alone=0.0, flood=3.0, equal=1.0))["flood_over_alone"][
        "ttft_ms_p50"] is None  # nothing to divide by


def test_the_tables_carry_each_condition_and_each_ratio():
    report = {"conditions": conditions(alone=10.0, flood=30.0, equal=20.0)}
    report["ratios"] = fairness.ratios(report["conditions"])
    text = fairness.tables(report)
    assert "| flood         | 10/10     | 30.0" in text
    assert "| beside flood ÷ alone        | 3.00" in text
    assert "| beside flood ÷ beside equal | 1.50" in text


@pytest.mark.slow  # starts a server and two loads: ~15 s with a warm compilation cache
def test_a_quick_run_against_the_tiny_model(tmp_path, tiny_model):
    out = tmp_path / "fairness.json"
    fairness.main(["--quick", "--model", str(tiny_model), "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["command"] == f"bench/fairness.py --quick --model {tiny_model} --out {out}"
    assert report["machine"]["cores"] >= 1 and "model" in report["machine"]
    for name, c in report["conditions"].items():
        assert c["num_ok"] == c["num_probes"] == 3, (name, c["errors"])
        assert c["ttft_ms"]["p50"] > 0 and c["itl_ms"]["p50"] > 0
        assert len(report["probes"][name]["ttft_ms"]) == 3
    flood, equal = report["conditions"]["flood"], report["conditions"]["equal"]
    assert flood["load_rows_p50"] == equal["load_rows_p50"] == 7  # every row A may hold
    assert flood["load_queued_p50"] > 0 and equal["load_queued_p50"] == 0
    assert set(report["ratios"]) == {"flood_over_alone", "flood_over_equal"}
    assert out.with_suffix(".png").stat().st_size > 0
    assert "| beside flood ÷ beside equal |" in out.with_suffix(".md").read_text()
