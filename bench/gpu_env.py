"""The GPU suite's first part: what machine this is, what it runs, and its measured ceilings.

    python bench/gpu_env.py --out OUT/env.json [--profile gpu|reduced|dry]

Records the accelerator (nvidia-smi), the CPU (lscpu), Python and the versions of every
package the suite uses (and where jax and flax were imported from, since the suite puts
carried wheels ahead of the machine's own), checks that jaxserve's engine imports, and
measures the device's copy bandwidth and matmul rate with `bench/roofline.py`'s
`measure_machine`: the ceilings the other parts' roofline columns can be read against. And
how exact an f32 matmul is at XLA's DEFAULT and HIGHEST precision, against float64 (on an
H200 DEFAULT is TF32: 2.7e-4 relative against HIGHEST's 5.7e-7; why the engine's step
traces its dots at HIGHEST).
"""

import argparse
import importlib.metadata
import platform
import subprocess
import sys
from pathlib import Path

from common import PartReport, cpu_description, fmt, markdown_table

PACKAGES = (
    "jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "flax", "orbax-checkpoint",
    "numpy", "msgspec", "gguf", "aiohttp", "tokenizers", "safetensors", "jinja2",
    "prometheus-client",
)
# (copy MiB, matmul n, repeats) for the ceilings
SIZES = {"gpu": (4096, 8192, 10), "reduced": (256, 1024, 3), "dry": (16, 128, 2)}


def versions() -> dict:
    found = {}
    for name in PACKAGES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def nvidia_smi() -> str | None:
    query = "name,memory.total,driver_version,clocks.max.sm,clocks.max.mem"
    try:
        done = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or done.stderr.strip() or None


def f32_matmul_errors() -> dict[str, float]:
    """Max error of a 512x576 @ 576x1536 f32 matmul against float64, relative to the largest
    output, at each precision."""
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    a = rng.standard_normal((512, 576)).astype(np.float32)
    b = rng.standard_normal((576, 1536)).astype(np.float32)
    want = a.astype(np.float64) @ b.astype(np.float64)
    errors = {}
    for precision in ("default", "highest"):
        with jax.default_matmul_precision(precision):
            got = np.asarray(jax.jit(lambda a, b: a @ b)(a, b), np.float64)
        errors[precision] = float(np.abs(got - want).max() / np.abs(want).max())
    return errors


def markdown(data: dict) -> str:
    rows = [
        ("accelerator", data.get("nvidia_smi") or "none (nvidia-smi not found)"),
        ("jax devices", data.get("devices", "n/a")),
        ("CPU", data["cpu"]["model"]),
        ("python", data["python"]),
        *((name, v) for name, v in data["versions"].items() if v is not None),
        ("jax from", data.get("jax_path", "n/a")),
        ("flax from", data.get("flax_path", "n/a")),
        ("jaxserve imports", data.get("jaxserve_import", "n/a")),
    ]
    machine = data.get("machine")
    if machine:
        rows += [
            ("copy bandwidth", f"{fmt(machine['copy_bandwidth_gbps'], 0)} GB/s "
             f"({machine['bandwidth_mb']} MiB, read+write)"),
            ("read bandwidth", f"{fmt(machine['read_bandwidth_gbps'], 0)} GB/s"),
            ("matmul", f"{fmt(machine['matmul_tflops'], 1)} TFLOP/s "
             f"({machine['matmul_dtype']}, n={machine['matmul_n']})"),
        ]
    errors = data.get("f32_matmul_error")
    if errors:
        rows.append(("f32 matmul error", ", ".join(
            f"{p.upper()} {e:.1e}" for p, e in errors.items()) + " (relative, against f64)"))
    return markdown_table(["", ""], rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", choices=tuple(SIZES), default="gpu")
    args = parser.parse_args()
    report = PartReport(
        args.out, markdown, part="env", profile=args.profile, python=sys.version.split()[0],
        platform=platform.platform(), cpu=cpu_description(), versions=versions(),
        nvidia_smi=nvidia_smi(),
    )
    import flax
    import jax

    report.update(
        jax_path=str(Path(jax.__file__).parent), flax_path=str(Path(flax.__file__).parent),
        backend=jax.default_backend(),
        devices=", ".join(f"{d.platform}:{d.device_kind}" for d in jax.devices()),
        device_memory_bytes=(jax.devices()[0].memory_stats() or {}).get("bytes_limit"),
    )
    import jaxserve.llm  # noqa: F401  (the engine, its model and kernels)

    report.update(jaxserve_import="ok")
    from roofline import measure_machine

    copy_mb, matmul_n, repeats = SIZES[args.profile]
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    report.update(f32_matmul_error=f32_matmul_errors())
    report.update(machine=measure_machine(copy_mb, matmul_n, dtype, repeats), complete=True)
    print(report.data["markdown"])


if __name__ == "__main__":
    main()
