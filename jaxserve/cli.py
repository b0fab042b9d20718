"""The `jaxserve` command: generate, convert, serve, plan."""

import argparse
import dataclasses
import gc
import json
import os
import re
import sys
import time
from pathlib import Path

from jaxserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    KV_DTYPES,
    LINEAR_ACTIVATIONS,
    LINEAR_BACKENDS,
    WEIGHT_DTYPES,
    EngineConfig,
)
from jaxserve.host.buckets import BucketTable

WEIGHT_DTYPE_HELP = (
    "how projection weights are stored: int8 or fp8 (e4m3) with a scale per output channel, "
    "or bf16/f32, each computed in --dtype; auto: in --dtype"
)
# the engine flags' defaults are EngineConfig's: one default per setting
DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jaxserve", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="print a completion of a prompt")
    gen.add_argument("prompt")
    gen.add_argument("--model", help="GGUF file, HF directory or converted checkpoint")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument(
        "--no-chat-template",
        action="store_true",
        help="complete the raw text instead of a one-message chat",
    )

    conv = commands.add_parser("convert", help="write an Orbax checkpoint of a model")
    conv.add_argument("src", help="GGUF file or HF directory")
    conv.add_argument("--out", required=True, type=Path)
    conv.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                      help=WEIGHT_DTYPE_HELP + "; stored so that a restart does not re-quantize")

    serve = commands.add_parser(
        "serve", help="serve the OpenAI-compatible HTTP API",
        description="Serve the OpenAI-compatible HTTP API. Start-up compiles every step "
        "shape (bucket) before serving, a line each (and /health says how many while it "
        "answers 503): minutes on a CPU the first time. To start fast, keep "
        "--compilation-cache-dir (a second start loads the compiled buckets instead of "
        "compiling them) and compile fewer buckets with --buckets (e.g. 1,16,256:1,16).",
    )
    serve.add_argument("--model", help="GGUF file, HF directory or converted checkpoint")
    serve.add_argument("--served-model-name", help="the model id clients name (default: file)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require this bearer key (also the admin key)")
    serve.add_argument("--api-keys-file",
                       help="JSON: key -> {tenant, priority, limits, admin, adapters}")
    serve.add_argument("--max-queue", type=int, help="fixed bound on queued requests")
    serve.add_argument(
        "--queue-wait-budget-ms",
        type=float,
        default=5000,
        help="queue bound = this budget x measured admission rate (Little's law)",
    )
    serve.add_argument("--max-queued-tokens", type=int, default=65536)
    serve.add_argument("--max-body-bytes", type=int, default=4 << 20)
    serve.add_argument("--drain-timeout", type=float, default=30.0, help="seconds, on SIGTERM")
    serve.add_argument(
        "--stream-write-timeout", type=float, default=30.0,
        help="seconds a stream write may block before the client is dropped",
    )
    serve.add_argument(
        "--max-connections", type=int, default=2048,
        help="open connections; past it a new one gets 503 at once",
    )
    serve.add_argument(
        "--request-read-timeout-s", type=float, default=30.0,
        help="seconds for a request's headers (from the connection's opening or last "
        "answer: idle connections close then), and again for its body; else it is closed",
    )
    serve.add_argument("--default-max-tokens", type=int, default=256, help="chat default")
    serve.add_argument(
        "--step-timeout-s", type=float,
        help="a step running longer fails the engine, every live request ends with an error "
        "and the process exits 1 (default: 10x the slowest warm-up step, at least 30)",
    )
    serve.add_argument(
        "--heap-trim-interval-s", type=float, default=10.0,
        help="return the C heap's free pages to the OS this often, so RSS follows what is "
        "held (glibc's malloc_trim, a few ms on a worker thread); 0: never",
    )
    serve.add_argument(
        "--shared-prefix-cache",
        action="store_true",
        help="one prefix cache for all tenants (default with API keys: one per tenant)",
    )
    serve.add_argument(
        "--enable-runtime-lora", action="store_true",
        help="serve LoRA adapters loaded at run time: POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (an admin key when keys are configured)",
    )
    hosts = serve.add_argument_group("multi-host (every process runs the same command)")
    hosts.add_argument("--coordinator", help="HOST:PORT of process 0's coordination service")
    hosts.add_argument("--num-processes", type=int, default=1)
    hosts.add_argument(
        "--process-id", type=int, default=0,
        help="0 serves HTTP and schedules; the others run process 0's steps",
    )
    _engine_flags(serve)

    _plan_flags(commands.add_parser("plan", help="size a deployment: KV pool, batch, replicas"))

    route = commands.add_parser(
        "route", help="the gateway: route the OpenAI API to pools of replicas",
        description="Serve the OpenAI API in front of pools of `jaxserve serve` replicas "
        "named in a TOML or JSON file: routing by model and prompt length, the Batch API "
        "on spare capacity (SQLite), guardrail checks. See examples/platform.toml.")
    route.add_argument("--config", required=True, type=Path, help="TOML or JSON pools file")
    route.add_argument("--spawn", action="store_true",
                       help="also start the pools' replicas and checkers named under spawn")
    route.add_argument("--host", help="overrides [gateway] host")
    route.add_argument("--port", type=int, help="overrides [gateway] port")
    route.add_argument("--batch-db", help="overrides [gateway] batch_db (the SQLite file)")

    args = parser.parse_args(argv)
    if args.command == "serve":
        try:  # engine flags that disagree: a usage error, before anything loads
            _engine_config(args)
            _connection_limits(args)
        except ValueError as err:
            serve.error(str(err))
    run = {"generate": _generate, "convert": _convert, "serve": _serve, "plan": _plan,
           "route": _route}
    return run[args.command](args)


