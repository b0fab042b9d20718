"""LoRA adapters in the mix against the base model alone, side by side in one run.

    .venv/bin/python bench/lora.py [--model GGUF] [--adapters 4] [--rank 16]
        [--concurrency 16] [--requests 48] [--repeats 2] [--server-args "..."]
        [--out bench/results/lora.json]

Two servers run at once (one is idle while the other is measured), both `jaxserve serve`
on the same model at its defaults but --no-prefix-cache (every run sends the same
prompts: with a cache, a run would reuse the pages of the runs before it, unevenly):
- base: no adapters.
- lora: --adapters random PEFT adapters of rank --rank on all seven projections (written
  here with numpy, A and B ~ N(0, 0.02²), lora_alpha = rank), --max-loras as many.
Conditions, through bench/serve.py's client (streamed, closed loop at --concurrency,
100-300-token prompts, 128 tokens out, the same prompts for each):
- base: the base server, every request to the base model;
- lora-base: the lora server, every request to the base model (what serving adapters
  costs a step in which no row uses one);
- lora-mix: the lora server, the requests taking the adapters in turn.
--repeats R runs the conditions R times, in forward then reverse order (base, lora-mix,
lora-base, then back: base and lora-mix always side by side, so the machine's drift
reaches both alike), and reports medians. The ratio that the LoRA issue bounds is base ÷
lora-mix in output tokens/s (≤ 1.3): the median of each repeat's own ratio, beside the
ratio of the medians.

Writes the JSON (the machine, the commands, every repeat, the medians), a markdown table
and a plot beside --out.
"""

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import numpy as np
from common import (
    RESULTS,
    cpu_description,
    fmt,
    free_port,
    markdown_table,
    pyplot,
    server_process,
    write_json,
)
from serve import Lengths, Workload, run

