"""Check the Pallas attention kernels on a GPU at Llama-3-8B shapes, and time them.

    python bench/gpu_check.py [--bandwidth-gbps 4800] [--out bench/results/gpu_check.json]
    python bench/gpu_check.py --cpu-smoke    # tiny shapes, interpret=True, on CPU in seconds

One layer of a bf16 pool (32 query heads, 8 KV heads, head_dim 128, page_size 16), every
sequence on shuffled pages. For batch 8/64/256 and context 512/2k/8k it runs the decode
kernel (one query per sequence) and the ragged kernel on a mixed batch (batch // 16 prefill
chunks of 512 tokens at the end of their context, at least one, beside decodes).

Correctness: each kernel's output on a sample of tokens against the per-token reference of
`jaxserve.pallas_kernels.reference`, computed in f32 from the same bf16 pages (the dense
reference gathers each token's whole context: too big for every token at 8k), within a bf16
tolerance. Any mismatch makes the script exit 1.

Timing: host wall-clock around jitted calls and `jax.block_until_ready`, after warm-up
calls. Each sample dispatches a few calls back to back and waits for the last (dispatch is
asynchronous, so each launch overlaps the previous call's work) and is divided by its number
of calls; the table shows the median sample. A time includes the small jnp ops around each
kernel (q padding, the split merge) and, at tiny sizes, launch overhead. GB/s counts the K
and V bytes the batch must read once (sum of kv_lens x KV heads x head_dim x 2 bytes, for K
and for V) over that time. The ragged kernel reads a row's pages once per q-block, mostly
from L2, so its figure understates its traffic.
"""

import argparse
import functools
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels.paged_attention import paged_attention
from jaxserve.pallas_kernels.ragged_attention import ragged_paged_attention
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference

HEADER = (
    f"{'kernel':<8} {'batch':>5} {'context':>7} {'tokens':>6} {'splits':>6} "
    f"{'median_ms':>9} {'KV_GB':>7} {'GB/s':>7} {'%peak':>6} {'max_err':>8}  ok"
)
DEFAULT_OUT = Path(__file__).parent / "results" / "gpu_check.json"


@dataclass(frozen=True, slots=True)
class Setup:
    """Model shapes, kernel tiles and the sweep."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    pages_per_block: int
    block_q: int
    prefill_chunk: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    warmup: int
    iters: int  # timed samples
    calls_per_sample: int
    rtol: float  # the pool is bf16: q and the softmax weights are rounded to bf16 in the dots
    atol: float
    interpret: bool


LLAMA3_8B = Setup(
    num_heads=32, num_kv_heads=8, head_dim=128, page_size=16, pages_per_block=8, block_q=16,
    prefill_chunk=512, batches=(8, 64, 256), contexts=(512, 2048, 8192),
    warmup=3, iters=20, calls_per_sample=10, rtol=2e-2, atol=2e-2, interpret=False,
)
CPU_SMOKE = Setup(
    num_heads=6, num_kv_heads=2, head_dim=32, page_size=4, pages_per_block=2, block_q=4,
    prefill_chunk=8, batches=(3,), contexts=(13,),
    warmup=1, iters=2, calls_per_sample=1, rtol=2e-2, atol=2e-2, interpret=True,
)


@dataclass(frozen=True, slots=True)
class Batch:
    """One case's inputs, on the device, with the host copies the checks need."""

    q: jax.Array  # f32[num_tokens, num_heads, head_dim]
    cu_q_lens: np.ndarray  # i32[num_rows + 1]
    kv_lens: np.ndarray  # i32[num_rows]
    page_table: np.ndarray  # i32[num_rows, max_pages]
    sample: np.ndarray  # i32[num_sample] tokens whose output is checked