def _generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    llm = LLM(model=args.model)
    prompt = args.prompt
    if not args.no_chat_template and llm.tokenizer.chat_template:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    (out,) = llm.generate(prompt, params)
    print(out.text)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from jaxserve.checkpoint import orbax_checkpoint
    from jaxserve.checkpoint.loader import load

    start = time.perf_counter()
    model, tokenizer = load(args.src, weight_dtype=args.weight_dtype)
    loaded = time.perf_counter()
    orbax_checkpoint.save(model, tokenizer, args.out, args.weight_dtype)
    print(
        f"loaded {args.src} in {loaded - start:.1f}s, wrote {args.out} "
        f"in {time.perf_counter() - loaded:.1f}s",
        file=sys.stderr,
    )
    return 0


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--max-batch", type=int, default=DEFAULTS["max_batch"])
    group.add_argument("--num-pages", type=int,
                       help=f"KV pages incl. the null page (default {DEFAULTS['num_pages']})")
    group.add_argument(
        "--kv-cache-bytes", type=_byte_size, metavar="SIZE",
        help="size the KV pool by memory instead of --num-pages, e.g. 768MiB or 2GB "
        "(per data shard, scales included): a smaller --kv-dtype holds more pages",
    )
    group.add_argument("--page-size", type=int, default=DEFAULTS["page_size"])
    group.add_argument("--token-budget", type=int, default=DEFAULTS["token_budget"],
                       help="tokens per step")
    group.add_argument("--max-model-len", type=int)
    group.add_argument(
        "--dtype", default=DEFAULTS["dtype"], choices=DTYPES,
        help="weights and activations; auto: float32 on CPU (faster there), bfloat16 on GPU",
    )
    group.add_argument("--weight-dtype", default=DEFAULTS["weight_dtype"],
                       choices=WEIGHT_DTYPES, help=WEIGHT_DTYPE_HELP + ", except bf16 on a "
                       "CPU kernel (--linear-backend: Intel AMX, AVX512-BF16) where the CPU has "
                       "one and --dtype is float32, and there a GGUF file's Q4_1 projections "
                       "kept as they are (the same results as bf16)")
    group.add_argument(
        "--kv-dtype", default=DEFAULTS["kv_dtype"], choices=KV_DTYPES,
        help="how KV pages are stored; auto: in --dtype, or bf16 where the projections "
        "take bf16 activations on a CPU kernel (--linear-activations); int8 keeps a "
        "scale per token and head; fp8 (e4m3) a center and scale per layer, head and "
        "channel, calibrated at start-up",
    )
    group.add_argument("--attention-backend", choices=ATTENTION_BACKENDS)
    group.add_argument(
        "--linear-backend", default=DEFAULTS["linear_backend"], choices=LINEAR_BACKENDS,
        help="how bf16 projections multiply: amx and avx512_bf16 pack them for a kernel on "
        "Intel AMX or AVX512-BF16 (one CPU device, --dtype float32); auto: the first of "
        "those that runs here, else xla",
    )
    group.add_argument(
        "--linear-activations", default=DEFAULTS["linear_activations"],
        choices=LINEAR_ACTIVATIONS,
        help="what a bf16 CPU kernel multiplies the weights by: bf16 rounds the activations "
        "(one pass, as vLLM's bf16 does), f32 keeps them (two passes: x times the bf16 "
        "weight, as XLA computes it; prefill ~1.6x slower), int8 quantizes them per block "
        "of 32 in two int8 terms for a GGUF file's Q4_1 projections (closer to f32 than "
        "bf16; AVX512-VNNI, no AMX: faster at one row, slower at prefill); auto: bf16",
    )
    group.add_argument("--tpot-slo-ms", type=float, help="cap the batch so steps stay under 60%%")
    group.add_argument(
        "--buckets", type=_bucket_table, metavar="TOKENS:ROWS",
        help="step shapes to compile, e.g. 1,8,64:1,8,64 (default: rows in powers of two up "
        "to --max-batch; tokens in powers of two up to half of --token-budget, then in "
        "eighths of it); fewer buckets start faster, at more padding",
    )
    group.add_argument(  # the server keeps a cache by default; the library writes no files
        "--compilation-cache-dir", default=".cache/jax",
        help="compiled buckets persist here: a second start loads them instead of compiling",
    )
    group.add_argument("--stream-buffer", type=int, default=DEFAULTS["stream_capacity"],
                       help="unread outputs a request keeps apart; past it they merge")
    group.add_argument("--no-prefix-cache", action="store_true", help="never reuse KV pages")
    group.add_argument(
        "--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
        help="plan each step while the one before computes (default: on)",
    )
    group.add_argument(
        "--speculative-config", type=_speculative_config, default={}, metavar="JSON",
        help='speculative decoding, as vLLM takes it: {"method": "ngram", '
        '"num_speculative_tokens": 3, "prompt_lookup_max": 4, "prompt_lookup_min": 2} drafts '
        "up to 3 tokens a step for each request (greedy or sampled; not with logprobs, "
        "penalties or a logit bias) from its own earlier tokens (the same tokens, fewer "
        "steps where text repeats); turns off async scheduling",
    )
    group.add_argument(
        "--reserved-rows", type=int, default=None,
        help="batch rows no tenant may take while another is active (default max-batch/8)",
    )
    group.add_argument("--tp", type=int, default=DEFAULTS["tp"],
                       help="tensor-parallel devices (mesh 'model')")
    group.add_argument(
        "--dp", type=int, default=DEFAULTS["dp"],
        help="data shards of the batch (mesh 'data'); batch, pages and budget are per shard",
    )
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--lora", action="append", type=_named_path, default=[], metavar="NAME=PATH",
        help="serve the PEFT adapter directory PATH as the model NAME (repeatable)",
    )
    lora.add_argument("--max-loras", type=int, default=DEFAULTS["max_loras"],
                      help="device slots for adapters; the others wait in host memory")
    lora.add_argument("--max-lora-rank", type=int, default=DEFAULTS["max_lora_rank"],
                      help="the highest adapter rank served (every slot is this wide)")


