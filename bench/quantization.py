"""Quantization on this machine: accuracy against f32, memory, step time and speed.

    .venv/bin/python bench/quantization.py [--weight-dtypes f32,bf16,int8,fp8]
        [--kv-dtypes int8,fp8] [--model PATH] [--steps 20]
        [--out bench/results/quantization.json]

Conditions, side by side: each --weight-dtype with the KV in f32 (keyed by its name; f32,
the first, is the reference; bf16 runs on a bf16 CPU kernel (AMX, AVX512-BF16) where the
CPU has one, and then also through XLA, keyed "bf16-xla"; auto is what the engine picks
here), and each
--kv-dtype with f32 weights (keyed "kv-int8", "kv-fp8") and, where auto runs, with auto's
weights too ("auto-kv-int8"). For each:
- accuracy, through a live `jaxserve serve --weight-dtype W --kv-dtype K` (the
  lm-evaluation-harness path: /v1/completions with `echo` and `logprobs`):
  - log-likelihood: the mean log-probability per token of a fixed text (Python's own
    LICENSE.txt, ~2,900 tokens; its sha256 is recorded), and its relative difference to
    f32's, against the bound each must meet (weights int8 1 %, fp8 2 %, bf16 1 %; KV
    int8 and fp8 1 %);
  - greedy agreement: the 5 reference prompts × 32 greedy tokens (EOS ignored); per
    prompt, the tokens identical to f32's before the first divergence;
- memory: the weights' bytes on the device and the KV bytes per token, as the engine
  counts them, beside the planner's KV bytes per token for the same model and dtype;
- speed: output tok/s at concurrency 16 through the same server (bench/serve.py: 48
  streamed requests, 100-300 prompt tokens, 128 out), and, in process, the decode step
  time (median of --steps) at batch 1 and 16 with 256 tokens of context, the conditions
  interleaved step by step so that the machine's drift reaches each alike.

Writes the JSON (machine, commands, every figure), a markdown table beside it and a plot.
"""

import argparse
import hashlib
import json
import shlex
import statistics
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