def num_kv_splits(setup: Setup, batch: int) -> int:
    """Enough programs to fill a big GPU at small batch (a shape rule, not a tuned one)."""
    return max(1, min(8, 1024 // (batch * setup.num_kv_heads)))


def make_batch(
    setup: Setup, rng: np.random.Generator, q_lens: list[int], context: int, num_pages: int
) -> Batch:
    """Rows with the given query lengths, each the last q_len tokens of `context`."""
    max_pages = -(-context // setup.page_size)
    num_rows = len(q_lens)
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int32))[: num_rows * max_pages]
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu_q_lens[-1])
    q = jax.random.normal(
        jax.random.key(int(rng.integers(1 << 31))),
        (num_tokens, setup.num_heads, setup.head_dim),
        jnp.float32,
    )
    # every row's first and last token, and a few more at random
    ends = np.concatenate([cu_q_lens[:-1], cu_q_lens[1:] - 1])
    extra = rng.choice(num_tokens, size=min(num_tokens, 16), replace=False)
    sample = np.unique(np.concatenate([ends, extra]))
    sample = rng.permutation(sample)[:48].astype(np.int32)
    return Batch(
        q=q,
        cu_q_lens=cu_q_lens,
        kv_lens=np.full(num_rows, context, np.int32),
        page_table=pages.reshape(num_rows, max_pages),
        sample=np.sort(sample),
    )


@functools.partial(jax.jit, static_argnames=("scale",))
def _reference_chunk(q, k_pages, v_pages, pages, positions, scale):
    """The f32 reference for a few tokens, on a compact copy of just their pages."""
    num_tokens, max_pages = pages.shape
    k = k_pages[:, pages].astype(jnp.float32)  # [kv_heads, tokens, max_pages, page, dim]
    v = v_pages[:, pages].astype(jnp.float32)
    k = k.reshape(k.shape[0], num_tokens * max_pages, *k.shape[3:])
    v = v.reshape(v.shape[0], num_tokens * max_pages, *v.shape[3:])
    table = jnp.arange(num_tokens * max_pages, dtype=jnp.int32).reshape(num_tokens, max_pages)
    seq_ids = jnp.arange(num_tokens, dtype=jnp.int32)
    return ragged_paged_attention_reference(q, k, v, seq_ids, positions, table, scale)