from jaxserve.checkpoint.adapter import TARGETS, projection_shapes
from jaxserve.checkpoint.weights import open_checkpoint
from jaxserve.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONDITIONS = ("base", "lora-base", "lora-mix")
ORDER = ("base", "lora-mix", "lora-base")  # base and lora-mix side by side, both ways
METRICS = (("output tok/s", "output_tokens_per_s", None), ("TTFT p50 ms", "ttft_ms", "p50"),
           ("TPOT p50 ms", "tpot_ms", "p50"), ("TPOT p95 ms", "tpot_ms", "p95"))


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int, std: float = 0.02
                  ) -> None:
    """A random PEFT adapter of `rank` on every projection of every layer, A and B ~
    N(0, std²)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, (fan_in, fan_out) in projection_shapes(config).items():
            block = "mlp" if target in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            name = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{name}.lora_A.weight"] = rng.normal(0, std, (rank, fan_in)).astype(
                np.float32)
            tensors[f"{name}.lora_B.weight"] = rng.normal(0, std, (fan_out, rank)).astype(
                np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / "adapter_model.safetensors")
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS),
         "bias": "none"}))


def command(model: Path, port: int, adapters: list[tuple[str, Path]], rank: int,
            extra: str) -> list[str]:
    lora = [arg for name, path in adapters for arg in ("--lora", f"{name}={path}")]
    slots = ["--max-loras", str(len(adapters)), "--max-lora-rank", str(rank)] if adapters else []
    # no prefix cache: every run sends the same prompts, and a cache would serve them
    # from pages kept by the run before (one pool holds both lora conditions' pages)
    return [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model),
            "--port", str(port), "--max-model-len", "1024", "--no-prefix-cache", *lora, *slots,
            "--compilation-cache-dir", str(ROOT / ".cache" / "jax"), *shlex.split(extra)]


def figure(report: dict, key: str, pct: str | None) -> float | None:
    return report[key] if pct is None else report[key][pct]


def markdown(report: dict) -> str:
    med, ratios = report["medians"], report["repeat_ratios_base_over_mix_tokens_per_s"]
    rows = [[label, *(fmt(figure(med[c], key, pct)) for c in CONDITIONS),
             fmt(figure(med["base"], key, pct) / figure(med["lora-mix"], key, pct), 2)]
            for label, key, pct in METRICS]
    cpu = report["cpu"]
    flags = [f for f in (cpu["flags"] or "").split() if f.startswith(("avx512", "amx", "avx2"))]
    return "\n".join([
        f"`{report['command']}` on {cpu['model']} ({' '.join(flags)})",
        "",
        f"{report['adapters']} adapters of rank {report['rank']} on all seven projections; "
        f"concurrency {report['concurrency']}, {report['requests']} requests, medians of "
        f"{report['repeats']}",
        "",
        markdown_table(["metric", *CONDITIONS, "base ÷ lora-mix"], rows),
        "",
        "base ÷ lora-mix in output tok/s, repeat by repeat: "
        + ", ".join(fmt(r, 2) for r in ratios) + f" (median {fmt(statistics.median(ratios), 2)})",
        "",
    ])


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, (label, key, pct) in zip(axes, METRICS[:3:2]):
        values = [figure(report["medians"][c], key, pct) for c in CONDITIONS]
        ax.bar(CONDITIONS, values, color=["grey", "tab:blue", "tab:orange"])
        ax.set_title(label)
    fig.suptitle(f"LoRA: {report['adapters']} adapters of rank {report['rank']}, "
                 f"concurrency {report['concurrency']}")
    fig.tight_layout()
    fig.savefig(path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=GGUF)
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--server-args", default="", help="more flags for both servers")
    parser.add_argument("--out", type=Path, default=RESULTS / "lora.json")
    args = parser.parse_args()

    config = open_checkpoint(args.model).config
    adapters = []
    for i in range(args.adapters):
        path = ROOT / ".cache" / "lora" / f"{args.model.stem}-r{args.rank}-{i}"
        write_adapter(path, config, args.rank, seed=i)
        adapters.append((f"adapter-{i}", path))
    ports = {"base": free_port(), "lora": free_port()}
    commands = {"base": command(args.model, ports["base"], [], args.rank, args.server_args),
                "lora": command(args.model, ports["lora"], adapters, args.rank,
                                args.server_args)}
    workload = Workload(requests=args.requests, concurrency=args.concurrency,
                        prompt_tokens=Lengths(100, 300), output_tokens=Lengths(128, 128))
    model = args.model.stem
    runs: dict[str, list[dict]] = {c: [] for c in CONDITIONS}
    logs = {s: ROOT / ".cache" / "lora" / f"{s}-server.log" for s in ports}
    url = {s: f"http://127.0.0.1:{p}" for s, p in ports.items()}
    with server_process(commands["base"], url["base"] + "/health", logs["base"], cwd=ROOT,
                        env=dict(os.environ)), \
         server_process(commands["lora"], url["lora"] + "/health", logs["lora"], cwd=ROOT,
                        env=dict(os.environ)):
        for repeat in range(args.repeats):
            order = ORDER if repeat % 2 == 0 else ORDER[::-1]
            for condition in order:
                server = "base" if condition == "base" else "lora"
                names = ",".join(n for n, _ in adapters) if condition == "lora-mix" else model
                print(f"repeat {repeat + 1}/{args.repeats}: {condition}", flush=True)
                report = run(url[server], names, workload, plots=False)
                runs[condition].append({k: report[k] for k in
                                        ("output_tokens_per_s", "ttft_ms", "tpot_ms",
                                         "num_completed", "num_429", "num_errors")})
    medians: dict = {c: {} for c in CONDITIONS}
    for condition, reports in runs.items():
        for _, key, pct in METRICS:
            value = statistics.median(figure(r, key, pct) for r in reports)
            if pct is None:
                medians[condition][key] = value
            else:
                medians[condition].setdefault(key, {})[pct] = value
    report = {
        "command": " ".join(["bench/lora.py", *sys.argv[1:]]),
        "cpu": cpu_description(),
        "servers": {s: " ".join(c) for s, c in commands.items()},
        "adapters": args.adapters, "rank": args.rank, "concurrency": args.concurrency,
        "requests": args.requests, "repeats": args.repeats,
        "runs": runs, "medians": medians,
        "ratio_base_over_mix_tokens_per_s": (medians["base"]["output_tokens_per_s"]
                                             / medians["lora-mix"]["output_tokens_per_s"]),
        "repeat_ratios_base_over_mix_tokens_per_s": [
            b["output_tokens_per_s"] / m["output_tokens_per_s"]
            for b, m in zip(runs["base"], runs["lora-mix"])],
    }
    report["plot"] = plot(report, args.out.with_suffix(".png"))
    write_json(args.out, report)
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
