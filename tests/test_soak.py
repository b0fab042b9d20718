"""bench/soak.py: its pure parts (slope, windows, thirds, outcomes), and a 5-minute soak
of a live server on the tiny model (slow) that must pass every acceptance check."""

import json
import subprocess
import sys

import pytest
from serving import ROOT, running_server

sys.path.insert(0, str(ROOT / "bench"))
import soak
from soak import Event, Mix, QuietPoint, Sample

FLAGS = ["--max-batch", "8", "--token-budget", "64", "--num-pages", "512", "--max-model-len",
         "512", "--max-queue", "16"]


def test_slope_is_per_minute_and_needs_two_times():
    assert soak.slope_per_minute([(0, 100.0), (30, 100.5), (60, 101.0)]) == pytest.approx(1.0)
    assert soak.slope_per_minute([(t, 7.0) for t in range(10)]) == pytest.approx(0.0)
    assert soak.slope_per_minute([(5, 1.0)]) is None
    assert soak.slope_per_minute([(5, 1.0), (5, 2.0)]) is None


def test_the_trend_is_the_median_slope_between_points():
    steady = [(60, 600.0), (120, 600.5), (180, 601.0), (240, 601.5), (300, 602.0)]
    assert soak.trend_per_minute(steady) == pytest.approx(0.5)
    # one point held high (at the first quiet point) barely moves it; least squares: -2.6
    held = [(60, 614.0), *steady[1:]]
    assert soak.trend_per_minute(held) == pytest.approx(0.5)
    assert soak.slope_per_minute(held) < -2
    # a steady leak is read as itself, whatever one point does
    leak = [(t, 600.0 + 2 * (t - 60) / 60) for t, _ in steady]
    assert soak.trend_per_minute(leak) == pytest.approx(2.0)
    assert soak.trend_per_minute([leak[0], (120, 590.0), *leak[2:]]) > 1.9
    assert soak.trend_per_minute([(5, 1.0)]) is None


def test_windows_split_events_and_samples_by_time():
    events = [Event(1, "normal", 200, ttft=0.1), Event(2, "normal", 429),
              Event(11, "bad", 400), Event(12, "burst", 503), Event(25, "normal", 200, ttft=0.3)]
    samples = [Sample(0, 100.0, 20, 9, 0), Sample(5, 101.0, 30, 9, 12),
               Sample(15, 102.0, 25, 10, 4)]
    rows = soak.windows(events, samples, 10, 25)
    assert [(r["start_s"], r["end_s"]) for r in rows] == [(0, 10), (10, 20), (20, 25)]
    assert [(r["sent"], r["ok"], r["429"], r["4xx"], r["5xx"]) for r in rows] == [
        (2, 1, 1, 0, 0), (2, 0, 0, 1, 1), (0, 0, 0, 0, 0)]  # the last event is past the end
    assert rows[0]["ttft_p99_ms"] == pytest.approx(100)
    assert (rows[0]["rss_mib"], rows[0]["fds"], rows[0]["pages_used"]) == (101.0, 30, 12)
    assert rows[2]["rss_mib"] is None and rows[2]["ttft_p99_ms"] is None


def test_ttft_thirds_leave_out_the_warmup_the_middle_and_the_bursts():
    events = [Event(t, "probe", 200, ttft=ms / 1e3) for t, ms in
              [(5, 900), (11, 100), (19, 100), (25, 500), (35, 120), (39, 130)]]
    events.append(Event(12, "normal", 200, ttft=0.7))  # not the probe's: left out
    assert soak.ttft_thirds(events, 10, 40) == (pytest.approx(100), pytest.approx(129.9))
    # a burst sent at 36 s and answered by 37.5 s: the probe sent at 37 s waited behind it
    bursts = [Event(36 + i / 100, "burst", 200, end=37.5) for i in range(3)]
    late_probe = Event(37, "probe", 200, ttft=0.9)
    assert soak.ttft_thirds([*events, *bursts, late_probe], 10, 40) == (
        pytest.approx(100), pytest.approx(129.9))
    assert soak.ttft_thirds([*events, late_probe], 10, 40)[1] > 800  # counted without it


def test_burst_spans_run_from_the_first_send_to_the_last_answer():
    events = [Event(30.0, "burst", 429, end=30.1), Event(30.2, "burst", 200, end=31.5),
              Event(30.3, "normal", 200, end=30.4), Event(60.1, "burst", 200, end=None)]
    assert soak.burst_spans(events) == [(30.0, 31.5), (60.1, 60.1)]


