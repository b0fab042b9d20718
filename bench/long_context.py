"""A long-context pool keeps long prompts away from the chat streams: measured.

    .venv/bin/python bench/long_context.py [--model GGUF] [--rounds 2] [--round-s 40]
        [--concurrency 4] [--long-tokens 3000] [--long-every-s 4]
        [--out bench/results/long_context.json]

Two replicas of the same model (each pinned to a CPU of its own when there are two;
the second at nice 10, so that the gateway and this load generator, which share the
two cores, take their CPU time from it rather than from the first: standing in for
the separate hosts a deployment gives them), behind two gateways at once:
- split: a chat pool (replica 1, prompts up to 2,048 tokens) and a long-context pool
  (replica 2, the longer ones), as examples/platform.toml deploys them;
- single: one pool of both replicas, routed by headroom alone.
Each round runs the ordinary load (a closed loop of `--concurrency` streamed chats of
100-300 prompt tokens, 64 out) through each gateway with and without long prompts
(one of `--long-tokens` every `--long-every-s` seconds, 16 out), the four conditions
interleaved and their order turned each round, since this machine's speed drifts.
Reported: the ordinary requests' TTFT p95 and ITL p95 per condition (medians over
rounds), and each deployment's ratio with ÷ without long prompts.
"""

import argparse
import contextlib
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import serve
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

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2"
THRESHOLD = 2048  # the chat pool's max_prompt_tokens
CONDITIONS = [("split", False), ("split", True), ("single", False), ("single", True)]


def replica_cmd(model: str, port: int, cpu: str | None, nice: int) -> list[str]:
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", model, "--port", str(port),
           "--served-model-name", MODEL, "--max-model-len", "4096",
           "--compilation-cache-dir", str(ROOT / ".cache" / "jax")]
    cmd = ["nice", "-n", str(nice), *cmd] if nice else cmd
    return ["taskset", "-c", cpu, *cmd] if cpu is not None else cmd


def gateway_config(kind: str, urls: list[str], tokenizer: str) -> dict:
    if kind == "single":
        pools = [{"name": "all", "model": MODEL, "replicas": urls}]
    else:
        pools = [{"name": "chat", "model": MODEL, "replicas": urls[:1], "tokenizer": tokenizer,
                  "max_prompt_tokens": THRESHOLD},
                 {"name": "long", "model": MODEL, "replicas": urls[1:], "tokenizer": tokenizer,
                  "min_prompt_tokens": THRESHOLD + 1}]
    return {"gateway": {"poll_interval_s": 0.1}, "pools": pools}


