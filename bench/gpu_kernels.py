"""The GPU suite's kernel part: the Pallas attention kernels against the jnp reference, and
timed at Llama-3-8B shapes against the HBM roofline.

    python bench/gpu_kernels.py --out OUT/kernels.json [--profile gpu|reduced|dry]
        [--bandwidth-gbps 4800]

In order (each case is checked as it runs, and written to the report at once):

1. Timing, at Llama-3-8B shapes (bf16 pool, 32 query heads, 8 KV heads, head_dim 128,
   page_size 16; every sequence on shuffled pages): for batch 8/64/256 and context
   512/2k/8k, the decode kernel (one query per sequence, flash-decoding splits at small
   batch) and the ragged kernel on a mixed batch (batch // 16 prefill chunks of 512 tokens
   at the end of their context, at least one, beside decodes).
2. Correctness sweep: both kernels at bf16 and f32, GQA groups 1/4/8, page sizes 16 and 32,
   rows of ragged lengths from 1 to 8k (decode rows; and prefill chunks, whole prompts and
   decodes mixed in one ragged batch), reading layer 1 of a two-layer cache as the model
   does.

Correctness: each kernel's output on a sample of tokens (every row's first and last, and
more at random) against the per-token reference of `jaxserve.pallas_kernels.reference`,
computed in f32 from the same pages (the dense reference gathers each token's whole
context: too big for every token at 8k), within the dtype's tolerance. The timing cases are
checked the same way.

Timing: host wall-clock around jitted calls and `jax.block_until_ready`, after warm-up
calls. Each sample dispatches a few calls back to back and waits for the last (dispatch is
asynchronous, so each launch overlaps the previous call's work) and is divided by its number
of calls; the table shows the median sample. A time includes the small jnp ops around each
kernel (q padding, the split merge) and, at tiny sizes, launch overhead. GB/s counts the K
and V bytes the batch must read once (sum of kv_lens x KV heads x head_dim x 2 bytes, for K
and for V) over that time: the roofline is those bytes at the HBM bandwidth. The ragged
kernel reads a row's pages once per q-block, mostly from L2, so its figure understates its
traffic.

The "dry" profile (tiny shapes, interpret=True) runs on CPU in seconds, for the test suite;
"reduced" is larger but still interpreted, to run the whole suite on CPU within its limits.
"""

import argparse
import functools
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

from jaxserve.pallas_kernels.paged_attention import paged_attention
from jaxserve.pallas_kernels.ragged_attention import ragged_paged_attention
from jaxserve.pallas_kernels.reference import ragged_paged_attention_reference

TOLERANCE = {"bfloat16": 2e-2, "float32": 5e-3}  # atol = rtol; q is in the pool's dtype


@dataclass(frozen=True, slots=True)
class Pool:
    """One layer's KV pool and the query heads that read it."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    dtype: str


@dataclass(frozen=True, slots=True)
class Profile:
    """The timed shapes, the correctness sweep and the kernels' tiles."""

    timing: Pool
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    prefill_chunk: int
    sweep_kv_heads: int
    sweep_head_dim: int
    sweep_groups: tuple[int, ...]
    sweep_page_sizes: tuple[int, ...]
    sweep_decode_lens: tuple[int, ...]  # one decode row per length
    sweep_ragged_rows: tuple[tuple[int, int], ...]  # (q_len, kv_len) per row
    pages_per_block: int
    block_q: int
    warmup: int
    iters: int  # timed samples
    calls_per_sample: int
    interpret: bool