def test_which_outcomes_are_unexpected():
    assert not Event(0, "normal", 429).unexpected and not Event(0, "probe", 429).unexpected
    assert Event(0, "probe", 500).unexpected
    assert Event(0, "normal", 200, error="ClientPayloadError: cut").unexpected
    assert Event(0, "normal", 200, error="stream error: {}").is_5xx
    assert not Event(0, "bad", 404).unexpected
    assert Event(0, "bad", 200).unexpected  # a bad input accepted
    assert Event(0, "bad", 500).unexpected
    assert not Event(0, "slow", 200, error="ConnectionResetError").unexpected  # cut: fine
    assert Event(0, "disconnect", None, error="ClientConnectorError").unexpected


def test_the_rss_floor_ignores_swings_but_not_growth():
    # a burst every 10 s lifts RSS by 30 MiB for a few seconds, less each time late on
    swinging = [Sample(t, 100.0 + (30 - t / 4 if t % 10 < 3 else 0), 20, 9) for t in range(60)]
    floors = soak.rss_floors(swinging, 10, 60, 10)
    assert floors == [(15.0, 100.0), (25.0, 100.0), (35.0, 100.0), (45.0, 100.0),
                      (55.0, 100.0)]
    assert soak.slope_per_minute(floors) == pytest.approx(0.0)
    assert soak.slope_per_minute([(s.t, s.rss_mib) for s in swinging if s.t >= 10]) < -1
    leaking = [Sample(s.t, s.rss_mib + s.t / 30, 20, 9) for s in swinging]  # 2 MiB/min
    assert soak.slope_per_minute(soak.rss_floors(leaking, 10, 60, 10)) == pytest.approx(2.0)


def quiet_points(mib_per_min: float) -> list[QuietPoint]:
    return [QuietPoint(t, 100.0 + mib_per_min * t / 60, 90.0 + mib_per_min * t / 60, 1.0)
            for t in (10, 25, 40)]


def test_checks_pass_and_fail_on_their_limits():
    mix = Mix(duration_s=40, warmup_s=10, burst_every_s=10)
    steady = [Sample(t, 100.0 + t / 600, 20, 9) for t in range(0, 41, 2)]  # 0.1 MiB/min
    events = [Event(t, "probe", 200, ttft=0.1) for t in range(10, 40)]
    idle = Sample(0, 100.0, 20, 9)
    good = soak.checks(mix, events, steady, idle, Sample(45, 100.1, 20, 9), quiet_points(0.1))
    assert all(c["ok"] for c in good.values()), good
    growing = [Sample(t, 100.0 + t / 20, 20, 9) for t in range(0, 41, 2)]  # 3 MiB/min
    slow_late = [*events, *(Event(t, "probe", 200, ttft=0.5) for t in range(31, 40))]
    bad = soak.checks(mix, [*slow_late, Event(20, "burst", 500)], growing, idle,
                      Sample(45, 110.0, 23, 10), quiet_points(3.0))
    assert not any(c["ok"] for c in bad.values()), bad
    assert bad["rss"]["mib_per_min"] == pytest.approx(3.0)
    assert bad["rss"]["anon_mib_per_min"] == pytest.approx(3.0)


def test_ttft_growth_is_counted_in_steps_of_the_engine():
    mix = Mix(duration_s=40, warmup_s=10, burst_every_s=10)
    idle = final = Sample(0, 100.0, 20, 9)
    early = [Event(t, "probe", 200, ttft=0.1) for t in range(10, 20)]
    late = [Event(t, "probe", 200, ttft=0.13) for t in range(30, 40)]  # 1.3x

    def run(late_step_s: float, late_ttft_s: float = 0.13) -> dict:
        probes = [Event(e.t, "probe", 200, ttft=late_ttft_s) for e in late]
        # a step every 0.01 s; from 25 s on each takes `late_step_s` of device time
        samples, steps, device = [], 0.0, 0.0
        for t in range(0, 41):
            samples.append(Sample(t, 100.0, 20, 9, steps=steps, device_s=device))
            steps += 100
            device += 100 * (0.001 if t < 25 else late_step_s)
        return soak.checks(mix, [*early, *probes], samples, idle, final, quiet_points(0.0))["ttft"]

    slower_machine = run(0.0013)  # the steps slowed as much as the TTFT did
    assert slower_machine["ratio"] == pytest.approx(1.3)
    assert slower_machine["step_ms"] == [pytest.approx(1.0), pytest.approx(1.3)]
    assert slower_machine["growth"] == pytest.approx(1.0) and slower_machine["ok"]
    slower_server = run(0.001)  # the same steps, a slower answer around them
    assert slower_server["growth"] == pytest.approx(1.3) and not slower_server["ok"]
    # steps that sped up never count against the answer: a 1.3x TTFT still fails raw, and
    # a TTFT that shrank less than the steps did passes (a full suite on a Zen 4:
    # 0.73 against 0.60)
    faster_machine = run(0.0006)
    assert faster_machine["step_ratio"] == pytest.approx(0.6)
    assert faster_machine["growth"] == pytest.approx(1.3) and not faster_machine["ok"]
    faster_answers = run(0.0006, late_ttft_s=0.073)
    assert faster_answers["growth"] == pytest.approx(0.73) and faster_answers["ok"]
    # a burst's intervals are left out of the step time, as its probes are of the TTFT
    burst = [Event(t / 10, "burst", 200, end=t / 10 + 2) for t in range(350, 355)]
    with_burst = soak.checks(mix, [*early, *late, *burst], [
        Sample(t, 100.0, 20, 9, steps=100.0 * t, device_s=0.1 * t + (5.0 if t >= 36 else 0))
        for t in range(0, 41)], idle, final, quiet_points(0.0))["ttft"]
    assert with_burst["step_ms"] == [pytest.approx(1.0), pytest.approx(1.0)]