class LongPrompts:
    """Sends a long prompt every `every_s` seconds (each on its own thread: open loop)."""

    def __init__(self, url: str, tokens: int, every_s: float, seed: int):
        rng = random.Random(seed)
        self.url, self.every_s = url, every_s
        self.prompt = " ".join(rng.choice(serve.WORDS) for _ in range(tokens))
        self.latencies: list[float] = []  # of the long prompts answered
        self.sent = 0
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []

    def _one(self, n: int) -> None:
        body = {"model": MODEL, "prompt": f"{n} {self.prompt}", "max_tokens": 16}
        request = urllib.request.Request(self.url + "/v1/completions",
                                         data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        start = time.perf_counter()
        self.sent += 1
        with contextlib.suppress(OSError), urllib.request.urlopen(request, timeout=600):
            self.latencies.append(time.perf_counter() - start)  # a 429 or an error is not

    def _run(self) -> None:
        n = 0
        while not self.stop.wait(0 if n == 0 else self.every_s):
            t = threading.Thread(target=self._one, args=(n,))
            t.start()
            self.threads.append(t)
            n += 1

    def __enter__(self) -> "LongPrompts":
        self.sender = threading.Thread(target=self._run)
        self.sender.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.sender.join()
        for t in self.threads:  # the next condition starts on idle replicas
            t.join()


def measure(url: str, args, long: bool, seed: int) -> dict:
    workload = serve.Workload(requests=None, duration_s=args.round_s,
                              concurrency=args.concurrency, prompt_tokens=serve.Lengths(100, 300),
                              output_tokens=serve.Lengths(64, 64), seed=seed)
    with LongPrompts(url, args.long_tokens, args.long_every_s, seed) if long else (
        contextlib.nullcontext()
    ) as sender:
        report = serve.run(url, MODEL, workload, progress=False)
    return {"ttft_p95_ms": report["ttft_ms"]["p95"], "itl_p95_ms": report["itl_ms"]["p95"],
            "ttft_p50_ms": report["ttft_ms"]["p50"], "itl_p50_ms": report["itl_ms"]["p50"],
            "completed": report["num_completed"], "errors": report["num_errors"],
            "num_429": report["num_429"],
            "long_sent": sender.sent if long else 0,
            "long_answered": len(sender.latencies) if long else 0,
            "long_latency_s": statistics.median(sender.latencies)
            if long and sender.latencies else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--round-s", type=float, default=40.0)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--long-tokens", type=int, default=2500)
    p.add_argument("--long-every-s", type=float, default=6.0)
    p.add_argument("--out", type=Path, default=RESULTS / "long_context.json")
    args = p.parse_args()
    pin = shutil.which("taskset") is not None and len(os.sched_getaffinity(0)) >= 2
    cpus = sorted(os.sched_getaffinity(0))[:2] if pin else [None, None]
    logs = Path(tempfile.mkdtemp(prefix="long-context-"))
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    results = {c: [] for c in CONDITIONS}
    with contextlib.ExitStack() as stack:
        for i, (port, url) in enumerate(zip(ports, urls)):
            print(f"starting replica {i + 1} (compiles its buckets; minutes the first time)",
                  flush=True)
            cpu = None if cpus[i] is None else str(cpus[i])
            stack.enter_context(server_process(replica_cmd(args.model, port, cpu, 10 * i),
                                               url + "/health", logs / f"replica-{i}.log"))
        gateways = {}
        for kind in ("split", "single"):
            config = logs / f"{kind}.json"
            config.write_text(json.dumps(gateway_config(kind, urls, args.model)))
            port = free_port()
            gateways[kind] = f"http://127.0.0.1:{port}"
            cmd = [sys.executable, "-m", "jaxserve.cli", "route", "--config", str(config),
                   "--port", str(port), "--batch-db", str(logs / f"{kind}.sqlite")]
            stack.enter_context(server_process(cmd, gateways[kind] + "/health",
                                               logs / f"gateway-{kind}.log", 120, cwd=ROOT))
        for r in range(args.rounds):
            order = CONDITIONS[r % 4:] + CONDITIONS[:r % 4]
            for kind, long in order:
                print(f"round {r + 1}/{args.rounds}: {kind} pool(s), "
                      f"{'with' if long else 'without'} long prompts ...", flush=True)
                results[(kind, long)].append(measure(gateways[kind], args, long, seed=r))
                print("  " + json.dumps(results[(kind, long)][-1]), flush=True)
    report = summarize(results, args, cpus)
    print(report["markdown"])
    write_json(args.out, report)
    plot(report, args.out.with_suffix(".png"))
    (args.out.with_suffix(".md")).write_text(report["markdown"] + "\n")
    print(f"wrote {args.out}, .md and .png")


def summarize(results: dict, args, cpus) -> dict:
    median = {f"{kind}/{'long' if long else 'none'}": {
        key: statistics.median(run[key] for run in runs)
        for key in ("ttft_p95_ms", "itl_p95_ms", "ttft_p50_ms", "itl_p50_ms")}
        for (kind, long), runs in results.items()}
    ratios = {kind: {key: median[f"{kind}/long"][key] / median[f"{kind}/none"][key]
                     for key in ("ttft_p95_ms", "itl_p95_ms")} for kind in ("split", "single")}
    rows = [[f"{kind}, {'with' if long else 'without'} long prompts",
             fmt(median[f"{kind}/{'long' if long else 'none'}"]["ttft_p95_ms"], 0),
             fmt(median[f"{kind}/{'long' if long else 'none'}"]["itl_p95_ms"], 0)]
            for kind, long in CONDITIONS]
    rows += [[f"{kind}: with ÷ without", fmt(ratios[kind]["ttft_p95_ms"], 2) + "×",
              fmt(ratios[kind]["itl_p95_ms"], 2) + "×"] for kind in ("split", "single")]
    markdown = (f"CPU: {cpu_description()['model']}. Ordinary load: {args.concurrency} "
                "streams, 100-300 prompt tokens, 64 out; "
                f"long prompts: {args.long_tokens} tokens every {args.long_every_s:g} s; "
                f"{args.rounds} rounds of {args.round_s:g} s per condition, interleaved "
                f"(medians); replicas pinned to CPUs {cpus}, the second at nice 10.\n\n"
                + markdown_table(["ordinary requests", "TTFT p95 ms", "ITL p95 ms"], rows))
    return {"cpu": cpu_description(), "args": {k: str(v) for k, v in vars(args).items()},
            "runs": {f"{k}/{'long' if long else 'none'}": v for (k, long), v in results.items()},
            "median": median, "ratios": ratios, "markdown": markdown}


def plot(report: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, title in zip(axes, ("ttft_p95_ms", "itl_p95_ms"), ("TTFT p95", "ITL p95")):
        names = list(report["median"])
        ax.bar(names, [report["median"][n][key] for n in names],
               color=["tab:blue", "tab:cyan", "tab:red", "tab:orange"])
        ax.set_title(f"ordinary requests' {title} (ms)")
        ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
