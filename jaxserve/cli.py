"""The `jaxserve` command: generate, convert, serve."""

import argparse
import sys
import time
from pathlib import Path


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
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=16)

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


def _serve(args: argparse.Namespace) -> int:
    from server.app import run

    run(model=args.model, host=args.host, port=args.port, max_batch=args.max_batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
