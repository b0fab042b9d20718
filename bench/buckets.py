"""Shape buckets: compile and time every bucket of a table, and weigh candidate tables.

    .venv/bin/python bench/buckets.py [--model PATH] [--max-batch 16] [--token-budget 256]
        [--table pow2] [--steps 20] [--trace FILE.jsonl] [--compile-budget-s 120]
        [--out bench/results/buckets.json]
    .venv/bin/python bench/buckets.py --model DIR --max-batch 2 --token-budget 8 --context 16 \
        --page-size 8 --steps 3 --trace-requests 20      # tiny, for tests

1. Measure: the engine's ModelRunner, built on `--table`'s buckets, runs each bucket
   (num_tokens, num_seqs) as num_seqs rows of num_tokens // num_seqs tokens ending at
   position `--context`, each row on KV pages of its own. Compile seconds = the first
   call's time less a step's (no persistent compilation cache: cold compiles); then one
   warm step and the median and p95 of `--steps` timed ones; tokens/s = bucket tokens ÷
   median step. Peak memory is the device's `peak_bytes_in_use` when jax reports it, else
   the process's peak RSS so far (on CPU `memory_stats()` is None).
2. Replay: a workload trace goes through the real Scheduler (page allocator, chunked prefill
   under `--token-budget`, bucket choice) with a fake runner that only advances tokens, once
   per candidate table. The trace is JSONL, one {"prompt_tokens", "output_tokens"} a line
   (an optional "arrival_step" each), or a synthetic one: log-normal lengths (median 128
   prompt, 64 output tokens) arriving as a Poisson process of `--arrival-rate` requests a
   step. The page pool is sized so that pages never bind: only the table differs.
   Token waste = (bucket tokens − real tokens) ÷ real tokens, summed over the steps; row
   waste likewise for rows.
3. Recommend: the candidate table with the least token waste whose estimated compile time
   fits `--compile-budget-s`. Compile seconds (and step times, for the estimated replay
   time) of buckets not measured come from a least-squares fit a + b·tokens + c·rows over
   the measured ones.

Candidate tables, all covering `--max-batch` rows and `--token-budget` tokens: pow2 (the
engine's default), pow1.5, coarse (×4) and fine (×1.25) geometric sizes.
"""

import argparse
import json
import math
import random
import resource
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import RESULTS, fmt, markdown_table, pyplot, write_json
from steps import fabricated_step, release

from jaxserve.checkpoint.default_model import default_model_path
from jaxserve.checkpoint.loader import load
from jaxserve.config import SamplingParams
from jaxserve.device.runner import ModelRunner
from jaxserve.host.buckets import BucketTable
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.host.request import Request
from jaxserve.host.scheduler import Scheduler


def geometric(low: int, high: int, ratio: float) -> tuple[int, ...]:
    """low, then each size ×ratio rounded up (at least +1), ending exactly at high."""
    sizes, n = [], low
    while n < high:
        sizes.append(n)
        n = max(n + 1, math.ceil(n * ratio))
    return (*sizes, high)


def candidate_tables(max_batch: int, token_budget: int) -> dict[str, BucketTable]:
    tables = {"pow2": BucketTable.for_limits(max_batch, token_budget)}
    for name, ratio in (("pow1.5", 1.5), ("coarse", 4.0), ("fine", 1.25)):
        tables[name] = BucketTable(
            geometric(1, token_budget, ratio), geometric(1, max_batch, ratio)
        )
    return tables


@dataclass(frozen=True, slots=True)
class TraceRequest:
    prompt_tokens: int
    output_tokens: int
    arrival_step: int


def synthetic_trace(n: int, arrival_rate: float, seed: int) -> list[TraceRequest]:
    """Log-normal prompt (median 128) and output (median 64) lengths, Poisson arrivals."""
    rng = random.Random(seed)
    t, trace = 0.0, []
    for _ in range(n):
        t += rng.expovariate(arrival_rate)
        prompt = min(2048, max(4, round(rng.lognormvariate(math.log(128), 0.8))))
        output = min(1024, max(1, round(rng.lognormvariate(math.log(64), 0.8))))
        trace.append(TraceRequest(prompt, output, int(t)))
    return trace