PROFILES = {
    "gpu": Profile(
        timing=Pool(32, 8, 128, 16, "bfloat16"), batches=(8, 64, 256),
        contexts=(512, 2048, 8192), prefill_chunk=512, sweep_kv_heads=2, sweep_head_dim=128,
        sweep_groups=(1, 4, 8), sweep_page_sizes=(16, 32),
        sweep_decode_lens=(1, 3, 16, 17, 100, 256, 513, 2000, 4096, 8192),
        sweep_ragged_rows=((1, 1), (3, 3), (1, 17), (100, 256), (513, 513), (1, 2000),
                           (64, 8192), (1, 8192)),
        pages_per_block=8, block_q=16, warmup=3, iters=20, calls_per_sample=10,
        interpret=False,
    ),
    "reduced": Profile(
        timing=Pool(8, 2, 32, 8, "bfloat16"), batches=(2, 4), contexts=(16, 40),
        prefill_chunk=8, sweep_kv_heads=1, sweep_head_dim=16, sweep_groups=(1, 4, 8),
        sweep_page_sizes=(4, 8), sweep_decode_lens=(1, 3, 9, 40),
        sweep_ragged_rows=((1, 1), (3, 3), (5, 20), (1, 40)),
        pages_per_block=2, block_q=4, warmup=1, iters=2, calls_per_sample=1, interpret=True,
    ),
    "dry": Profile(
        timing=Pool(6, 2, 32, 4, "bfloat16"), batches=(3,), contexts=(13,), prefill_chunk=8,
        sweep_kv_heads=1, sweep_head_dim=16, sweep_groups=(1, 4), sweep_page_sizes=(4,),
        sweep_decode_lens=(1, 9), sweep_ragged_rows=((3, 3), (1, 9)),
        pages_per_block=2, block_q=4, warmup=1, iters=1, calls_per_sample=1, interpret=True,
    ),
}


@dataclass(frozen=True, slots=True)
class Batch:
    """One case's inputs, on the device, with the host copies the checks need."""

    q: jax.Array  # [num_tokens, num_heads, head_dim] in the pool's dtype
    cu_q_lens: np.ndarray  # i32[num_rows + 1]
    kv_lens: np.ndarray  # i32[num_rows]
    page_table: np.ndarray  # i32[num_rows, max_pages]
    sample: np.ndarray  # i32[num_sample] tokens whose output is checked


def make_pages(
    pool: Pool, num_pages: int, seed: int, num_layers: int | None = None
) -> tuple[jax.Array, jax.Array]:
    """K and V pools of one layer, or of `num_layers` layers (the whole cache)."""
    shape = (pool.num_kv_heads, num_pages, pool.page_size, pool.head_dim)
    if num_layers is not None:
        shape = (num_layers, *shape)
    k_key, v_key = jax.random.split(jax.random.key(seed))
    return (jax.random.normal(k_key, shape, pool.dtype),
            jax.random.normal(v_key, shape, pool.dtype))


def make_batch(
    pool: Pool, rng: np.random.Generator, rows: list[tuple[int, int]], num_pages: int
) -> Batch:
    """Rows of (q_len, kv_len): each row's queries are the last q_len of its kv_len tokens,
    its pages drawn at random (never the null page)."""
    q_lens = [q for q, _ in rows]
    kv_lens = np.array([kv for _, kv in rows], np.int32)
    max_pages = -(-int(kv_lens.max()) // pool.page_size)
    pages = rng.permutation(np.arange(1, num_pages, dtype=np.int32))
    needed = len(rows) * max_pages
    if needed > len(pages):
        raise ValueError(f"{needed} pages needed, the pool has {len(pages)}")
    cu_q_lens = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    num_tokens = int(cu_q_lens[-1])
    q = jax.random.normal(
        jax.random.key(int(rng.integers(1 << 31))),
        (num_tokens, pool.num_heads, pool.head_dim),
        pool.dtype,  # as the model's q: f32 q over bf16 pages computes in f32 (slow dots)
    )
    # every row's first and last token, and a few more at random
    ends = np.concatenate([cu_q_lens[:-1], cu_q_lens[1:] - 1])
    extra = rng.choice(num_tokens, size=min(num_tokens, 16), replace=False)
    sample = rng.permutation(np.unique(np.concatenate([ends, extra])))[:48].astype(np.int32)
    return Batch(
        q=q,
        cu_q_lens=cu_q_lens,
        kv_lens=kv_lens,
        page_table=pages[:needed].reshape(len(rows), max_pages),
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
    out: jax.Array, batch: Batch, k_pages: jax.Array, v_pages: jax.Array, dtype: str,
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
    tol = TOLERANCE[dtype]
    return float(err.max()), bool(np.all(err <= tol + tol * np.abs(want)))


def median_seconds(fn, profile: Profile) -> float:
    """Median seconds per call of `fn`, a jitted call with its arguments bound."""
    for _ in range(profile.warmup):
        jax.block_until_ready(fn())
    samples = []
    for _ in range(profile.iters):
        start = time.perf_counter()
        for _ in range(profile.calls_per_sample):
            out = fn()
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - start) / profile.calls_per_sample)
    return statistics.median(samples)


