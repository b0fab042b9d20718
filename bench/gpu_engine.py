"""The GPU suite's engine part: jaxserve's own step on a Llama-3-8B-shaped model with random
bf16 weights, at decode batch 1/16/64/256 and a 2k-token prefill, against the roofline.

    python bench/gpu_engine.py --out OUT/engine.json [--profile gpu|reduced|dry]

The model is `LlamaForCausalLM` at Llama-3-8B's config (no download: random weights cost the
same to run), served by the engine's `ModelRunner` with the platform's attention backend
(the Pallas ragged kernel on a GPU) and a bucket table holding just the measured shapes.
Each case is a step made by `bench/steps.py` (rows on KV pages of their own, decodes at
position `context`), and for each:

- compile: seconds of XLA backend compiles during the bucket's first call (jax.monitoring),
  and that first call's wall time (trace + compile + run);
- step: the synchronous `ModelRunner.execute` (pack, transfer, run, fetch, unpack), median;
- device: the same inputs (`ModelRunner.pack`) dispatched back to back, per step (dispatch is
  asynchronous, so the host's share overlaps the previous step's device work);
- host: step − device, the time a step costs beyond the device's own (the performance
  issue's split of the host side, less schedule and post-process, which need no device);
- roofline (on a GPU): `jaxserve plan`'s decode step for an H200 (weights and every row's
  KV read once at 4.8 TB/s, or 2 × params × rows at 989.5 TFLOP/s, whichever is longer),
  and for the prefill max(weight read, 2 × params × tokens at the bf16 peak).
"""

import argparse
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from common import PartReport, fmt, markdown_table
from flax import nnx
from steps import fabricated_step, release

from jaxserve import planner
from jaxserve.config import ModelConfig, RopeScaling
from jaxserve.device.runner import ModelRunner
from jaxserve.host.buckets import BucketTable
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.models.llama import LlamaForCausalLM

LLAMA3_8B = ModelConfig(
    architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
    num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
    rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), max_position_embeddings=131072,
)


@dataclass(frozen=True, slots=True)
class Profile:
    model: ModelConfig
    dtype: str
    page_size: int
    context: int  # every decode row sits at this position
    decode_batches: tuple[int, ...]  # in the order measured (most telling first)
    prefill_tokens: int
    steps: int  # timed synchronous steps
    device_calls: int  # steps dispatched back to back per device sample


PROFILES = {
    "gpu": Profile(LLAMA3_8B, "bfloat16", 16, 2048, (16, 256, 1, 64), 2048, 10, 10),
    "reduced": Profile(
        ModelConfig("llama", 4096, 256, 768, 4, 8, 2, 32, max_position_embeddings=512),
        "float32", 16, 128, (4, 16, 1), 128, 5, 5,
    ),
    "dry": Profile(
        ModelConfig("llama", 256, 64, 128, 2, 4, 2, 16, max_position_embeddings=64),
        "float32", 4, 16, (2, 1), 16, 2, 2,
    ),
}


class CompileSeconds:
    """Seconds of XLA backend compiles in this process, from jax.monitoring's events."""

    def __init__(self) -> None:
        self.total = 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.total += duration


def roofline_plan(config: ModelConfig, context: int) -> planner.Plan:
    shape = planner.shape_of(config, "random")
    return planner.plan(planner.PlanInputs(shape, planner.load_chip("H200"), context=context))


def roofline_ms(plan: planner.Plan, rows: int, tokens_per_row: int) -> float:
    if tokens_per_row == 1:
        return next(p["step_ms"] for p in plan.roofline if p["batch"] == rows)
    chip = plan.inputs.chip
    compute = 2 * plan.num_params * rows * tokens_per_row / chip.peak_flops("bf16")
    return max(plan.weight_bytes / chip.bandwidth, compute) * 1e3


def measure(runner: ModelRunner, allocator: PageAllocator, compiles: CompileSeconds,
            profile: Profile, rows: int, tokens_per_row: int) -> dict:
    context = max(profile.context, tokens_per_row)
    bucket = (rows * tokens_per_row, rows)
    out = fabricated_step(allocator, bucket, rows, tokens_per_row, context,
                          profile.page_size, profile.model.vocab_size)
    try:
        before = compiles.total
        start = time.perf_counter()
        runner.execute(out)
        first_s = time.perf_counter() - start
        compile_s = compiles.total - before
        runner.execute(out)
        steps = []
        for _ in range(profile.steps):
            start = time.perf_counter()
            runner.execute(out)
            steps.append(time.perf_counter() - start)
        packs = []
        for _ in range(profile.steps):
            start = time.perf_counter()
            inputs = runner.pack(out)
            packs.append(time.perf_counter() - start)
        device = []
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(profile.device_calls):
                results = runner.dispatch_step(inputs, bucket)
            jax.block_until_ready(results)
            device.append((time.perf_counter() - start) / profile.device_calls)
    finally:
        release(allocator, out)
    step_s, device_s = statistics.median(steps), statistics.median(device)
    return {
        "bucket": list(bucket), "compile_s": compile_s, "first_call_s": first_s,
        "step_ms": step_s * 1e3, "step_p95_ms": float(np.percentile(steps, 95)) * 1e3,
        "device_ms": device_s * 1e3, "host_ms": (step_s - device_s) * 1e3,
        "pack_ms": statistics.median(packs) * 1e3,
        "tokens_per_s": rows * tokens_per_row / step_s,
    }


