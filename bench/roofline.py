"""Measured decode step time against the roofline, on this machine: the planner's calibration.

    .venv/bin/python bench/roofline.py [--model PATH] [--batches 1,2,4,8,16] [--context 512]
        [--prefill 256] [--steps 20] [--out bench/results/roofline.json]
    .venv/bin/python bench/roofline.py --model DIR --batches 1,2 --steps 3 --context 32 \
        --bandwidth-mb 16 --matmul-n 256        # tiny, for tests

1. The machine: memory bandwidth from a jitted read (a sum) and a jitted copy (x + 1, which
   reads and writes) of a large f32 array, and the matmul rate of the projections as
   served: jnp.dot of two n × n squares at the served dtype, or, where the engine
   multiplies on a bf16 CPU kernel (`--weight-dtype auto` on AVX512-BF16 and AMX CPUs),
   that kernel's rate on an n × n product; each the median of `--repeats` timed runs
   after a warm one. The roofline takes the faster of the two bandwidths: it is a bound,
   so the best the machine showed.
2. The roofline decode step at batch b, by jaxserve.planner's Roofline: max((weight bytes +
   b × KV bytes per sequence) ÷ bandwidth, 2 × params × b ÷ matmul rate), with the bytes
   the engine reads as it holds them (every parameter but an embedding table that a
   separate head leaves to lookups; the KV pool's bytes per token) and every sequence at
   `--context` tokens.
3. The measured step: the engine's ModelRunner runs b decode rows, each at position
   `--context` on KV pages of its own (host packing and the one device→host copy
   included, as in serving), in the bucket the scheduler would pick; compiled and run twice
   first, then the median of `--steps` timed steps.
4. The prefill of one `--prefill`-token prompt (one step, from position 0), against its
   compute roofline: 2 × the parameters a token multiplies (every one but the embedding
   table) per prompt token, the head once (only the last token is sampled), and causal
   attention's 4 × layers × heads × head_dim × T(T+1)/2, at the matmul rate; and the
   weights' read time, which it also needs.

The JSON is what `jaxserve plan --calibrate` reads (jaxserve/planner.py's docstring):
`measured_over_roofline.median` is the median over the batches of measured ÷ roofline.
"""

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import RESULTS, cpu_description, markdown_table, write_json
from steps import fabricated_step, release

