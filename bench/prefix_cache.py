"""Prefix caching: a shared 2,000-token system prompt is read once, not once per request.

Cold TTFT: a request whose system prompt nobody sent before. Warm TTFT: a request
with the same system prompt as an earlier one and a new 50-token question.
Throughput: a burst of requests sharing the system prompt, cache on against off.

    .venv/bin/python bench/prefix_cache.py [--model PATH] [--system-tokens 2000]
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from jaxserve import LLM, SamplingParams


def ttft(llm: LLM, prompt: list[int]) -> float:
    """Seconds from submission to the first generated token (the engine run inline)."""
    start = time.perf_counter()
    stream = llm.engine.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0))
    while not len(stream):
        llm.engine.step()
    elapsed = time.perf_counter() - start
    while llm.engine.has_work():
        llm.engine.step()
    return elapsed


def burst(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    """Output tokens per second over a burst of requests."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return len(prompts) * max_tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--system-tokens", type=int, default=2000)
    parser.add_argument("--question-tokens", type=int, default=50)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--burst", type=int, default=8, help="requests in the throughput burst")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench/results/prefix_cache.json"))
    args = parser.parse_args()

    rng = random.Random(0)
    # No full warm-up (every bucket at full context takes many minutes here): a cold
    # and a warm request and a burst first compile exactly the shapes measured below.
    engine = {
        "max_batch": 8,
        "token_budget": 512,
        "num_pages": 2048,
        "max_model_len": args.system_tokens + args.question_tokens + 64,
        "compilation_cache_dir": ".cache/jax",
    }
    cached = LLM(args.model, prefix_caching=True, **engine)
    vocab = cached.config.vocab_size

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    def compile_shapes(llm: LLM) -> None:
        system = tokens(args.system_tokens)
        for _ in range(2):
            ttft(llm, system + tokens(args.question_tokens))
        burst(
            llm, [system + tokens(args.question_tokens) for _ in range(args.burst)], args.max_tokens
        )

    compile_shapes(cached)

    cold, warm = [], []
    for _ in range(args.trials):
        system = tokens(args.system_tokens)
        cold.append(ttft(cached, system + tokens(args.question_tokens)))
        warm.append(ttft(cached, system + tokens(args.question_tokens)))
    system = tokens(args.system_tokens)
    prompts = [system + tokens(args.question_tokens) for _ in range(args.burst)]
    with_cache = burst(cached, prompts, args.max_tokens)
    del cached
    uncached = LLM(args.model, prefix_caching=False, **engine)
    compile_shapes(uncached)
    without_cache = burst(uncached, prompts, args.max_tokens)

    result = {
        "system_tokens": args.system_tokens,
        "question_tokens": args.question_tokens,
        "cold_ttft_s": statistics.median(cold),
        "warm_ttft_s": statistics.median(warm),
        "warm_over_cold": statistics.median(warm) / statistics.median(cold),
        "cold_ttft_runs": cold,
        "warm_ttft_runs": warm,
        "burst": args.burst,
        "tokens_per_s_cache_on": with_cache,
        "tokens_per_s_cache_off": without_cache,
        "throughput_ratio": with_cache / without_cache,
    }
    print(f"| {args.system_tokens}-token system prompt | median of {args.trials} |")
    print("|---|---|")
    print(f"| cold TTFT | {result['cold_ttft_s'] * 1000:.0f} ms |")
    print(f"| warm TTFT | {result['warm_ttft_s'] * 1000:.0f} ms |")
    print(f"| warm / cold | {result['warm_over_cold']:.3f} |")
    print(f"| burst of {args.burst}: tokens/s cache on | {with_cache:.1f} |")
    print(f"| burst of {args.burst}: tokens/s cache off | {without_cache:.1f} |")
    print(f"| on / off | {result['throughput_ratio']:.2f}x |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
