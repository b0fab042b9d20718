"""jaxserve against the peers a user would pick instead, on one workload, on this machine.

    .venv/bin/python bench/peers.py [--peers jaxserve,llamacpp,transformers]
        [--concurrency 1,4,16] [--rounds 8] [--prompt-tokens 128] [--output-tokens 64]
        [--out bench/results/peers.json]
    .venv/bin/python bench/peers.py --quick     # concurrency 1,2; 2 rounds; 16 + 8 tokens

At each concurrency C the workload is bench/serve.py's: C requests in flight (a closed
loop), C × rounds requests, the same prompts (same seed) and output lengths for every peer.

- jaxserve: `jaxserve serve` on the GGUF file (dequantised to f32 on CPU), measured over
  HTTP by bench/serve.py's `run`.
- llamacpp: llama-cpp-python's OpenAI server on the same GGUF file (its Q4_1 kernels),
  measured by the same `run`. It lives in its own virtual environment,
  .cache/peers/llamacpp-venv, installed on first use: PyPI has no wheel for Linux, so pip
  compiles llama.cpp (minutes on a few cores; `nice`d; the log is kept beside the venv).
  Its server runs one request at a time (queued: `--interrupt_requests False`, or a new
  request would cut the running one short). It does not report streamed usage, so its output
  tokens are its text chunks counted (one a token); `min_tokens` holds off EOS.
- transformers: `generate` with static batching, measured in process (no HTTP shim, so it
  pays no HTTP or detokenisation cost): the requests in batches of C, left-padded, each
  batch run to its longest output; a stopping-criteria hook stamps every step. A request is
  sent when its batch starts (the previous batch has ended, as in the closed loop); its TTFT
  is the batch's first token, its end its own last token.

Ratios are jaxserve ÷ peer: above 1 is better for jaxserve in tokens/s, below 1 in latency.
"""

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from common import RESULTS, fmt, free_port, markdown_table, server_process, write_json
from serve import Lengths, Outcome, Workload, run, summarize_outcomes

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = ROOT / ".cache" / "peers"
LLAMACPP_VENV = CACHE / "llamacpp-venv"
PEERS = ("jaxserve", "llamacpp", "transformers")
METRICS = (  # (label, key in a serve.py report, percentile or None)
    ("output tok/s", "output_tokens_per_s", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p95 ms", "ttft_ms", "p95"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("TPOT p95 ms", "tpot_ms", "p95"),
)


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or started here; the message says why."""


def compact(report: dict) -> dict:
    """A serve.py report without its per-request rows and timeline."""
    return {k: v for k, v in report.items() if k not in ("requests", "timeline")}


def run_jaxserve(gguf: Path, workloads: dict[int, Workload], quick: bool) -> dict:
    port = free_port()
    budget = "16" if quick else "128"  # 30 buckets at batch 16: a few minutes of warm-up
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(gguf), "--port", str(port),
        "--max-batch", str(max(workloads)), "--token-budget", budget,
        # warm-up times every bucket at the end of the context: the model's 8,192
        # tokens would make it take most of an hour on a CPU
        "--max-model-len", "1024",
        "--compilation-cache-dir", str(ROOT / ".cache" / "jax"),
    ]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url + "/health", CACHE / "jaxserve-server.log", cwd=ROOT):
        return {str(c): compact(run(url, None, w)) for c, w in workloads.items()}


def llamacpp_python(install: bool) -> Path:
    """The llamacpp venv's python, installing llama-cpp-python[server] there if needed."""
    python = LLAMACPP_VENV / "bin" / "python"
    log = CACHE / "llamacpp-install.log"
    if python.exists() and _imports(python, "llama_cpp.server"):
        return python
    if not install:
        raise PeerUnavailable(f"no llama-cpp-python in {LLAMACPP_VENV} (and --no-install)")
    base = shutil.which("python3.11") or sys.executable
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"installing llama-cpp-python into {LLAMACPP_VENV} (compiles llama.cpp; log: {log})",
          file=sys.stderr)
    env = {**os.environ, "CMAKE_ARGS": "-DLLAVA_BUILD=OFF",
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    start = time.monotonic()
    with open(log, "w") as out:
        steps = [
            [base, "-m", "venv", str(LLAMACPP_VENV)],
            ["nice", "-n", "19", str(python), "-m", "pip", "install", "llama-cpp-python[server]"],
        ]
        for cmd in steps:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode:
                tail = log.read_text().strip().splitlines()[-3:]
                raise PeerUnavailable(f"{' '.join(cmd[-2:])} failed: {' / '.join(tail)}")
    print(f"installed in {time.monotonic() - start:.0f}s", file=sys.stderr)
    return python


def _imports(python: Path, module: str) -> bool:
    check = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True)
    return check.returncode == 0