def num_kv_splits(pool: Pool, batch: int) -> int:
    """Enough programs to fill a big GPU at small batch (a shape rule, not a tuned one)."""
    return max(1, min(8, 1024 // (batch * pool.num_kv_heads)))


def kernel_call(kind: str, batch: Batch, k_pages, v_pages, profile: Profile, splits: int,
                layer: int | None = None):
    """The kernel on `batch` (reading `layer` of a whole cache, if given), as a thunk."""
    scale = batch.q.shape[-1] ** -0.5
    if kind == "decode":
        return functools.partial(
            paged_attention, batch.q, k_pages, v_pages, jnp.asarray(batch.kv_lens),
            jnp.asarray(batch.page_table), layer, scale=scale,
            pages_per_block=profile.pages_per_block, num_kv_splits=splits,
            interpret=profile.interpret,
        )
    return functools.partial(
        ragged_paged_attention, batch.q, k_pages, v_pages, jnp.asarray(batch.cu_q_lens),
        jnp.asarray(batch.kv_lens), jnp.asarray(batch.page_table), layer, scale=scale,
        block_q=profile.block_q, pages_per_block=profile.pages_per_block,
        interpret=profile.interpret,
    )


def timing_rows(kind: str, batch_size: int, context: int, chunk: int) -> list[tuple[int, int]]:
    if kind == "decode":
        return [(1, context)] * batch_size
    num_prefill = max(1, batch_size // 16)
    chunk = min(chunk, context)
    return [(chunk, context)] * num_prefill + [(1, context)] * (batch_size - num_prefill)


def run_timing(kind: str, batch_size: int, context: int, profile: Profile, k_pages, v_pages,
               rng: np.random.Generator, bandwidth_gbps: float) -> dict:
    pool = profile.timing
    rows = timing_rows(kind, batch_size, context, profile.prefill_chunk)
    batch = make_batch(pool, rng, rows, k_pages.shape[1])
    splits = num_kv_splits(pool, batch_size) if kind == "decode" else 1
    fn = kernel_call(kind, batch, k_pages, v_pages, profile, splits)
    max_err, ok = check_sample(fn(), batch, k_pages, v_pages, pool.dtype,
                               pool.head_dim**-0.5)
    seconds = median_seconds(fn, profile)
    kv_bytes = int(batch.kv_lens.sum()) * pool.num_kv_heads * pool.head_dim
    kv_bytes *= 2 * k_pages.dtype.itemsize
    gbps = kv_bytes / seconds / 1e9
    return {
        "tokens": int(batch.cu_q_lens[-1]), "splits": splits, "median_ms": seconds * 1e3,
        "kv_gb": kv_bytes / 1e9, "gbps": gbps, "peak_fraction": gbps / bandwidth_gbps,
        "roofline_ms": kv_bytes / (bandwidth_gbps * 1e9) * 1e3, "max_err": max_err, "ok": ok,
    }


def run_check(kind: str, pool: Pool, profile: Profile, rng: np.random.Generator) -> dict:
    if kind == "decode":
        rows = [(1, n) for n in profile.sweep_decode_lens]
    else:
        rows = list(profile.sweep_ragged_rows)
    max_pages = -(-max(kv for _, kv in rows) // pool.page_size)
    # a two-layer cache read at layer 1, as the model calls the kernels
    k_cache, v_cache = make_pages(pool, len(rows) * max_pages + 1, int(rng.integers(1 << 31)), 2)
    batch = make_batch(pool, rng, rows, k_cache.shape[2])
    splits = 2 if kind == "decode" else 1  # the decode rows split, as at small batch
    out = kernel_call(kind, batch, k_cache, v_cache, profile, splits, layer=1)()
    max_err, ok = check_sample(out, batch, k_cache[1], v_cache[1], pool.dtype,
                               pool.head_dim**-0.5)
    return {"tokens": int(batch.cu_q_lens[-1]), "max_err": max_err, "ok": ok}


def guarded(fn, *args) -> dict:
    """fn(*args) with its wall seconds; an exception becomes the row's error, not the end."""
    start = time.perf_counter()
    try:
        row = fn(*args)
    except Exception as err:  # noqa: BLE001  (recorded, and the sweep goes on)
        traceback.print_exc()
        row = {"ok": False, "error": f"{type(err).__name__}: {str(err)[:500]}"}
    row["seconds"] = time.perf_counter() - start
    return row


def markdown(data: dict) -> str:
    timing = [r for r in data["results"] if r["section"] == "timing"]
    checks = [r for r in data["results"] if r["section"] == "check"]
    parts = []
    if timing:
        parts.append(
            f"Timed at {data['timing_pool']} (median of {data['setup']['iters']} samples of "
            f"{data['setup']['calls_per_sample']} calls; roofline: the K/V bytes at "
            f"{data['bandwidth_gbps']:,.0f} GB/s)\n\n"
            + markdown_table(
                ["kernel", "batch", "context", "tokens", "splits", "ms", "roofline ms",
                 "GB/s", "% of peak", "max err", "ok"],
                [[r["kernel"], r["batch"], r["context"], r.get("tokens", ""),
                  r.get("splits", ""), fmt(r.get("median_ms"), 3),
                  fmt(r.get("roofline_ms"), 3), fmt(r.get("gbps"), 0),
                  fmt(100 * r["peak_fraction"] if "peak_fraction" in r else None),
                  f"{r['max_err']:.1e}" if "max_err" in r else "",
                  "yes" if r["ok"] else f"NO {r.get('error', '')}"] for r in timing],
            )
        )
    if checks:
        parts.append(
            "Correctness against the jnp reference (sampled tokens; tolerance "
            + ", ".join(f"{k} {v:g}" for k, v in TOLERANCE.items()) + ")\n\n"
            + markdown_table(
                ["kernel", "dtype", "GQA group", "page size", "tokens", "max err", "ok"],
                [[r["kernel"], r["dtype"], r["group"], r["page_size"], r.get("tokens", ""),
                  f"{r['max_err']:.1e}" if "max_err" in r else "",
                  "yes" if r["ok"] else f"NO {r.get('error', '')}"] for r in checks],
            )
        )
    return "\n\n".join(parts) or "(no results)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", choices=tuple(PROFILES), default="gpu")
    parser.add_argument("--bandwidth-gbps", type=float, default=4800.0,
                        help="the chip's HBM bandwidth (H200 datasheet: 4800)")
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    if not profile.interpret and jax.default_backend() != "gpu":
        print(f"no GPU (backend {jax.default_backend()}): use --profile reduced or dry",
              file=sys.stderr)
        return 2
    pool = profile.timing
    report = PartReport(
        args.out, markdown, part="kernels", profile=args.profile,
        device=jax.devices()[0].device_kind, bandwidth_gbps=args.bandwidth_gbps,
        timing_pool=f"{pool.num_heads} q heads, {pool.num_kv_heads} KV heads, head_dim "
        f"{pool.head_dim}, page_size {pool.page_size}, {pool.dtype}",
        setup=asdict(profile),
    )
    rng = np.random.default_rng(0)
    # the Llama-3-8B timing first: the numbers the README quotes (and checked as well)
    # one pool for every timed case, big enough for the largest batch at the longest context
    num_pages = max(profile.batches) * -(-max(profile.contexts) // pool.page_size) + 1
    k_pages, v_pages = make_pages(pool, num_pages, 0)
    for kind in ("decode", "ragged"):
        for batch_size in profile.batches:
            for context in profile.contexts:
                row = guarded(run_timing, kind, batch_size, context, profile, k_pages, v_pages,
                              rng, args.bandwidth_gbps)
                report.add({"section": "timing", "kernel": kind, "batch": batch_size,
                            "context": context, **row})
                print(report.data["results"][-1], flush=True)
    del k_pages, v_pages
    # then the sweep: its f32 ragged kernels at GQA 4 and 8 took 16-20 s each to build on an H200
    for dtype in ("bfloat16", "float32"):
        for group in profile.sweep_groups:
            for page_size in profile.sweep_page_sizes:
                sweep_pool = Pool(group * profile.sweep_kv_heads, profile.sweep_kv_heads,
                                  profile.sweep_head_dim, page_size, dtype)
                for kind in ("decode", "ragged"):
                    row = guarded(run_check, kind, sweep_pool, profile, rng)
                    report.add({"section": "check", "kernel": kind, "dtype": dtype,
                                "group": group, "page_size": page_size, **row})
                    print(report.data["results"][-1], flush=True)
    report.update(complete=True)
    print(report.data["markdown"])
    failed = [r for r in report.data["results"] if not r["ok"]]
    if failed:
        print(f"{len(failed)} case(s) failed or outside tolerance", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