from jaxserve import LLM
from jaxserve.cpu_kernels.linear import pack, packed_linear
from jaxserve.host.plan import StepPlan
from jaxserve.planner import ModelShape, Roofline


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `fn()` (run to completion) after one warm call."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_machine(bandwidth_mb: int, matmul_n: int, dtype: str, repeats: int,
                    llm: LLM | None = None) -> dict:
    """Read and copy bandwidth, and the rate of the projections: XLA's matmul at `dtype`,
    or, where `llm` multiplies on a bf16 CPU kernel, that kernel's."""
    read, copy, dot = jax.jit(jnp.sum), jax.jit(lambda v: v + 1), jax.jit(jnp.dot)
    x = jnp.ones(bandwidth_mb * 2**20 // 4, jnp.float32)
    read_s = median_seconds(lambda: read(x), repeats)
    copy_s = median_seconds(lambda: copy(x), repeats)
    key_a, key_b = jax.random.split(jax.random.key(0))
    a = jax.random.normal(key_a, (matmul_n, matmul_n), dtype)
    b = jax.random.normal(key_b, (matmul_n, matmul_n), dtype)
    matmul = dtype
    if llm is not None and llm.linear_backend != "xla":  # the kernel, as the engine calls it
        matmul = f"{llm.linear_backend} kernel, activations {llm.linear_activations}"
        passes = 1 if llm.linear_activations == "bf16" else 2
        packed = jnp.asarray(pack(np.asarray(b, np.float32)))
        dot = jax.jit(lambda a, w: packed_linear(a, w, None, llm.linear_backend, passes))
        a, b = a.astype(jnp.float32), packed
    dot_s = median_seconds(lambda: dot(a, b), repeats)
    read_bw, copy_bw = x.nbytes / read_s, 2 * x.nbytes / copy_s
    return {
        "device": str(jax.devices()[0]),
        "bandwidth_mb": bandwidth_mb,
        "read_bandwidth_gbps": read_bw / 1e9,
        "copy_bandwidth_gbps": copy_bw / 1e9,
        "bandwidth_gbps": max(read_bw, copy_bw) / 1e9,  # the roofline's
        "matmul_n": matmul_n,
        "matmul_dtype": matmul,
        "matmul_tflops": 2 * matmul_n**3 / dot_s / 1e12,
    }


def model_shape(llm: LLM) -> ModelShape:
    """The planner's view of the served model."""
    c = llm.config
    return ModelShape(
        str(llm.model_path), c.num_layers, c.hidden_size, c.intermediate_size, c.num_heads,
        c.num_kv_heads, c.head_dim, c.vocab_size, c.tie_word_embeddings, c.attention_bias,
    )


def step_seconds(llm: LLM, plan: StepPlan, untimed: int, steps: int) -> list[float]:
    """Seconds of each of `steps` runs of `plan` after `untimed` ones; its pages released."""
    try:
        for _ in range(untimed):
            llm.runner.execute(plan)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            llm.runner.execute(plan)
            times.append(time.perf_counter() - start)
    finally:
        release(llm.scheduler.allocators[0], plan)
    return times


def measure_decode(llm: LLM, batch: int, context: int, steps: int) -> dict:
    """Median and p95 seconds of one decode step of `batch` rows at position `context`."""
    scheduler = llm.scheduler
    bucket = scheduler.buckets.choose(batch, batch)
    out = fabricated_step(
        scheduler.allocators[0], bucket, batch, 1, context, scheduler.page_size,
        llm.config.vocab_size,
    )
    times = sorted(step_seconds(llm, out, 3, steps))  # compile, then two warm steps
    return {
        "bucket": list(bucket),
        "median_s": statistics.median(times),
        "p95_s": times[min(len(times) - 1, round(0.95 * (len(times) - 1)))],
    }


def measure_prefill(llm: LLM, tokens: int, steps: int) -> dict:
    """Median seconds of the step that prefills a whole `tokens`-token prompt in one row."""
    scheduler = llm.scheduler
    plan = fabricated_step(
        scheduler.allocators[0], scheduler.buckets.choose(tokens, 1), 1, tokens, tokens,
        scheduler.page_size, llm.config.vocab_size,
    )
    times = step_seconds(llm, plan, 2, steps)  # compile, then a warm step
    return {"bucket": list(plan.bucket), "median_s": statistics.median(times)}


def prefill_flops(shape: ModelShape, tokens: int) -> float:
    """What a prefill of `tokens` tokens multiplies (see the module docstring, 4.)."""
    head = shape.vocab_size * shape.hidden_size
    table = 0 if shape.tie_word_embeddings else head  # looked up, not multiplied
    per_token = 2 * (shape.num_params - head - table)
    attention = 4 * shape.num_layers * shape.num_heads * shape.head_dim * tokens * (tokens + 1) / 2
    return per_token * tokens + 2 * head + attention


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--batches", default="1,2,4,8,16", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=512, help="tokens each row attends over")
    parser.add_argument("--prefill", type=int, default=256,
                        help="tokens of the one-row prefill measured (0: none)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32", help="weights and KV, as served")
    parser.add_argument("--bandwidth-mb", type=int, default=512, help="array size for bandwidth")
    parser.add_argument("--matmul-n", type=int, default=2048, help="side of the matmul squares")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per machine figure")
    parser.add_argument("--out", type=Path, default=RESULTS / "roofline.json")
    args = parser.parse_args()
    batches = sorted({int(b) for b in args.batches.split(",")})
    if batches[0] < 1 or args.steps < 1 or args.prefill < 0:
        parser.error("batches and --steps must be >= 1, --prefill >= 0")

    pages_per_row = -(-max(args.context, args.prefill) // args.page_size)
    llm = LLM(
        args.model,
        max_batch=batches[-1],
        token_budget=max(batches[-1], args.prefill),
        page_size=args.page_size,
        num_pages=1 + batches[-1] * pages_per_row,
        max_model_len=pages_per_row * args.page_size,
        dtype=args.dtype,
    )
    machine = measure_machine(args.bandwidth_mb, args.matmul_n, args.dtype, args.repeats, llm)
    shape = model_shape(llm)
    kv_per_token = llm.kv_bytes_per_token
    state = llm.runner.state
    weight_bytes = llm.weight_bytes  # a separate (or packed) head: the table is looked up
    if "lm_head" in state:
        weight_bytes -= sum(x.nbytes for x in jax.tree.leaves(state["embed"]))
    roof = Roofline(
        weight_bytes=weight_bytes,
        kv_bytes_per_sequence=args.context * kv_per_token,
        flops_per_token=2 * shape.num_params,
        bandwidth=machine["bandwidth_gbps"] * 1e9,
        peak_flops=machine["matmul_tflops"] * 1e12,
    )
    points = []
    for b in batches:
        measured = measure_decode(llm, b, args.context, args.steps)
        points.append(
            {
                "batch": b,
                "bucket": measured["bucket"],
                "measured_ms": measured["median_s"] * 1e3,
                "measured_p95_ms": measured["p95_s"] * 1e3,
                "roofline_ms": roof.step_s(b) * 1e3,
                "memory_ms": roof.memory_s(b) * 1e3,
                "compute_ms": roof.compute_s(b) * 1e3,
                "ratio": measured["median_s"] / roof.step_s(b),
            }
        )
    median = statistics.median(p["ratio"] for p in points)
    prefill = None
    if args.prefill:
        measured = measure_prefill(llm, args.prefill, args.steps)
        compute_s = prefill_flops(shape, args.prefill) / roof.peak_flops
        prefill = {
            "tokens": args.prefill,
            "bucket": measured["bucket"],
            "measured_ms": measured["median_s"] * 1e3,
            "compute_ms": compute_s * 1e3,
            "memory_ms": roof.memory_s(0) * 1e3,
            "ratio": measured["median_s"] / compute_s,
        }

    print(
        f"{shape.name}: {shape.num_params / 1e6:.1f} M params, {args.dtype}, weights "
        f"{llm.weight_dtype} ({weight_bytes / 2**20:.1f} MiB read a step), KV {llm.kv_dtype} "
        f"({kv_per_token:,} B/token), context {args.context}; {machine['device']}: "
        f"{machine['bandwidth_gbps']:.1f} GB/s "
        f"(read {machine['read_bandwidth_gbps']:.1f}, copy {machine['copy_bandwidth_gbps']:.1f}),"
        f" {machine['matmul_tflops'] * 1e3:.1f} GFLOP/s matmul ({machine['matmul_dtype']})\n"
    )
    rows = [
        [p["batch"], "x".join(map(str, p["bucket"])), f"{p['measured_ms']:.2f}",
         f"{p['measured_p95_ms']:.2f}", f"{p['roofline_ms']:.3f}", f"{p['memory_ms']:.3f}",
         f"{p['compute_ms']:.3f}", f"{p['ratio']:.2f}"]
        for p in points
    ]
    print(markdown_table(
        ["batch", "bucket", "measured ms", "p95 ms", "roofline ms", "memory ms", "compute ms",
         "measured ÷ roofline"],
        rows,
    ))
    print(f"\nmedian measured ÷ roofline = {median:.2f}")
    if prefill is not None:
        print(f"\nprefill of {prefill['tokens']} tokens (bucket "
              f"{'x'.join(map(str, prefill['bucket']))}): {prefill['measured_ms']:.1f} ms, compute "
              f"roofline {prefill['compute_ms']:.1f} ms (weights read in "
              f"{prefill['memory_ms']:.1f} ms): measured ÷ compute roofline = "
              f"{prefill['ratio']:.2f}")
    write_json(
        args.out,
        {
            "measured_over_roofline": {"median": median, "points": points},
            "prefill": prefill,
            "model": dataclasses.asdict(shape),
            "num_params": shape.num_params,
            "dtype": args.dtype,
            "weight_dtype": llm.weight_dtype,
            "kv_dtype": llm.kv_dtype,
            "linear_backend": llm.linear_backend,
            "weight_bytes": roof.weight_bytes,
            "kv_bytes_per_token": kv_per_token,
            "kv_bytes_per_sequence": roof.kv_bytes_per_sequence,
            "context": args.context,
            "page_size": args.page_size,
            "steps": args.steps,
            "machine": machine,
            "cpu": cpu_description(),
        },
    )
    print(f"wrote {args.out}; use it as: jaxserve plan --model ... --calibrate {args.out}")


if __name__ == "__main__":
    main()