def read_trace(path: Path, arrival_rate: float, seed: int) -> list[TraceRequest]:
    """JSONL of {"prompt_tokens", "output_tokens"[, "arrival_step"]}; missing arrivals are
    drawn as a Poisson process of `arrival_rate` requests a step."""
    rng, t, trace = random.Random(seed), 0.0, []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            t += rng.expovariate(arrival_rate)
            request = TraceRequest(
                int(row["prompt_tokens"]), int(row["output_tokens"]),
                int(row.get("arrival_step", t)),
            )
            if request.prompt_tokens < 1 or request.output_tokens < 1:
                raise ValueError("prompt_tokens and output_tokens must be >= 1")
            trace.append(request)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{path}:{number}: {err!r}") from None
    if not trace:
        raise ValueError(f"{path}: no requests")
    return trace


def replay(
    trace: list[TraceRequest], table: BucketTable, max_batch: int, token_budget: int,
    page_size: int,
) -> dict:
    """Run the trace through the Scheduler with a runner that only advances tokens."""
    max_len = max(r.prompt_tokens + r.output_tokens for r in trace)
    pages_per_seq = -(-max_len // page_size)
    scheduler = Scheduler(
        [PageAllocator(1 + max_batch * pages_per_seq)], table, page_size, max_batch, max_len,
        token_budget, prefix_caching=False,
    )
    pending = sorted(enumerate(trace), key=lambda item: item[1].arrival_step, reverse=True)
    uses: Counter[tuple[int, int]] = Counter()
    real_tokens = real_rows = step = 0
    while pending or scheduler.running or scheduler.waiting:
        if not (scheduler.running or scheduler.waiting):
            step = max(step, pending[-1][1].arrival_step)  # idle: skip to the next arrival
        while pending and pending[-1][1].arrival_step <= step:
            i, r = pending.pop()
            prompt = tuple((i * 31 + j) % 30000 for j in range(r.prompt_tokens))
            params = SamplingParams(max_tokens=r.output_tokens, ignore_eos=True)
            scheduler.add(Request(f"r{i}", prompt, params, seed=i))
        out = scheduler.schedule()
        step += 1
        if not out.chunks:
            continue
        uses[out.bucket] += 1
        real_tokens += out.num_tokens
        real_rows += len(out.chunks)
        for chunk in out.chunks:  # what the engine's post-processing does, with token 1
            request = scheduler.running[chunk.request_id]
            if chunk.samples:
                request.append(1)
            scheduler.advance(request, chunk, int(chunk.samples))
            if request.finished:
                scheduler.finish(request.request_id)
    padded_tokens = sum(t * n for (t, _), n in uses.items())
    padded_rows = sum(s * n for (_, s), n in uses.items())
    return {
        "steps": sum(uses.values()),
        "real_tokens": real_tokens,
        "padded_tokens": padded_tokens,
        "token_waste": (padded_tokens - real_tokens) / real_tokens,
        "real_rows": real_rows,
        "padded_rows": padded_rows,
        "row_waste": (padded_rows - real_rows) / real_rows,
        "bucket_uses": {f"{t}x{s}": n for (t, s), n in sorted(uses.items())},
    }


def peak_memory() -> dict:
    """The device's peak bytes in use if jax reports them, else this process's peak RSS."""
    stats = jax.devices()[0].memory_stats()
    if stats and "peak_bytes_in_use" in stats:
        return {"source": "device", "peak_bytes": int(stats["peak_bytes_in_use"])}
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"source": "rss", "peak_bytes": rss_kib * 1024}


def measure(runner: ModelRunner, allocator: PageAllocator, context: int, steps: int,
            vocab_size: int) -> list[dict]:
    """Compile seconds, step median/p95 and peak memory of every bucket of the runner's table."""
    rows = []
    for num_tokens, num_seqs in runner.buckets.buckets():
        per_row = num_tokens // num_seqs
        out = fabricated_step(
            allocator, (num_tokens, num_seqs), num_seqs, per_row, max(context, per_row),
            runner.page_size, vocab_size,
        )
        try:
            start = time.perf_counter()
            runner.execute(out)
            first = time.perf_counter() - start
            runner.execute(out)
            times = []
            for _ in range(steps):
                start = time.perf_counter()
                runner.execute(out)
                times.append(time.perf_counter() - start)
        finally:
            release(allocator, out)
        median = statistics.median(times)
        rows.append({
            "num_tokens": num_tokens,
            "num_seqs": num_seqs,
            "compile_s": max(0.0, first - median),
            "step_ms_p50": median * 1e3,
            "step_ms_p95": float(np.percentile(times, 95)) * 1e3,
            "tokens_per_s": num_tokens / median,
            "memory": peak_memory(),
        })
    return rows