def test_the_rss_check_reads_the_quiet_points_not_the_load():
    mix = Mix(duration_s=40, warmup_s=10, burst_every_s=10)
    events = [Event(t, "probe", 200, ttft=0.1) for t in range(10, 40)]
    idle, final = Sample(0, 100.0, 20, 9), Sample(45, 100.0, 20, 9)
    # what requests hold lifts RSS late in the load, and is gone once they are
    held = [Sample(t, 100.0 + (12 if t >= 25 else 0), 20, 9) for t in range(0, 41, 2)]
    passed = soak.checks(mix, events, held, idle, final, quiet_points(0.0))["rss"]
    assert passed["ok"] and passed["floor_mib_per_min"] > 10
    # memory kept after the requests are gone fails, however flat the load's floor
    flat = [Sample(t, 100.0, 20, 9) for t in range(0, 41, 2)]
    kept = soak.checks(mix, events, flat, idle, final, quiet_points(2.0))["rss"]
    assert not kept["ok"] and kept["floor_mib_per_min"] == pytest.approx(0.0)
    assert kept["quiet_points"] == [(10, pytest.approx(100 + 1 / 3)), (25, pytest.approx(
        100 + 5 / 6)), (40, pytest.approx(100 + 4 / 3))]
    assert not soak.checks(mix, events, flat, idle, final, quiet_points(0.0)[:1])["rss"]["ok"]


# In the default run (slow; `-m soak` runs it alone). Two flakes kept it out until
# 2026-12-04 (NOTES.md): the RSS at the quiet points stepped by ~4 MiB once in a while and
# stayed (the free top of malloc's thread arena, which malloc_trim leaves; server/heap.py
# now releases it): one run in six over 1 MiB/min; and the probe's TTFT p99 followed how
# often it met the mix's 100 kB bad prompt, tokenized on the event loop with the GIL held
# (~50 ms; now off the loop, without the GIL): one run in three over 1.2x. In the four
# runs since: RSS flat to 0.1-0.5 MiB, TTFT late / early 0.89-1.01. On 2026-12-05 (a Zen 5
# VM) the raw TTFT ratio failed 5 runs of 7 (0.64-1.26) as the step time itself drifted
# between thirds (0.75-1.12x) with the machine: the check now counts TTFT in steps.
@pytest.mark.slow
@pytest.mark.soak
def test_five_minutes_of_mixed_load_leave_nothing_behind(tiny_model, tmp_path):
    with running_server(tiny_model, *FLAGS) as (url, proc):
        report = soak.run(url, proc.pid, Mix(duration_s=300), tmp_path / "soak.json",
                          command="tests/test_soak.py", progress=False, keep_events=True)
    print("\n" + soak.markdown(report))
    counts = report["counts"]
    for kind in ("normal 200", "probe 200", "bad 400", "bad 404", "disconnect 200", "slow 200",
                 "burst 429"):
        assert counts.get(kind), (kind, counts)  # every part of the mix ran
    assert all(c["ok"] for c in report["checks"].values()), report["checks"]
    saved = json.loads((tmp_path / "soak.json").read_text())
    assert saved["passed"] and saved["samples"] and saved["cpu"]["model"]
    assert (tmp_path / "soak.png").stat().st_size > 0 and (tmp_path / "soak.md").exists()


def test_resident_by_mapping_tells_a_thread_arena_from_the_main_heap():
    # a thread's first malloc gets an arena of its own (glibc), whose heap is 64 MiB-aligned
    script = """
import sys, threading
held = []
def fill():
    held.extend(bytearray(b"x" * (64 << 10)) for _ in range(160))  # 10 MiB under the mmap threshold
t = threading.Thread(target=fill)
t.start(); t.join()
print("ready", flush=True)
sys.stdin.read()
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        kinds = soak.resident_by_mapping(proc.pid)
    finally:
        proc.kill()
        proc.wait()
    assert kinds["arenas"] >= 9, kinds  # the 10 MiB the thread holds
    assert kinds["heap"] < 9 and kinds["files"] > 0, kinds
