"""The GPU suite's serving part: SmolLM2 served by `jaxserve serve`, its greedy tokens against
the CPU's, and a short closed-loop load.

    python bench/gpu_serving.py --out OUT/serving.json [--profile gpu|reduced|dry]
        [--reference bench/results/gpu/cpu_greedy.json] [--write-reference PATH]

1. Start-up: `jaxserve serve` with the default model (SmolLM2-135M-Instruct's GGUF, f32, the
   platform's attention backend, XLA's f32 projections: a GPU's only kind, and on a CPU the
   exact f32 the tests hold to transformers, not the bf16 kernels a CPU serves with by
   default), timed from launch to a 200 from /health (load, compile and time every bucket).
2. Greedy: each reference prompt (those of tests/test_smollm2_vs_transformers.py, which hold
   the CPU engine token-identical to transformers) through /v1/completions at temperature 0
   with `ignore_eos`, with each token's logprob and top alternatives. Against the reference
   (the same requests served on a CPU, written by `--write-reference`): identical or not,
   the first token that differs, the largest logprob gap over the tokens before it, and the
   CPU's margin between its top two tokens there (a near tie that f32 rounding can flip, or a
   real fault).
3. Load: bench/serve.py's closed loop at concurrency 1 and 64 (streamed completions,
   `ignore_eos`): tokens/s, TTFT and TPOT.

`--max-queue` lifts the admission bound for the load (the bound's defect at concurrency =
max batch is the reliability issue's).
"""

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from common import PartReport, cpu_description, fmt, free_port, markdown_table, server_process
from serve import Lengths, Workload, run

from jaxserve.checkpoint.default_model import default_model_path

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "bench" / "results" / "gpu" / "cpu_greedy.json"
PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "Les fleurs du printemps sont",
)


@dataclass(frozen=True, slots=True)
class Profile:
    max_batch: int
    token_budget: int
    buckets: str  # --buckets: a few shapes, so the start-up compiles stay within the limit
    new_tokens: int  # greedy tokens per reference prompt
    loads: tuple[tuple[int, int], ...]  # (concurrency, requests)
    prompt_tokens: int
    output_tokens: int
    start_timeout_s: float  # under the suite's limit, so a slow start is reported, not killed


PROFILES = {
    # On an H200 each f32 bucket took ~7 s to build (ptxas on the f32 attention kernel):
    # 35 power-of-two buckets, or 14 from 1,4,16,64, did not finish in 100 s. Three (and two
    # prompt-logprob passes) serve decodes alone and everything else padded to 64.
    "gpu": Profile(64, 64, "1,64:1,64", 32, ((1, 8), (64, 128)), 128, 64, 125.0),
    "reduced": Profile(4, 16, "1,4,16:1,4", 32, ((1, 2), (4, 8)), 32, 16, 125.0),
    "dry": Profile(2, 8, "1,8:1,2", 4, ((1, 1), (2, 2)), 8, 4, 125.0),
}


def post(base_url: str, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        base_url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def greedy(base_url: str, model: str, new_tokens: int) -> list[dict]:
    """Each prompt's greedy continuation, its tokens and their logprobs."""
    answers = []
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True, "logprobs": 2}
        choice = post(base_url, "/v1/completions", body)["choices"][0]
        logprobs = choice["logprobs"]
        answers.append({
            "prompt": prompt, "text": choice["text"], "tokens": logprobs["tokens"],
            "token_logprobs": logprobs["token_logprobs"],
            "top_logprobs": logprobs["top_logprobs"],
        })
    return answers


def compare(got: list[dict], want: list[dict]) -> list[dict]:
    """Per prompt: identical, the first differing token, the largest logprob gap before it
    and the reference's top-two margin at it."""
    rows = []
    for g, w in zip(got, want):
        n = min(len(g["tokens"]), len(w["tokens"]))
        first = next((i for i in range(n) if g["tokens"][i] != w["tokens"][i]), None)
        agree = n if first is None else first
        gaps = [abs(a - b) for a, b in zip(g["token_logprobs"][:agree],
                                           w["token_logprobs"][:agree])]
        margin = None
        if first is not None:
            top = sorted(w["top_logprobs"][first].values(), reverse=True)
            margin = top[0] - top[1] if len(top) > 1 else None
        rows.append({
            "prompt": g["prompt"], "identical": g["tokens"] == w["tokens"],
            "first_difference": first, "tokens": len(g["tokens"]),
            "max_logprob_gap": max(gaps, default=0.0), "reference_margin": margin,
        })
    return rows


def load_summary(report: dict, concurrency: int) -> dict:
    return {
        "concurrency": concurrency, "sent": report["num_sent"],
        "completed": report["num_completed"], "num_429": report["num_429"],
        "errors": report["num_errors"], "duration_s": report["duration_s"],
        "output_tokens_per_s": report["output_tokens_per_s"],
        "ttft_p50_ms": report["ttft_ms"]["p50"], "ttft_p95_ms": report["ttft_ms"]["p95"],
        "tpot_p50_ms": report["tpot_ms"]["p50"], "tpot_p95_ms": report["tpot_ms"]["p95"],
    }


