"""The `jaxserve` command: generate, convert, serve."""

import argparse
import sys
import time
from pathlib import Path

from jaxserve.attention import BACKENDS


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

    serve = commands.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    serve.add_argument("--model", help="GGUF file, HF directory or converted checkpoint")
    serve.add_argument("--served-model-name", help="the model id clients name (default: file)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", help="require this bearer key (also the admin key)")
    serve.add_argument("--api-keys-file", help="JSON: key -> {tenant, priority, limits, admin}")
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
    serve.add_argument("--default-max-tokens", type=int, default=256, help="chat default")
    _engine_flags(serve)

    args = parser.parse_args(argv)
    return {"generate": _generate, "convert": _convert, "serve": _serve}[args.command](args)


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
    from jaxserve import orbax_checkpoint
    from jaxserve.loader import load

    start = time.perf_counter()
    model, tokenizer = load(args.src)
    loaded = time.perf_counter()
    orbax_checkpoint.save(model, tokenizer, args.out)
    print(
        f"loaded {args.src} in {loaded - start:.1f}s, wrote {args.out} "
        f"in {time.perf_counter() - loaded:.1f}s",
        file=sys.stderr,
    )
    return 0


def _engine_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--max-batch", type=int, default=16)
    group.add_argument("--num-pages", type=int, default=1024, help="KV pages incl. the null page")
    group.add_argument("--page-size", type=int, default=16)
    group.add_argument("--token-budget", type=int, default=256, help="tokens per step")
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--dtype", default="float32")
    group.add_argument("--attention-backend", choices=BACKENDS)
    group.add_argument("--tpot-slo-ms", type=float, help="cap the batch so steps stay under 60%%")
    group.add_argument("--compilation-cache-dir", default=".cache/jax")
    group.add_argument("--stream-buffer", type=int, default=256, help="outputs per request")


def _engine_config(args: argparse.Namespace):
    from jaxserve.config import EngineConfig

    return EngineConfig(
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_batch=args.max_batch,
        token_budget=args.token_budget,
        max_model_len=args.max_model_len,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        tpot_slo_ms=args.tpot_slo_ms,
        compilation_cache_dir=args.compilation_cache_dir or None,
        stream_capacity=args.stream_buffer,
    )


def _serve(args: argparse.Namespace) -> int:
    from server.admission import QueuePolicy
    from server.app import ServerConfig, run

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
                min_queue=args.max_batch,
                max_queued_tokens=args.max_queued_tokens,
            ),
            max_body_bytes=args.max_body_bytes,
            drain_timeout_s=args.drain_timeout,
            default_chat_max_tokens=args.default_max_tokens,
            engine=_engine_config(args),
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
