"""The GPU suite: the Pallas kernels, the engine at Llama-3-8B shapes and SmolLM2 served, in
one command, each part in its own time box.

    bench/gpu_suite.sh OUT [--dry-run | --reduced] [--parts env,kernels,engine,serving,quantized]
        [--limit PART=SECONDS ...]

(bench/gpu_suite.sh installs the wheels of .gpu-wheels/ when the machine lacks them,
reassembles the model carried there, and runs this with the repository on PYTHONPATH.)

The parts run in order of value, each in a process of its own, killed at its time limit:
env (bench/gpu_env.py), kernels (bench/gpu_kernels.py), engine (bench/gpu_engine.py),
serving (bench/gpu_serving.py), quantized (bench/gpu_quantized.py: int8 and fp8 weights and
an fp8 KV cache beside bf16). Each writes OUT/<part>.json as it goes, so a part stopped
at its limit still leaves what it measured; a part that fails or runs out of time is
recorded, and the suite goes on. OUT/summary.md holds every part's tables and status,
rewritten after each part; OUT/suite.log every part's output. The limits add up to 9.5
minutes; the parts took ~4.5 on an H200.

Profiles: the default measures an H200's shapes; `--reduced` runs smaller shapes on a CPU
(kernels in interpret mode) within the same limits, which shows the time boxes hold;
`--dry-run` runs tiny shapes in about a minute, for the test suite. Exit status: 0 when
every part completed and passed its checks, else 1.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# (part, script, seconds allowed): the order is the order of value
# (seconds as measured on an H200 on 2026-11-30: env 12, kernels ~150, engine 37, serving
# ~60 with three buckets; quantized not yet run there, its limit a guess: 4 builds and 8
# decode steps at the engine part's pace)
PARTS = (
    ("env", "gpu_env.py", 30),
    ("kernels", "gpu_kernels.py", 190),
    ("engine", "gpu_engine.py", 80),
    ("serving", "gpu_serving.py", 150),
    ("quantized", "gpu_quantized.py", 120),
)


def parse_limits(specs: list[str]) -> dict[str, float]:
    limits = {}
    for spec in specs:
        name, _, seconds = spec.partition("=")
        if name not in {p for p, _, _ in PARTS} or not seconds:
            raise ValueError(f"--limit takes PART=SECONDS with a part of the suite, got {spec!r}")
        limits[name] = float(seconds)
    return limits


def run_part(name: str, script: str, limit: float, profile: str, out: Path, log) -> dict:
    """Run one part under its limit; its status, seconds and (if any) what went wrong."""
    cmd = [sys.executable, str(BENCH / script), "--out", str(out / f"{name}.json"),
           "--profile", profile]
    log.write(f"\n===== {name}: {' '.join(cmd)} (limit {limit:g} s)\n")
    log.flush()
    start = time.perf_counter()
    # a process group of its own, so a timeout also stops what the part started (a server)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=BENCH.parent,
                            start_new_session=True)
    try:
        rc = proc.wait(timeout=limit)
        status = "ok" if rc == 0 else f"exit {rc}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
        status = f"timed out after {limit:g} s"
    seconds = time.perf_counter() - start
    log.write(f"===== {name}: {status} in {seconds:.1f} s\n")
    log.flush()
    return {"part": name, "status": status, "seconds": round(seconds, 1), "limit_s": limit}


def read_part(out: Path, name: str) -> dict | None:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def write_summary(out: Path, profile: str, runs: list[dict], started: float) -> None:
    sections = [
        f"# GPU suite ({profile} profile)\n",
        f"Ran {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, "
        f"{time.time() - started:.0f} s in all.\n",
        "| part | status | seconds | limit |\n|---|---|---|---|",
        *(f"| {r['part']} | {r['status']} | {r['seconds']} | {r['limit_s']:g} |" for r in runs),
    ]
    for r in runs:
        data = read_part(out, r["part"])
        sections.append(f"\n## {r['part']}: {r['status']}\n")
        if data is not None:
            if not data.get("complete"):
                sections.append("(incomplete: what the part wrote before it stopped)\n")
            sections.append(data.get("markdown", ""))
        if r["status"] != "ok":
            tail = log_tail(out / "suite.log")
            sections.append(f"\nThe log's last lines (suite.log):\n\n```\n{tail}\n```")
    (out / "summary.md").write_text("\n".join(sections) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="directory for the results")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, for tests")
    mode.add_argument("--reduced", action="store_true",
                      help="small shapes that a CPU runs within the same limits")
    parser.add_argument("--parts", default=",".join(p for p, _, _ in PARTS),
                        help="comma-separated, from: %(default)s")
    parser.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS",
                        help="override one part's time limit")
    args = parser.parse_args()
    profile = "dry" if args.dry_run else "reduced" if args.reduced else "gpu"
    try:
        limits = parse_limits(args.limit)
    except ValueError as err:
        parser.error(str(err))
    chosen = args.parts.split(",")
    unknown = set(chosen) - {p for p, _, _ in PARTS}
    if unknown:
        parser.error(f"unknown parts {sorted(unknown)}")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    runs = []
    with open(args.out / "suite.log", "a") as log:
        for name, script, limit in PARTS:
            if name not in chosen:
                continue
            run = run_part(name, script, limits.get(name, limit), profile, args.out, log)
            runs.append(run)
            print(f"{name}: {run['status']} in {run['seconds']} s", flush=True)
            write_summary(args.out, profile, runs, started)
    print(f"wrote {args.out / 'summary.md'}")
    return 0 if all(r["status"] == "ok" for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
