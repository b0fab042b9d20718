"""The GPU suite's quantization part: jaxserve's decode step on the Llama-3-8B-shaped model
with int8 weights, fp8 weights and an fp8 KV cache, beside bf16, in one process.

    python bench/gpu_quantized.py --out OUT/quantized.json [--profile gpu|reduced|dry]

Each variant is the engine part's model (bench/gpu_engine.py: random weights at the same
config, its profiles) with the projections re-stored as the variant says and the KV pool
in its storage, run by the engine's `ModelRunner` and measured by the engine part's
`measure` at the profile's two most telling decode batches. Quantized weights are random
values and scales made on the device (random values cost what real ones do; quantizing
8 B parameters through the host, as `jaxserve convert` does, would take most of the part's
time box). The variants run in order of value, bf16 first as the reference, so a part
stopped at its limit keeps the ratios it has.
"""

import argparse
import sys
import time
import traceback
from pathlib import Path

import jax
import jax.numpy as jnp
from common import PartReport, fmt, markdown_table
from flax import nnx
from gpu_engine import PROFILES, CompileSeconds, measure

from jaxserve.device.runner import ModelRunner
from jaxserve.device.sharding import map_params
from jaxserve.host.buckets import BucketTable
from jaxserve.host.page_allocator import PageAllocator
from jaxserve.models import get_model_spec
from jaxserve.models.layers import QuantizedWeight
from jaxserve.models.llama import LlamaForCausalLM

# (name, weight storage, KV storage); None: the profile's dtype
VARIANTS = (
    ("bf16", None, None),
    ("fp8 KV", None, "fp8"),
    ("int8 weights", "int8", None),
    ("fp8 weights", "fp8", None),
)


def random_quantized(model: nnx.Module, weight_dtype: str) -> nnx.Module:
    """`model` with every projection replaced by random `weight_dtype` values and scales
    of its shape, made on the device."""
    graphdef, state = nnx.split(model)
    rules = get_model_spec(model.config.architecture).weight_map(model.config)
    key = iter(jax.random.split(jax.random.key(0), 64))

    def quantized(name: str, value: jax.Array):
        if not rules[name].projection:
            return value
        if weight_dtype == "int8":
            values = jax.random.randint(next(key), value.shape, -127, 128, jnp.int8)
        else:
            values = jax.random.normal(next(key), value.shape, jnp.bfloat16) * 8
            values = values.astype(jnp.float8_e4m3fn)
        scale = jnp.full(value.shape[:-2] + value.shape[-1:], 1e-3, jnp.float32)
        return QuantizedWeight(values, scale)

    return nnx.merge(graphdef, map_params(quantized, state))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", choices=tuple(PROFILES), default="gpu")
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    config = profile.model
    batches = profile.decode_batches[:2]
    report = PartReport(
        args.out, markdown, part="quantized", profile=args.profile, dtype=profile.dtype,
        context=profile.context, device=jax.devices()[0].device_kind,
    )
    compiles = CompileSeconds()
    pages_per_row = -(-profile.context // profile.page_size)
    num_pages = (max(batches) + 1) * pages_per_row + 1
    for name, weight_dtype, kv_dtype in VARIANTS:
        start = time.perf_counter()
        try:
            model = LlamaForCausalLM(config, nnx.Rngs(0), jnp.dtype(profile.dtype))
            if weight_dtype is not None:
                model = random_quantized(model, weight_dtype)
            runner = ModelRunner(
                model, BucketTable(tuple(sorted(batches)), tuple(sorted(batches))), num_pages,
                profile.page_size, pages_per_row * profile.page_size, max(batches),
                dtype=jnp.dtype(profile.dtype), kv_dtype=kv_dtype,
            )
            del model
            built = {
                "weights_gb": sum(x.nbytes for x in jax.tree.leaves(runner.state)) / 1e9,
                "kv_gb": sum(x.nbytes for x in jax.tree.leaves(runner.kv_cache)) / 1e9,
                "kv_dtype": runner.kv_dtype, "backend": runner.backend,
                "build_s": time.perf_counter() - start,
            }
        except Exception as err:  # noqa: BLE001  (recorded; the next variant still runs)
            traceback.print_exc()
            report.add({"variant": name, "error": f"{type(err).__name__}: {str(err)[:500]}"})
            continue
        allocator = PageAllocator(num_pages)
        for rows in batches:
            row = {"variant": name, "rows": rows, **built}
            try:
                row |= measure(runner, allocator, compiles, profile, rows, 1)
            except Exception as err:  # noqa: BLE001
                traceback.print_exc()
                row["error"] = f"{type(err).__name__}: {str(err)[:500]}"
            report.add(row)
            print(row, flush=True)
        del runner
    report.update(complete=True)
    print(report.data["markdown"])
    return 1 if any("error" in r for r in report.data["results"]) else 0


def markdown(data: dict) -> str:
    base = {r["rows"]: r["step_ms"] for r in data["results"]
            if r["variant"] == "bf16" and "step_ms" in r}
    rows = []
    for r in data["results"]:
        if "step_ms" not in r:
            rows.append([r["variant"], r.get("rows", ""), "", "", "", "", r.get("error", "")])
            continue
        ratio = r["step_ms"] / base[r["rows"]] if r["rows"] in base else None
        rows.append([r["variant"], r["rows"], fmt(r["weights_gb"], 2), fmt(r["kv_gb"], 2),
                     fmt(r["step_ms"], 2), fmt(ratio, 2), fmt(r["device_ms"], 2)])
    return (f"Decode steps at context {data['context']} ({data['dtype']} activations), on "
            f"{data['device']}\n\n" + markdown_table(
                ["variant", "decode rows", "weights GB", "KV pool GB", "step ms",
                 "÷ bf16", "device ms"], rows))


if __name__ == "__main__":
    sys.exit(main())