def check_sample(
    out: jax.Array, batch: Batch, k_pages: jax.Array, v_pages: jax.Array, setup: Setup,
    scale: float,
) -> tuple[float, bool]:
    """Max abs error and pass/fail of the sampled tokens' outputs against the reference."""
    chunk = 16
    # repeat the sample up to whole chunks, so the reference compiles once per shape
    tokens = np.resize(batch.sample, -(-len(batch.sample) // chunk) * chunk)
    rows = np.searchsorted(batch.cu_q_lens, tokens, side="right") - 1
    positions = (batch.kv_lens[rows] - (batch.cu_q_lens[rows + 1] - tokens)).astype(np.int32)
    got = np.asarray(out[tokens], np.float32)
    want = np.concatenate([
        np.asarray(
            _reference_chunk(
                batch.q[tokens[i : i + chunk]], k_pages, v_pages,
                jnp.asarray(batch.page_table[rows[i : i + chunk]]),
                jnp.asarray(positions[i : i + chunk]), scale,
            )
        )
        for i in range(0, len(tokens), chunk)
    ])
    err = np.abs(got - want)
    ok = bool(np.all(err <= setup.atol + setup.rtol * np.abs(want)))
    return float(err.max()), ok


def median_seconds(fn, setup: Setup) -> float:
    """Median seconds per call of `fn`, a jitted call with its arguments bound."""
    for _ in range(setup.warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(setup.iters):
        start = time.perf_counter()
        for _ in range(setup.calls_per_sample):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / setup.calls_per_sample)
    return statistics.median(samples)


def run_case(
    kind: str, batch_size: int, context: int, setup: Setup, k_pages: jax.Array,
    v_pages: jax.Array, rng: np.random.Generator, bandwidth_gbps: float,
) -> dict:
    scale = setup.head_dim**-0.5
    num_pages = k_pages.shape[1]
    if kind == "decode":
        batch = make_batch(setup, rng, [1] * batch_size, context, num_pages)
        splits = num_kv_splits(setup, batch_size)
        fn = functools.partial(
            paged_attention, batch.q, k_pages, v_pages, jnp.asarray(batch.kv_lens),
            jnp.asarray(batch.page_table), scale=scale, pages_per_block=setup.pages_per_block,
            num_kv_splits=splits, interpret=setup.interpret,
        )
    else:
        num_prefill = max(1, batch_size // 16)
        chunk = min(setup.prefill_chunk, context)
        q_lens = [chunk] * num_prefill + [1] * (batch_size - num_prefill)
        batch = make_batch(setup, rng, q_lens, context, num_pages)
        splits = 1
        fn = functools.partial(
            ragged_paged_attention, batch.q, k_pages, v_pages, jnp.asarray(batch.cu_q_lens),
            jnp.asarray(batch.kv_lens), jnp.asarray(batch.page_table), scale=scale,
            block_q=setup.block_q, pages_per_block=setup.pages_per_block,
            interpret=setup.interpret,
        )
    max_err, ok = check_sample(fn(), batch, k_pages, v_pages, setup, scale)
    seconds = median_seconds(fn, setup)
    kv_bytes = int(batch.kv_lens.sum()) * setup.num_kv_heads * setup.head_dim
    kv_bytes *= 2 * k_pages.dtype.itemsize
    gbps = kv_bytes / seconds / 1e9
    return {
        "kernel": kind, "batch": batch_size, "context": context,
        "tokens": int(batch.cu_q_lens[-1]), "splits": splits, "median_ms": seconds * 1e3,
        "kv_gb": kv_bytes / 1e9, "gbps": gbps, "peak_fraction": gbps / bandwidth_gbps,
        "max_err": max_err, "ok": ok,
    }


def format_row(r: dict) -> str:
    return (
        f"{r['kernel']:<8} {r['batch']:>5} {r['context']:>7} {r['tokens']:>6} {r['splits']:>6} "
        f"{r['median_ms']:>9.3f} {r['kv_gb']:>7.3f} {r['gbps']:>7.0f} "
        f"{100 * r['peak_fraction']:>5.1f}% {r['max_err']:>8.1e}  {'yes' if r['ok'] else 'NO'}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bandwidth-gbps", type=float, default=4800.0,
                        help="the chip's HBM bandwidth (H200: 4800)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"JSON results (default {DEFAULT_OUT}; none for --cpu-smoke)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="tiny shapes with interpret=True on CPU: the correctness part only")
    args = parser.parse_args()
    if args.cpu_smoke:
        jax.config.update("jax_platforms", "cpu")
    elif jax.default_backend() != "gpu":
        print(f"no GPU (backend {jax.default_backend()}): use --cpu-smoke", file=sys.stderr)
        return 2
    setup = CPU_SMOKE if args.cpu_smoke else LLAMA3_8B
    out_path = args.out if args.out or args.cpu_smoke else DEFAULT_OUT

    # one pool for every case, big enough for the largest batch at the longest context
    num_pages = max(setup.batches) * -(-max(setup.contexts) // setup.page_size) + 1
    shape = (setup.num_kv_heads, num_pages, setup.page_size, setup.head_dim)
    k_key, v_key = jax.random.split(jax.random.key(0))
    k_pages = jax.random.normal(k_key, shape, jnp.bfloat16)
    v_pages = jax.random.normal(v_key, shape, jnp.bfloat16)
    rng = np.random.default_rng(0)
    print(f"device {jax.devices()[0].device_kind}; pool {2 * k_pages.nbytes / 2**30:.2f} GiB "
          f"bf16; peak {args.bandwidth_gbps:.0f} GB/s; median of {setup.iters} samples of "
          f"{setup.calls_per_sample} calls")
    print(HEADER)
    results = []
    for kind in ("decode", "ragged"):
        for batch_size in setup.batches:
            for context in setup.contexts:
                r = run_case(kind, batch_size, context, setup, k_pages, v_pages, rng,
                             args.bandwidth_gbps)
                print(format_row(r), flush=True)
                results.append(r)

    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "device": jax.devices()[0].device_kind,
            "bandwidth_gbps": args.bandwidth_gbps,
            "timing": f"host wall-clock, after {setup.warmup} warm-up calls: median of "
            f"{setup.iters} samples, each {setup.calls_per_sample} jitted calls dispatched back "
            "to back and jax.block_until_ready on the last, divided by the calls",
            "setup": asdict(setup),
            "results": results,
        }
        out_path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out_path}")
    failed = [r for r in results if not r["ok"]]
    if failed:
        print(f"{len(failed)} case(s) outside tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