from common import (
    REFERENCE_PROMPTS,
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
from steps import fabricated_step

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"  # fixed, natural English
NEW_TOKENS = 32
# |ΔLL| ÷ |LL| each condition must meet
BOUNDS = {"auto": 0.01, "auto-int8": 0.01, "f32": 0.0, "bf16": 0.01, "bf16-xla": 0.01,
          "int8": 0.01, "fp8": 0.02,
          "kv-bf16": 0.01, "kv-int8": 0.01, "kv-fp8": 0.01, "auto-kv-bf16": 0.01,
          "auto-kv-int8": 0.01, "auto-kv-fp8": 0.01}
MAX_MODEL_LEN = 4096


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as resp:
        return json.load(resp)


def log_likelihood(url: str, model: str, text: str) -> tuple[float, int]:
    """Mean log-probability per token of `text` (every token after the first), and the
    number of tokens scored."""
    answer = post(url, {"model": model, "prompt": text, "max_tokens": 1, "echo": True,
                        "logprobs": 0, "temperature": 0})
    prompt_tokens = answer["usage"]["prompt_tokens"]
    scored = answer["choices"][0]["logprobs"]["token_logprobs"][1:prompt_tokens]
    return statistics.fmean(scored), len(scored)


def greedy_tokens(url: str, model: str) -> list[list[str]]:
    """Each reference prompt's 32 greedy tokens, as token strings."""
    return [
        post(url, {"model": model, "prompt": p, "max_tokens": NEW_TOKENS, "temperature": 0,
                   "ignore_eos": True, "logprobs": 0})["choices"][0]["logprobs"]["tokens"]
        for p in REFERENCE_PROMPTS
    ]


def agreement(a: list[str], b: list[str]) -> int:
    """Tokens identical before the first divergence."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def conditions(weight_dtypes: list[str], kv_dtypes: list[str], kernel: bool, int8: bool
               ) -> dict[str, tuple[str, str, str, str]]:
    """Each condition's name and its (weight dtype, KV dtype, linear backend, linear
    activations); `kernel`: a bf16 CPU kernel (AMX, AVX512-BF16) serves bf16 here, so XLA's
    bf16 runs beside it; `int8`: Q4_1 weights can take int8 activations here, so auto runs
    with them too ("auto-int8")."""
    out = {"f32": ("f32", "auto", "auto", "auto")}
    for w in weight_dtypes:
        out[w] = (w, "auto", "auto", "auto")
        if w == "bf16" and kernel:
            out["bf16-xla"] = (w, "auto", "xla", "auto")
        if w == "auto" and int8:
            out["auto-int8"] = (w, "auto", "auto", "int8")
    out.update({f"kv-{k}": ("f32", k, "auto", "auto") for k in kv_dtypes})
    if "auto" in weight_dtypes:  # what a user of the default would turn on
        out.update({f"auto-kv-{k}": ("auto", k, "auto", "auto") for k in kv_dtypes})
    return out


def serve_and_measure(model: Path, name: str, weight_dtype: str, kv_dtype: str,
                      linear_backend: str, activations: str, text: str) -> dict:
    """Start a server storing its weights and KV as told; score, generate, load it."""
    port = free_port()
    cmd = [sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model),
           "--port", str(port), "--weight-dtype", weight_dtype, "--kv-dtype", kv_dtype,
           "--linear-backend", linear_backend, "--linear-activations", activations,
           "--max-model-len", str(MAX_MODEL_LEN),
           "--compilation-cache-dir", str(ROOT / ".cache" / "jax")]
    url = f"http://127.0.0.1:{port}"
    log = ROOT / ".cache" / f"quantization-{name}.log"
    with server_process(cmd, url + "/health", log, cwd=ROOT):
        with urllib.request.urlopen(url + "/v1/models") as resp:
            card = json.load(resp)["data"][0]
        ll, scored = log_likelihood(url, card["id"], text)
        tokens = greedy_tokens(url, card["id"])
        workload = Workload(requests=48, concurrency=16, prompt_tokens=Lengths(100, 300),
                            output_tokens=Lengths(128, 128), seed=0)
        report = run(url, None, workload)
    return {"command": shlex.join(cmd), "stored": card["weight_dtype"],
            "kv_stored": card["kv_dtype"], "log_likelihood": ll,
            "tokens_scored": scored, "greedy": tokens,
            "output_tokens_per_s_c16": report["output_tokens_per_s"],
            "tpot_ms_p50_c16": report["tpot_ms"]["p50"],
            "ttft_ms_p50_c16": report["ttft_ms"]["p50"]}


def memory(llm) -> dict:
    """The weights' bytes and the KV bytes per token as the engine holds them, and the
    planner's figures for the same model and dtypes."""
    from jaxserve import planner
    from jaxserve.device.kv_cache import storage_name  # a dtype's short name: f32, int8, ...

    c = llm.config
    return {
        "weight_bytes": llm.weight_bytes,
        "planner_weight_bytes": planner.stored_weight_bytes(
            planner.shape_of(c, "served"),
            llm.weight_dtype if llm.weight_dtype == "q4_1" else storage_name(llm.weight_dtype),
            storage_name(llm.dtype), packed=llm.linear_backend != "xla",
            head_copy=llm.linear_backend == "xla" and "lm_head" in llm.runner.state),
        "kv_bytes_per_token": llm.kv_bytes_per_token,
        "planner_kv_bytes_per_token": planner.kv_bytes_per_token(
            c.num_layers, c.num_kv_heads, c.head_dim, llm.kv_dtype),
    }


def step_times(model: Path, conds: dict[str, tuple[str, str, str, str]], steps: int) -> dict:
    """Decode step time at batch 1 and 16 per condition, interleaved, in process; the
    weights' bytes on the device, and the KV bytes per token (the engine's and the
    planner's)."""
    from jaxserve import LLM
    from jaxserve.host.page_allocator import PageAllocator

    out: dict = {}
    llms = {name: LLM(model, weight_dtype=w, kv_dtype=k, linear_backend=b,
                      linear_activations=a, max_batch=16, token_budget=16, num_pages=512,
                      max_model_len=1024, buckets=((1, 16), (1, 16)))
            for name, (w, k, b, a) in conds.items()}
    plans = {}
    for name, llm in llms.items():
        out[name] = {"weight_dtype": conds[name][0], "kv_dtype": llm.kv_dtype,
                     "weight_storage": llm.weight_dtype, "attention_backend": llm.runner.backend,
                     "linear_backend": llm.linear_backend,
                     "linear_activations": llm.linear_activations,
                     **memory(llm)}
        allocator = PageAllocator(512)
        plans[name] = {b: fabricated_step(allocator, (b, b), b, 1, 256, llm.runner.page_size,
                                          llm.config.vocab_size) for b in (1, 16)}
        for plan in plans[name].values():  # compile and warm
            llm.runner.execute(plan)
            llm.runner.execute(plan)
    times: dict = {(name, b): [] for name in conds for b in (1, 16)}
    for i in range(steps):
        print(f"\rstep times: {i + 1}/{steps}", end="", file=sys.stderr, flush=True)
        for name, b in times:
            start = time.perf_counter()
            llms[name].runner.execute(plans[name][b])
            times[name, b].append(time.perf_counter() - start)
    print(file=sys.stderr)
    for (name, b), ts in times.items():
        out[name][f"step_ms_b{b}"] = statistics.median(ts) * 1e3
    return out


