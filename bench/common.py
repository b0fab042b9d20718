"""Small pieces the bench scripts share: percentiles, tables, JSON, a progress bar, servers.

Standard library and numpy only, so bench/serve.py runs beside any server.
"""

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
# the prompts every model and dtype is checked on: greedy tokens against transformers
# (tests/test_smollm2_vs_transformers.py), quantized against f32 (bench/quantization.py)
REFERENCE_PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Les fleurs du printemps sont",
)


def summarize(values: Sequence[float], scale: float = 1.0) -> dict:
    """mean, p50, p95 and p99 of `values` × scale (None each when there are no values)."""
    if not len(values):
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    arr = np.asarray(values, dtype=float) * scale
    p50, p95, p99 = np.percentile(arr, [50, 95, 99])
    return {"mean": float(arr.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}


def fmt(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:,.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table; cells are str()-ed, columns padded to their widest cell."""
    def cell(c: object) -> str:
        return str(c).replace("|", "\\|")  # a bar inside a cell would end it

    cells = [[cell(c) for c in headers], *[[cell(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, allow_nan=False) + "\n")  # strict JSON


def pyplot():
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


class Progress:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, else a line
    every few seconds."""

    def __init__(self, enabled: bool = True, width: int = 30, every_s: float = 5.0):
        self.enabled = enabled
        self.width = width
        self.every_s = every_s
        self.tty = sys.stderr.isatty()
        self._last = 0.0

    def show(self, fraction: float, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if not (self.tty or final or now - self._last >= self.every_s):
            return
        self._last = now
        filled = round(min(1.0, max(0.0, fraction)) * self.width)
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {text}"
        if self.tty:
            print(f"\r{line}\x1b[K", end="\n" if final else "", file=sys.stderr, flush=True)
        else:
            print(line, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(
    cmd: Sequence[str], ready_url: str, log_path: Path, timeout_s: float = 900.0, **popen
) -> Iterator[subprocess.Popen]:
    """Start a server, wait until `ready_url` answers 200, yield the process, then stop it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, **popen)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if proc.poll() is not None:
                    tail = log_path.read_text()[-4000:]
                    raise RuntimeError(f"server exited at start-up; its log, {log_path}:\n{tail}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"server not ready after {timeout_s:g}s; log: {log_path}")
                try:
                    with urllib.request.urlopen(ready_url, timeout=2) as resp:
                        if resp.status == 200:
                            break
                except OSError:
                    time.sleep(0.5)
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


class PartReport:
    """A JSON report rewritten after every result, so that a process stopped at its time
    limit leaves what it had measured (the GPU suite's parts write theirs this way).

    `markdown(data)` renders the data as the part's section of the suite's summary; it is
    stored in the file beside the data, so the summary never needs the part's code.
    """

    def __init__(self, path: Path, markdown, **header) -> None:
        self.path = path
        self.markdown = markdown
        self.data = {**header, "results": [], "complete": False}
        self.write()

    def add(self, row: dict) -> None:
        self.data["results"].append(row)
        self.write()

    def update(self, **fields) -> None:
        self.data.update(fields)
        self.write()

    def write(self) -> None:
        self.data["markdown"] = self.markdown(self.data)
        write_json(self.path, self.data)


def cpu_description() -> dict:
    """lscpu's model name (with its family, model and stepping), caches and flags: every
    benchmark result records the CPU it ran on. A VM's model name can be as bare as "AMD
    EPYC", where only the family and model tell a Zen 4 (25, 17) from a Zen 5 (26, ...)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {"model": None, "caches": None, "flags": None}
    fields = {
        key.strip(): value.strip()
        for key, _, value in (line.partition(":") for line in text.splitlines())
    }
    model = fields.get("Model name")
    cpuid = [f"{key.lower()} {fields[key]}" for key in ("CPU family", "Model", "Stepping")
             if fields.get(key)]
    if model and cpuid:
        model = f"{model} ({', '.join(cpuid)})"
    caches = [f"{key.removesuffix(' cache')} {fields[key]}" for key in
              ("L1d cache", "L2 cache", "L3 cache") if fields.get(key)]
    return {"model": model, "caches": "; ".join(caches) or None, "flags": fields.get("Flags")}