def markdown(data: dict) -> str:
    parts = [
        f"`{data['command']}`: healthy after {fmt(data.get('start_s'), 1)} s "
        "(load, compile and time every bucket)"
    ]
    greedy_rows = data.get("greedy_vs_reference")
    if greedy_rows:
        parts.append(
            f"Greedy tokens against the reference ({data['reference']})\n\n" + markdown_table(
                ["prompt", "identical", "first difference", "max logprob gap before",
                 "reference top-2 margin there"],
                [[json.dumps(r["prompt"])[:40], "yes" if r["identical"] else "NO",
                  "" if r["first_difference"] is None
                  else f"token {r['first_difference']} of {r['tokens']}",
                  f"{r['max_logprob_gap']:.1e}",
                  "" if r["reference_margin"] is None else f"{r['reference_margin']:.3f}"]
                 for r in greedy_rows],
            )
        )
    elif "greedy" in data:
        parts.append(f"Greedy tokens: {len(data['greedy'])} prompts served; "
                     f"{data.get('reference_note', 'no reference compared')}")
    loads = data["results"]
    if loads:
        w = data["workload"]
        parts.append(
            f"Closed-loop load ({w['prompt_tokens']}-token prompts, {w['output_tokens']} "
            "tokens out, streamed)\n\n" + markdown_table(
                ["concurrency", "completed", "429", "errors", "output tok/s", "TTFT p50 ms",
                 "TTFT p95 ms", "TPOT p50 ms", "TPOT p95 ms"],
                [[r["concurrency"], f"{r['completed']}/{r['sent']}", r["num_429"], r["errors"],
                  fmt(r["output_tokens_per_s"]), fmt(r["ttft_p50_ms"]), fmt(r["ttft_p95_ms"]),
                  fmt(r["tpot_p50_ms"], 2), fmt(r["tpot_p95_ms"], 2)] for r in loads],
            )
        )
    return "\n\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", choices=tuple(PROFILES), default="gpu")
    parser.add_argument("--reference", type=Path, default=REFERENCE,
                        help="greedy answers served on a CPU (default %(default)s)")
    parser.add_argument("--write-reference", type=Path,
                        help="write this run's greedy answers as a reference (run it on a CPU)")
    parser.add_argument("--server-log", type=Path, help="default: beside --out")
    args = parser.parse_args()
    profile = PROFILES[args.profile]
    model = default_model_path(fetch=False)
    if not model.exists():
        print(f"{model} not found: run `make model`, or reassemble .gpu-wheels/ "
              "(bench/gpu_suite.sh does)", file=sys.stderr)
        return 2
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    cache = tempfile.mkdtemp(prefix="jaxserve-gpu-cache-")
    cmd = [
        sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(model), "--port",
        str(port), "--max-batch", str(profile.max_batch), "--token-budget",
        str(profile.token_budget), "--buckets", profile.buckets, "--max-queue", "1024",
        "--compilation-cache-dir", cache, "--dtype", "float32", "--linear-backend", "xla",
    ]
    workload = Workload(prompt_tokens=Lengths(profile.prompt_tokens, profile.prompt_tokens),
                        output_tokens=Lengths(profile.output_tokens, profile.output_tokens))
    report = PartReport(
        args.out, markdown, part="serving", profile=args.profile, model=str(model),
        command=" ".join(["jaxserve", *cmd[3:]]),
        workload={"prompt_tokens": profile.prompt_tokens,
                  "output_tokens": profile.output_tokens},
        cpu=cpu_description(),
    )
    log = args.server_log or args.out.with_name("server.log")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    start = time.perf_counter()
    with server_process(cmd, base_url + "/health", log, profile.start_timeout_s, env=env):
        report.update(start_s=time.perf_counter() - start)
        with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as response:
            model_id = json.load(response)["data"][0]["id"]
        answers = greedy(base_url, model_id, profile.new_tokens)
        report.update(greedy=answers)
        if args.write_reference:
            args.write_reference.parent.mkdir(parents=True, exist_ok=True)
            reference = {"cpu": cpu_description()["model"], "command": report.data["command"],
                         "new_tokens": profile.new_tokens, "answers": answers}
            args.write_reference.write_text(json.dumps(reference, indent=2) + "\n")
        elif args.reference.exists():
            reference = json.loads(args.reference.read_text())
            if reference["new_tokens"] == profile.new_tokens:
                report.update(reference=f"{args.reference.name}, served on {reference['cpu']}",
                              greedy_vs_reference=compare(answers, reference["answers"]))
            else:
                report.update(reference_note=f"{args.reference.name} holds "
                              f"{reference['new_tokens']} tokens a prompt, this profile "
                              f"{profile.new_tokens}: not compared")
        for concurrency, requests in profile.loads:
            load = replace(workload, requests=requests, concurrency=concurrency)
            result = run(base_url, model_id, load, progress=False)
            report.add(load_summary(result, concurrency))
            print(report.data["results"][-1], flush=True)
    report.update(complete=True)
    print(report.data["markdown"])
    same = all(r["identical"] for r in report.data.get("greedy_vs_reference", []))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