def markdown(report: dict) -> str:
    ref = report["results"][report["reference"]]
    rows = []
    for name, r in report["results"].items():
        agree = [agreement(a, b) for a, b in zip(r["greedy"], ref["greedy"])]
        kv, weights = f"{r['kv_bytes_per_token']:,}", fmt(r["weight_bytes"] / 2**20)
        if r["planner_kv_bytes_per_token"] != r["kv_bytes_per_token"]:
            kv += f" (planner: {r['planner_kv_bytes_per_token']:,})"
        if r.get("planner_weight_bytes") != r["weight_bytes"]:
            weights += f" (planner: {fmt(r.get('planner_weight_bytes', 0) / 2**20)})"
        rows.append([
            name, r["stored"], r["kv_stored"], weights, kv,
            fmt(r["log_likelihood"], 4),
            f"{100 * r['ll_relative_diff']:.2f} % (≤ {100 * BOUNDS[name]:g} %: "
            f"{'ok' if r['ll_ok'] else 'FAILS'})",
            " ".join(f"{a}/{NEW_TOKENS}" for a in agree), fmt(r["step_ms_b1"]),
            fmt(r["step_ms_b16"]), fmt(r["output_tokens_per_s_c16"]),
        ])
    table = markdown_table(
        ["condition", "weights", "KV", "weights MiB (= planner)", "KV B/token (= planner)",
         "mean log-lik/token", "ΔLL vs f32", "greedy agreement (5 prompts)",
         "decode step b=1 ms", "b=16 ms", "tok/s @ c=16"],
        rows)
    text = report["text"]
    return (f"CPU: {report['cpu']['model']}. Text: {text['path']} ({text['tokens_scored']} "
            f"tokens scored, sha256 {text['sha256'][:12]}).\n\n{table}")


def plot(report: dict, path: Path) -> str | None:
    plt = pyplot()
    if plt is None:
        return None
    names = list(report["results"])
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, label in zip(axes, ("step_ms_b1", "step_ms_b16", "output_tokens_per_s_c16"),
                              ("decode step, batch 1 (ms)", "decode step, batch 16 (ms)",
                               "output tok/s at concurrency 16")):
        ax.bar(names, [report["results"][n][key] for n in names])
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--weight-dtypes", default="auto,bf16,int8,fp8",
                        help="beside f32, the reference, which always runs")
    parser.add_argument("--kv-dtypes", default="int8,fp8")
    parser.add_argument("--model", type=Path, default=GGUF)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", type=Path, default=RESULTS / "quantization.json")
    args = parser.parse_args()
    from jaxserve.cpu_kernels import linear

    weight_dtypes, kv_dtypes = ([x.strip() for x in arg.split(",") if x.strip() not in ("", "f32")]
                                for arg in (args.weight_dtypes, args.kv_dtypes))
    kernel = linear.select("auto", "bfloat16", "float32", True) != "xla"
    conds = conditions(weight_dtypes, kv_dtypes, kernel, linear.int8_available())
    text = TEXT.read_text()
    results = step_times(args.model, conds, args.steps)
    for name, (w, k, b, a) in conds.items():
        print(f"serving --weight-dtype {w} --kv-dtype {k} --linear-backend {b} "
              f"--linear-activations {a} ...", file=sys.stderr, flush=True)
        results[name].update(serve_and_measure(args.model, name, w, k, b, a, text))
    reference = next(iter(conds))
    base = results[reference]["log_likelihood"]
    for name, r in results.items():
        r["ll_relative_diff"] = abs(r["log_likelihood"] - base) / abs(base)
        r["ll_ok"] = r["ll_relative_diff"] <= BOUNDS[name]
    report = {
        "cpu": cpu_description(), "command": "bench/quantization.py " + shlex.join(sys.argv[1:]),
        "model": str(args.model), "reference": reference,
        "text": {"path": str(TEXT), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                 "tokens_scored": results[reference]["tokens_scored"]},
        "results": results,
    }
    report["plot"] = plot(report, args.out.with_suffix(".png"))
    write_json(args.out, report)
    text_md = markdown(report)
    args.out.with_suffix(".md").write_text(text_md + "\n")
    print(text_md)
    print(f"\nwrote {args.out}, its .md and .png")


if __name__ == "__main__":
    main()