def linear_fit(points: list[tuple[int, int, float]]) -> Callable[[int, int], float]:
    """y ≈ a + b·tokens + c·rows by least squares (the mean when the points cannot fit it),
    never below the smallest measured y."""
    ys = np.array([y for _, _, y in points])
    design = np.array([[1.0, t, s] for t, s, _ in points])
    if np.linalg.matrix_rank(design) < 3:
        return lambda t, s: float(ys.mean())
    coef = np.linalg.lstsq(design, ys, rcond=None)[0]
    return lambda t, s: max(float(ys.min()), float(coef @ [1.0, t, s]))


def evaluate(tables: dict[str, BucketTable], measured_name: str, measured: list[dict],
             trace: list[TraceRequest], args: argparse.Namespace) -> list[dict]:
    """Each candidate table's replay waste, estimated compile seconds and replay time."""
    known = {(m["num_tokens"], m["num_seqs"]): m for m in measured}
    compile_fit = linear_fit([(t, s, m["compile_s"]) for (t, s), m in known.items()])
    step_fit = linear_fit([(t, s, m["step_ms_p50"] / 1e3) for (t, s), m in known.items()])
    results = []
    for name, table in tables.items():
        result = replay(trace, table, args.max_batch, args.token_budget, args.page_size)
        compile_s = sum(
            known[b]["compile_s"] if b in known else compile_fit(*b) for b in table.buckets()
        )
        replay_s = 0.0
        for key, n in result["bucket_uses"].items():
            t, s = map(int, key.split("x"))
            step_s = known[(t, s)]["step_ms_p50"] / 1e3 if (t, s) in known else step_fit(t, s)
            replay_s += n * step_s
        results.append({
            "name": name,
            "measured": name == measured_name,
            "token_sizes": list(table.token_sizes),
            "seq_sizes": list(table.row_sizes),
            "num_buckets": len(table.buckets()),
            "compile_s": compile_s,
            "replay_s": replay_s,
            "fits_budget": compile_s <= args.compile_budget_s,
            **result,
        })
    return results


def recommend(results: list[dict]) -> tuple[str, str]:
    """The least-waste table within the compile budget (ties: fewer buckets), and why."""
    fitting = [r for r in results if r["fits_budget"]]
    if not fitting:
        best = min(results, key=lambda r: r["compile_s"])
        return best["name"], "no table fits the compile budget: the quickest to compile"
    best = min(fitting, key=lambda r: (r["token_waste"], r["num_buckets"]))
    return best["name"], "the least token waste within the compile budget"


