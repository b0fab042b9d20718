"""The engine's host side alone: what a step costs when the device costs nothing.

    .venv/bin/python bench/host_overhead.py [--rows 16,64,256] [--steps 200]
        [--out bench/results/host_overhead.json]

On a GPU a small model's step is mostly host work (schedule, pack, unpack, post-process,
detokenize, emit), so that work must stay under a millisecond or two at the batch sizes a
GPU serves. Here the real Scheduler, page allocator, packer (`batch.pack_step`, the arrays
the device would take), StepOutput, detokenizer (SmolLM2's tokenizer) and output streams
run; only the model is replaced, by a runner that packs the plan and answers every row with
a fixed next token. Each of R requests (a 64-token prompt, outputs long enough never to
finish) is prefilled, then `--steps` decode steps of R rows are timed, the streams drained
as a server would. The host time of a step is the engine's own split (StepTime.host_seconds:
the step less the runner's device wait, zero here), so this measures what /metrics'
`jaxserve:step_host_seconds` reports while serving.
"""

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from common import RESULTS, cpu_description, markdown_table, write_json

from jaxserve.checkpoint.default_model import default_model_path
from jaxserve.checkpoint.tokenizer import Tokenizer
from jaxserve.config import SamplingParams
from jaxserve.device.batch import pack_step
from jaxserve.host.buckets import BucketTable
from jaxserve.host.engine import Engine
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.plan import StepPlan
from jaxserve.host.results import RESULT_WIDTH, PendingStep, StepOutput, StepTime
from jaxserve.host.scheduler import Scheduler

PAGE_SIZE = 16
PROMPT = 64
TARGET = {64: 1e-3, 256: 3e-3}  # the performance issue's bounds, seconds a step


class FreeRunner:
    """Packs each plan as the model runner does, then answers at once: every row's next
    token is a fixed ordinary word."""

    def __init__(self, token: int, max_pages: int):
        self.token = token
        self.max_pages = max_pages

    def launch(self, plan: StepPlan) -> PendingStep:
        num_tokens, num_rows = plan.bucket
        pack_step(plan.chunks, PAGE_SIZE, num_tokens, num_rows, self.max_pages, num_rows)
        results = np.zeros((len(plan.chunks), RESULT_WIDTH), np.float32)
        results[:, 0] = self.token
        samples = np.array([c.samples for c in plan.chunks], bool)
        output = StepOutput.unpack(results, samples)
        return PendingStep(lambda: output)


def measure(tokenizer: Tokenizer, rows: int, steps: int) -> dict:
    max_len = PROMPT + steps + 64
    pages_per_row = -(-max_len // PAGE_SIZE)
    scheduler = Scheduler(
        [PageAllocator(1 + rows * pages_per_row)], BucketTable.for_limits(rows, rows * PROMPT),
        PAGE_SIZE, rows, max_len, rows * PROMPT, prefix_caching=True, reserved_rows=0,
    )
    token = tokenizer.encode(" the", add_special_tokens=False)[0]
    engine = Engine(FreeRunner(token, pages_per_row), scheduler, tokenizer, (-1,), 1024)
    times: list[StepTime] = []
    engine.on_step = lambda plan, t: times.append(t)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    streams = [engine.submit([token] * (PROMPT - 1) + [i % 1000 + 100], params)
               for i in range(rows)]
    engine.step()  # the prefill
    assert len(scheduler.running) == rows, "every request runs"
    times.clear()
    wall = time.perf_counter()
    for _ in range(steps):
        engine.step()
        for stream in streams:  # drained as a server's pumps would
            while len(stream):
                stream.get(timeout=0)
    wall = (time.perf_counter() - wall) / steps
    host = sorted(t.host_seconds for t in times)
    return {
        "rows": rows,
        "steps": len(host),
        "host_ms_p50": statistics.median(host) * 1e3,
        "host_ms_p95": host[int(0.95 * (len(host) - 1))] * 1e3,
        "step_with_drain_ms": wall * 1e3,
        "target_ms": TARGET[rows] * 1e3 if rows in TARGET else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="16,64,256", help="comma-separated batch sizes")
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per size")
    parser.add_argument("--model", type=Path, help="the tokenizer's model (default SmolLM2)")
    parser.add_argument("--out", type=Path, default=RESULTS / "host_overhead.json")
    args = parser.parse_args()
    path = args.model or default_model_path()
    tokenizer = Tokenizer.from_gguf(path) if path.suffix == ".gguf" else Tokenizer.from_dir(path)
    points = []
    for rows in (int(r) for r in args.rows.split(",")):
        points.append(measure(tokenizer, rows, args.steps))
        p = points[-1]
        print(f"{rows} rows: host {p['host_ms_p50']:.3f} ms p50", flush=True)
    table = markdown_table(
        ["rows", "host ms p50", "host ms p95", "step + drain ms", "target ms"],
        [[p["rows"], f"{p['host_ms_p50']:.3f}", f"{p['host_ms_p95']:.3f}",
          f"{p['step_with_drain_ms']:.3f}", "-" if p["target_ms"] is None else p["target_ms"]]
         for p in points],
    )
    print("\n" + table)
    write_json(args.out, {"machine": cpu_description(), "points": points,
                          "command": "bench/host_overhead.py " + " ".join(
                              f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                              if v is not None and k != "out")})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