def run_llamacpp(gguf: Path, workloads: dict[int, Workload], install: bool) -> dict:
    python = llamacpp_python(install)
    port = free_port()
    cmd = [
        str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1",
        "--port", str(port), "--n_ctx", "4096", "--n_threads", str(os.cpu_count() or 1),
        # by default a new request interrupts the one being generated: queue them instead
        "--interrupt_requests", "False",
    ]
    url = f"http://127.0.0.1:{port}"
    with server_process(cmd, url + "/v1/models", CACHE / "llamacpp-server.log"):
        return {str(c): compact(run(url, None, w)) for c, w in workloads.items()}


def run_transformers(model_path: Path, workloads: dict[int, Workload]) -> dict:
    """Static batching with `generate`, in process (see the module docstring); `model_path`
    is a GGUF file or a Hugging Face directory."""
    try:
        import torch
        import transformers
    except ImportError as err:
        raise PeerUnavailable(f"transformers is not installed: {err}") from None
    source = {"pretrained_model_name_or_path": model_path}
    if model_path.suffix == ".gguf":
        source = {"pretrained_model_name_or_path": model_path.parent, "gguf_file": model_path.name}
    tokenizer = transformers.AutoTokenizer.from_pretrained(**source)
    tokenizer.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    model.eval()
    if tokenizer.pad_token is None:  # left padding is masked out: any token will do
        tokenizer.pad_token = tokenizer.eos_token
    pad = tokenizer.pad_token_id
    results = {}
    for concurrency, workload in workloads.items():
        requests = list(itertools.islice(workload.prompts(), workload.requests))
        outcomes: list[Outcome] = []
        t0 = time.perf_counter()
        for i in range(0, len(requests), concurrency):
            batch = requests[i : i + concurrency]
            outcomes += _static_batch(model, tokenizer, pad, batch, t0)
        duration = max(o.end for o in outcomes)
        report = summarize_outcomes(outcomes, duration, workload)
        results[str(concurrency)] = {k: v for k, v in report.items() if k != "timeline"}
    return results