def _named_path(spec: str) -> tuple[str, str]:
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {spec!r}")
    return name, path


BYTE_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
              "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def _byte_size(spec: str) -> int:
    """Bytes from "805306368", "768MiB", "2GB", "1.5G" (decimal k/M/G/T, binary Ki/Mi/Gi/Ti)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?b?\s*", spec.lower())
    if match is None or float(match[1]) <= 0:
        raise argparse.ArgumentTypeError(f"expected a size such as 768MiB or 2GB, got {spec!r}")
    return int(float(match[1]) * BYTE_UNITS[match[2] or ""])


SPECULATIVE_KEYS = {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}


def _speculative_config(spec: str) -> dict[str, int]:
    """EngineConfig's speculative fields from vLLM's --speculative-config JSON (the
    "ngram" method: prompt lookup; its other keys are refused, not ignored), read as vLLM
    reads it: with neither lookup size given both are 5, with one the other equals it."""
    try:
        config = json.loads(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(config, dict) or config.get("method") != "ngram":
        raise argparse.ArgumentTypeError(
            'expected {"method": "ngram", "num_speculative_tokens": N, ...}: prompt lookup '
            "is the method served")
    unknown = config.keys() - SPECULATIVE_KEYS - {"method"}
    if unknown or "num_speculative_tokens" not in config:
        raise argparse.ArgumentTypeError(
            f"the ngram method takes {', '.join(sorted(SPECULATIVE_KEYS))}"
            f" (num_speculative_tokens required); got {', '.join(sorted(config))}")
    if not all(isinstance(config[k], int) and config[k] >= 1 for k in config.keys() - {"method"}):
        raise argparse.ArgumentTypeError("its sizes must be positive integers")
    low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    low, high = low or high, high or low  # EngineConfig refuses low above high
    return {"num_speculative_tokens": config["num_speculative_tokens"],
            "prompt_lookup_min": low, "prompt_lookup_max": high}


def _bucket_table(spec: str) -> BucketTable:
    try:
        return BucketTable.parse(spec)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    if args.num_pages is not None and args.kv_cache_bytes is not None:
        raise SystemExit("--num-pages and --kv-cache-bytes both size the KV pool: give one")
    return EngineConfig(
        page_size=args.page_size,
        num_pages=DEFAULTS["num_pages"] if args.num_pages is None else args.num_pages,
        kv_cache_bytes=args.kv_cache_bytes,
        kv_dtype=args.kv_dtype,
        max_batch=args.max_batch,
        token_budget=args.token_budget,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        weight_dtype=args.weight_dtype,
        attention_backend=args.attention_backend,
        linear_backend=args.linear_backend,
        linear_activations=args.linear_activations,
        tpot_slo_ms=args.tpot_slo_ms,
        compilation_cache_dir=args.compilation_cache_dir or None,
        stream_capacity=args.stream_buffer,
        prefix_caching=not args.no_prefix_cache,
        async_scheduling=args.async_scheduling,
        reserved_rows=args.reserved_rows,
        buckets=None if args.buckets is None else (args.buckets.token_sizes,
                                                   args.buckets.row_sizes),
        tp=args.tp,
        dp=args.dp,
        lora=tuple(args.lora),
        enable_lora=getattr(args, "enable_runtime_lora", False),
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        **args.speculative_config,
    )


def _connection_limits(args: argparse.Namespace):
    from server.connections import ConnectionLimits

    return ConnectionLimits(args.max_connections, args.request_read_timeout_s)


def _serve(args: argparse.Namespace) -> int:
    from server import heap
    from server.admission import QueuePolicy
    from server.app import ServerConfig, run

    heap.configure_malloc()  # before the engine's and XLA's threads start (heap.py)
    # the server tokenizes one prompt a call: rayon's pool (two more threads, started at
    # the first prompt) would gain nothing (unless the operator sets it)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    if args.num_processes > 1:
        from jaxserve.device import multihost

        if not args.coordinator:
            raise SystemExit("--num-processes > 1 needs --coordinator HOST:PORT")
        multihost.initialize(args.coordinator, args.num_processes, args.process_id)
        if not multihost.is_leader():
            return _follow(args)

    run(
        ServerConfig(
            model=args.model,
            host=args.host,
            port=args.port,
            served_model_name=args.served_model_name,
            api_key=args.api_key,
            api_keys_file=args.api_keys_file,
            queue=QueuePolicy(
                max_queue=args.max_queue,
                wait_budget_s=args.queue_wait_budget_ms / 1000,
                min_queue=args.max_batch * args.dp,
                max_queued_tokens=args.max_queued_tokens,
            ),
            connections=_connection_limits(args),
            max_body_bytes=args.max_body_bytes,
            drain_timeout_s=args.drain_timeout,
            stream_write_timeout_s=args.stream_write_timeout,
            step_timeout_s=args.step_timeout_s,
            default_chat_max_tokens=args.default_max_tokens,
            heap_trim_interval_s=args.heap_trim_interval_s,
            shared_prefix_cache=args.shared_prefix_cache,
            runtime_lora=args.enable_runtime_lora,
            engine=_engine_config(args),
        )
    )
    return 0


def _route(args: argparse.Namespace) -> int:
    import dataclasses

    from gateway import app, config

    try:
        cfg = config.load(args.config)
    except (OSError, config.ConfigError) as err:
        raise SystemExit(f"jaxserve route: {err}") from None
    overrides = {"host": args.host, "port": args.port, "batch_db": args.batch_db}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
    app.run(cfg, spawn=args.spawn)
    return 0


def _follow(args: argparse.Namespace) -> int:
    """A process other than 0: load the same model and engine, run process 0's steps."""
    import logging

    from jaxserve.device import multihost
    from jaxserve.llm import LLM

    logging.basicConfig(  # force: importing jax has set up a handler already
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", force=True
    )
    # a follower runs process 0's steps: it neither warms up nor caps the batch itself
    config = dataclasses.replace(_engine_config(args), tpot_slo_ms=None)
    runner = LLM(args.model, config).runner
    gc.freeze()  # as the server does: no full collection pauses the step loop
    multihost.follow(runner)
    return 0