def plot(measured: list[dict], results: list[dict], out: Path) -> list[str]:
    plt = pyplot()
    if plt is None:
        return []
    from matplotlib.ticker import ScalarFormatter

    out.parent.mkdir(parents=True, exist_ok=True)
    fig, (by_tokens, by_rows) = plt.subplots(1, 2, figsize=(12, 4))
    panels = (("num_seqs", "num_tokens", by_tokens), ("num_tokens", "num_seqs", by_rows))
    words = {"num_tokens": "tokens", "num_seqs": "rows"}
    for key, other, ax in panels:
        for value in sorted({m[key] for m in measured}):
            line = sorted((m[other], m["step_ms_p50"]) for m in measured if m[key] == value)
            ax.plot(*zip(*line), marker="o", label=f"{words[key]} {value}")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.set(xlabel=f"{words[other]} in the bucket", ylabel="step ms (median)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("step time by bucket")
    fig.tight_layout()
    steps_png = out.with_name(out.stem + "_step_time.png")
    fig.savefig(steps_png, dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4))
    names = [r["name"] for r in results]
    x = np.arange(len(names))
    ax.bar(x - 0.2, [100 * r["token_waste"] for r in results], 0.4, label="token waste %")
    ax.bar(x + 0.2, [100 * r["row_waste"] for r in results], 0.4, label="row waste %")
    ax.set_xticks(x, [f"{r['name']}\n{r['num_buckets']} buckets" for r in results])
    ax.set(ylabel="padding ÷ real, %", title="padding waste of each table on the trace")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    waste_png = out.with_name(out.stem + "_waste.png")
    fig.savefig(waste_png, dpi=100)
    plt.close(fig)
    return [str(steps_png), str(waste_png)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--table", default="pow2", help="the table to measure: pow2, pow1.5, "
                        "coarse or fine; or --token-sizes and --seq-sizes")
    parser.add_argument("--token-sizes", help="comma-separated, with --seq-sizes: a custom table")
    parser.add_argument("--seq-sizes")
    parser.add_argument("--context", type=int, default=256, help="position the rows end at")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per bucket")
    parser.add_argument("--trace", type=Path, help="JSONL workload (default: synthetic)")
    parser.add_argument("--trace-requests", type=int, default=500, help="synthetic trace size")
    parser.add_argument("--arrival-rate", type=float, default=0.2, help="requests per step")
    parser.add_argument("--compile-budget-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "buckets.json")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args()

    tables = candidate_tables(args.max_batch, args.token_budget)
    if args.token_sizes or args.seq_sizes:
        if not (args.token_sizes and args.seq_sizes):
            parser.error("--token-sizes and --seq-sizes go together")
        args.table = "custom"
        tables["custom"] = BucketTable(
            tuple(sorted(int(v) for v in args.token_sizes.split(","))),
            tuple(sorted(int(v) for v in args.seq_sizes.split(","))),
        )
        try:  # checked before minutes of measuring, not after (the replay needs it)
            tables["custom"].covers(args.max_batch, args.token_budget)
        except ValueError as e:
            custom = tables["custom"]
            parser.error(f"{e}: pass --token-budget {custom.max_tokens} and --max-batch "
                         f"{custom.max_rows} (or at most those) with this table")
    if args.table not in tables:
        parser.error(f"--table must be one of {sorted(tables)}")
    table = tables[args.table]
    trace = (
        read_trace(args.trace, args.arrival_rate, args.seed)
        if args.trace
        else synthetic_trace(args.trace_requests, args.arrival_rate, args.seed)
    )

    model_path = args.model or default_model_path()
    module, _ = load(model_path, jnp.dtype(args.dtype))
    context = max(args.context, table.max_tokens)
    pages_per_row = -(-context // args.page_size)
    num_pages = 1 + table.max_rows * pages_per_row
    runner = ModelRunner(
        module, table, num_pages, args.page_size, pages_per_row * args.page_size,
        table.max_rows, dtype=jnp.dtype(args.dtype),
    )
    measured = measure(
        runner, PageAllocator(num_pages), args.context, args.steps, module.config.vocab_size
    )
    results = evaluate(tables, args.table, measured, trace, args)
    choice, why = recommend(results)

    print(f"{model_path}: table {args.table}, rows end at position {args.context}\n")
    print(markdown_table(
        ["tokens", "rows", "compile s", "step ms p50", "step ms p95", "tokens/s", "peak memory"],
        [[m["num_tokens"], m["num_seqs"], fmt(m["compile_s"], 2), fmt(m["step_ms_p50"], 2),
          fmt(m["step_ms_p95"], 2), fmt(m["tokens_per_s"], 0),
          f"{m['memory']['peak_bytes'] / 2**20:,.0f} MiB ({m['memory']['source']})"]
         for m in measured],
    ))
    print(f"\n{len(trace)} requests replayed; max batch {args.max_batch}, token budget "
          f"{args.token_budget}; compile budget {args.compile_budget_s:g} s\n")
    print(markdown_table(
        ["table", "token sizes", "row sizes", "buckets", "compile s", "token waste", "row waste",
         "replay s (est.)", "fits"],
        [[r["name"] + (" (measured)" if r["measured"] else ""),
          ",".join(map(str, r["token_sizes"])), ",".join(map(str, r["seq_sizes"])),
          r["num_buckets"], fmt(r["compile_s"], 1), f"{r['token_waste']:.1%}",
          f"{r['row_waste']:.1%}", fmt(r["replay_s"], 2), "yes" if r["fits_budget"] else "no"]
         for r in results],
    ))
    print(f"\nrecommended: {choice} ({why})")
    report = {
        "model": str(model_path),
        "dtype": args.dtype,
        "max_batch": args.max_batch,
        "token_budget": args.token_budget,
        "context": args.context,
        "page_size": args.page_size,
        "steps": args.steps,
        "measured_table": args.table,
        "buckets": measured,
        "trace": {
            "source": str(args.trace) if args.trace else "synthetic",
            "num_requests": len(trace),
            "prompt_tokens": sum(r.prompt_tokens for r in trace),
            "output_tokens": sum(r.output_tokens for r in trace),
        },
        "compile_budget_s": args.compile_budget_s,
        "tables": results,
        "recommended": choice,
        "recommended_because": why,
        "plots": [] if args.no_plots else plot(measured, results, args.out),
    }
    write_json(args.out, report)
    print(f"wrote {args.out}" + "".join(f", {p}" for p in report["plots"]))


if __name__ == "__main__":
    main()