def markdown(data: dict) -> str:
    rows = sorted(data["results"], key=lambda r: (r["tokens_per_row"] > 1, r["rows"]))
    return (
        f"{data['model']} ({data['dtype']}, random weights), attention backend "
        f"{data.get('backend', '?')}, decode rows at context {data['context']}, on "
        f"{data['device']}; model built in {fmt(data.get('build_s'), 1)} s\n\n"
        + markdown_table(
            ["step", "bucket", "compile s", "step ms", "device ms", "host ms", "pack ms",
             "roofline ms", "step / roofline", "tokens/s"],
            [[("decode" if r["tokens_per_row"] == 1 else "prefill") + f" ×{r['rows']}"
              + ("" if r["tokens_per_row"] == 1 else f" ({r['tokens_per_row']} tokens)"),
              "x".join(map(str, r.get("bucket", []))), fmt(r.get("compile_s"), 1),
              fmt(r.get("step_ms"), 2), fmt(r.get("device_ms"), 2),
              fmt(r.get("host_ms"), 2), fmt(r.get("pack_ms"), 2),
              fmt(r.get("roofline_ms"), 2),
              fmt(r["step_ms"] / r["roofline_ms"], 2) if r.get("roofline_ms") else "n/a",
              fmt(r.get("tokens_per_s"), 0) if "error" not in r else r["error"]]
             for r in rows],
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", choices=tuple(PROFILES), default="gpu")
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    config = profile.model
    on_gpu = jax.default_backend() == "gpu"
    report = PartReport(
        args.out, markdown, part="engine", profile=args.profile,
        model="Llama-3-8B shape" if config == LLAMA3_8B else "a small Llama",
        config=asdict(config), dtype=profile.dtype, context=profile.context,
        device=jax.devices()[0].device_kind,
    )
    compiles = CompileSeconds()
    start = time.perf_counter()
    model = LlamaForCausalLM(config, nnx.Rngs(0), jnp.dtype(profile.dtype))
    jax.block_until_ready(nnx.state(model))
    report.update(build_s=time.perf_counter() - start)
    batches = profile.decode_batches
    token_sizes = sorted({*batches, profile.prefill_tokens})
    pages_per_row = -(-max(profile.context, profile.prefill_tokens) // profile.page_size)
    num_pages = (max(batches) + 1) * pages_per_row + 1
    runner = ModelRunner(
        model, BucketTable(tuple(token_sizes), tuple(sorted(batches))), num_pages,
        profile.page_size, pages_per_row * profile.page_size, max(batches),
        dtype=jnp.dtype(profile.dtype),
    )
    del model
    allocator = PageAllocator(num_pages)
    plan = roofline_plan(config, profile.context) if on_gpu else None
    report.update(
        backend=runner.backend, num_pages=num_pages,
        kv_cache_gb=2 * runner.kv_cache.k.nbytes / 1e9,
        weights_gb=sum(x.nbytes for x in jax.tree.leaves(runner.state)) / 1e9,
        roofline="jaxserve plan --model llama-3.1-8b --chip H200 (bf16 weights and KV)"
        if plan else None,
    )
    cases = [(b, 1) for b in batches] + [(1, profile.prefill_tokens)]
    cases.insert(2, cases.pop())  # the prefill third: the decodes most telling first
    for rows, tokens_per_row in cases:
        row = {"rows": rows, "tokens_per_row": tokens_per_row}
        try:
            row |= measure(runner, allocator, compiles, profile, rows, tokens_per_row)
        except Exception as err:  # noqa: BLE001  (recorded; the next case still runs)
            traceback.print_exc()
            row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
        if plan is not None and "error" not in row:
            row["roofline_ms"] = roofline_ms(plan, rows, tokens_per_row)
        report.add(row)
        print(row, flush=True)
    stats = jax.devices()[0].memory_stats() or {}
    report.update(peak_device_bytes=stats.get("peak_bytes_in_use"), complete=True)
    print(report.data["markdown"])
    return 1 if any("error" in r for r in report.data["results"]) else 0


if __name__ == "__main__":
    sys.exit(main())