def _plan_flags(plan: argparse.ArgumentParser) -> None:
    dtypes = ("f32", "bf16", "fp8", "int8", "int4")
    plan.add_argument("--model", required=True,
                      help="preset, config.json (or its directory) or GGUF file")
    plan.add_argument("--weight-dtype", choices=dtypes, default="bf16")
    plan.add_argument("--kv-dtype", choices=dtypes, default="bf16")
    plan.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                      help="what jaxserve serves in: activations, embeddings and norms")
    plan.add_argument(
        "--compute-dtype",
        choices=("bf16", "fp8", "int8"),
        default="bf16",
        help="matmul activations: bf16 = weight-only quantization at the bf16 rate",
    )
    plan.add_argument("--chip", default="H100", help="H100, H200, A100, v5e, v6e or custom")
    plan.add_argument("--num-chips", type=int, default=1, help="chips per replica")
    plan.add_argument("--hbm-gb", type=float, help="per chip; overrides the preset")
    plan.add_argument("--hbm-tbps", type=float, help="per chip; overrides the preset")
    plan.add_argument("--tflops", type=float, help="dense, per chip, every dtype")
    plan.add_argument("--context", type=int, default=2048, help="tokens: prompt + output")
    plan.add_argument("--output-tokens", type=int, default=256)
    plan.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    plan.add_argument("--tpot-slo-ms", type=float, default=50.0)
    plan.add_argument("--queue-budget-ms", type=float, help="default: TTFT SLO minus a prefill")
    plan.add_argument("--arrival-rate", type=float, help="requests/s, for the replica count")
    plan.add_argument(
        "--efficiency",
        type=float,
        help="real step / roofline step (default 2.5: real engines land at 2-3x)",
    )
    plan.add_argument(
        "--calibrate",
        metavar="JSON",
        help="bench/roofline.py result: its measured_over_roofline.median replaces --efficiency",
    )
    plan.add_argument("--kv-cap", type=float, default=0.95, help="usable fraction of free HBM")
    plan.add_argument("--activation-gb", type=float, default=5.0, help="reserved per chip")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def _plan(args: argparse.Namespace) -> int:
    import json

    from jaxserve import planner

    try:
        if args.calibrate:
            efficiency = planner.efficiency_from_calibration(args.calibrate)
            source = f"calibrated: measured / roofline in {args.calibrate}"
        elif args.efficiency is not None:
            efficiency, source = args.efficiency, "given"
        else:
            efficiency = planner.DEFAULT_EFFICIENCY
            source = "default: real engines land at 2–3× the roofline"
        inputs = planner.PlanInputs(
            model=planner.model_shape(args.model),
            chip=planner.load_chip(args.chip, args.hbm_gb, args.hbm_tbps, args.tflops),
            num_chips=args.num_chips,
            weight_dtype=args.weight_dtype,
            kv_dtype=args.kv_dtype,
            compute_dtype=args.compute_dtype,
            dtype=args.dtype,
            context=args.context,
            output_tokens=args.output_tokens,
            tpot_slo_ms=args.tpot_slo_ms,
            ttft_slo_ms=args.ttft_slo_ms,
            queue_budget_ms=args.queue_budget_ms,
            arrival_rate=args.arrival_rate,
            efficiency=efficiency,
            efficiency_source=source,
            kv_cap=args.kv_cap,
            activation_gb=args.activation_gb,
        )
    except (ValueError, OSError) as err:
        print(f"jaxserve plan: {err}", file=sys.stderr)
        return 2
    result = planner.plan(inputs)
    print(json.dumps(result.to_json(), indent=2) if args.json else planner.format_report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