def _static_batch(model, tokenizer, pad: int, batch: list[tuple[str, int]], t0: float):
    """One `generate` call over the batch; an Outcome per request from per-step stamps."""
    import torch
    import transformers

    stamps: list[float] = []

    class Stamp(transformers.StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
            stamps.append(time.perf_counter() - t0)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    texts, max_tokens = zip(*batch)
    encoded = tokenizer(list(texts), return_tensors="pt", padding=True)
    longest = max(max_tokens)
    sent = time.perf_counter() - t0
    with torch.inference_mode():
        model.generate(
            **encoded, max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
            stopping_criteria=transformers.StoppingCriteriaList([Stamp()]), pad_token_id=pad,
        )
    prompt_lengths = encoded["attention_mask"].sum(dim=1).tolist()
    return [
        Outcome(
            sent, int(n), m, status="ok", ttft=stamps[0] - sent, e2e=stamps[m - 1] - sent,
            end=stamps[m - 1], output_tokens=m, chunk_times=stamps[:m],
        )
        for n, m in zip(prompt_lengths, max_tokens)
    ]


def value(report: dict, key: str, percentile: str | None) -> float | None:
    return report[key] if percentile is None else report[key][percentile]


def ratio_rows(results: dict, levels: list[int]) -> tuple[list[list[str]], dict]:
    """Table rows (metric at each concurrency, each peer, jaxserve ÷ each peer) and the
    ratios as a dict: peer -> concurrency -> metric -> ratio."""
    ok = {p: r["levels"] for p, r in results.items() if r["status"] == "ok"}
    others = [p for p in ok if p != "jaxserve"]
    ratios: dict = {p: {} for p in others}
    rows = []
    for c, (label, key, pct) in itertools.product(levels, METRICS):
        cells = {p: value(ok[p][str(c)], key, pct) for p in ok}
        row = [f"{label} @ {c}", *(fmt(cells[p]) for p in ok)]
        for p in others:
            mine, theirs = cells.get("jaxserve"), cells[p]
            r = mine / theirs if mine is not None and theirs else None
            ratios[p].setdefault(str(c), {})[f"{key}{'_' + pct if pct else ''}"] = r
            if "jaxserve" in ok:
                row.append(fmt(r, 2))
        rows.append(row)
    headers = ["metric @ concurrency", *ok]
    if "jaxserve" in ok:
        headers += [f"jaxserve ÷ {p}" for p in others]
    return [headers, *rows], ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset")
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=8, help="requests = rounds × concurrency")
    parser.add_argument("--prompt-tokens", type=Lengths.parse, default=Lengths(128, 128))
    parser.add_argument("--output-tokens", type=Lengths.parse, default=Lengths(64, 64))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny: 1,2 / 2 rounds / 16 + 8")
    parser.add_argument("--no-install", action="store_true", help="never build llama-cpp-python")
    parser.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    args = parser.parse_args()
    if args.quick:
        args.concurrency, args.rounds = "1,2", 2
        args.prompt_tokens, args.output_tokens = Lengths(16, 16), Lengths(8, 8)
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := set(peers) - set(PEERS):
        parser.error(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    workloads = {
        c: Workload(
            requests=c * args.rounds, concurrency=c, prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens, seed=args.seed,
        )
        for c in levels
    }
    how = {
        "jaxserve": "jaxserve serve (f32 on CPU) over HTTP, bench/serve.py",
        "llamacpp": "llama-cpp-python[server] (Q4_1) over HTTP, bench/serve.py",
        "transformers": "transformers generate, static batching, in process (no HTTP)",
    }
    runners: dict[str, Callable[[], dict]] = {
        "jaxserve": lambda: run_jaxserve(args.gguf, workloads, args.quick),
        "llamacpp": lambda: run_llamacpp(args.gguf, workloads, not args.no_install),
        "transformers": lambda: run_transformers(args.gguf, workloads),
    }
    results = {}
    for peer in peers:
        print(f"{peer}: {how[peer]} ...", file=sys.stderr)
        start = time.monotonic()
        try:
            results[peer] = {"status": "ok", "how": how[peer], "levels": runners[peer]()}
        except (PeerUnavailable, RuntimeError, OSError, ValueError) as err:
            results[peer] = {"status": "unavailable", "how": how[peer], "reason": str(err)}
        results[peer]["seconds"] = time.monotonic() - start

    w = next(iter(workloads.values()))
    print(f"prompts {w.prompt_tokens} tokens, outputs {w.output_tokens}, {args.rounds} rounds "
          f"at each concurrency {levels}; jaxserve ÷ peer: > 1 is better for jaxserve in tok/s, "
          f"< 1 in latency\n")
    table, ratios = ratio_rows(results, levels)
    if len(table[0]) > 1:
        print(markdown_table(table[0], table[1:]))
    for peer, r in results.items():
        if r["status"] != "ok":
            print(f"\n{peer}: unavailable: {r['reason']}")
    write_json(args.out, {
        "gguf": str(args.gguf),
        "workload": {"concurrency": levels, "rounds": args.rounds, "seed": args.seed,
                     "prompt_tokens": str(args.prompt_tokens),
                     "output_tokens": str(args.output_tokens)},
        "peers": results,
        "ratios": ratios,
    })
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
