"""Continuous batching against static batching on the same engine and workload.

Static batching gathers `max_batch` requests, runs them until the last one
finishes, then takes the next batch; continuous batching refills a row as soon
as its sequence finishes. Same model, buckets, warm-up and requests; the output
lengths vary, which is what makes static batches wait on their longest member.

    .venv/bin/python bench/engine_throughput.py [--model PATH] [--requests 48]
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from common import cpu_description

from jaxserve import LLM, SamplingParams


def workload(n: int, vocab: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, vocab) for _ in range(rng.randint(16, 96))],
            SamplingParams(
                max_tokens=rng.choice([8, 16, 32, 64, 128]), temperature=0.0, ignore_eos=True
            ),
        )
        for _ in range(n)
    ]


def run(llm: LLM, requests, static: bool) -> dict:
    engine = llm.engine
    start = time.perf_counter()
    steps = 0
    batches = [
        requests[i : i + llm.scheduler.max_batch]
        for i in range(0, len(requests), llm.scheduler.max_batch)
    ]
    tokens = 0
    for batch in batches if static else [requests]:
        streams = [engine.submit(ids, params) for ids, params in batch]
        while engine.has_work():
            engine.step()
            steps += 1
            for s in streams:  # drain every step: output buffers are bounded
                while len(s):
                    tokens += len(s.get(timeout=0).token_ids)
    seconds = time.perf_counter() - start
    assert tokens == sum(p.max_tokens for _, p in requests), "a request was cut short"
    return {"seconds": seconds, "steps": steps, "tokens": tokens, "tokens_per_s": tokens / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/engine_throughput.json"))
    args = parser.parse_args()

    llm = LLM(
        args.model,
        max_batch=args.max_batch,
        token_budget=128,
        num_pages=1024,
        max_model_len=512,
        prefix_caching=False,  # each repeat sends the same prompts: none may be cached
        compilation_cache_dir=".cache/jax",
        warmup=True,
    )
    requests = workload(args.requests, llm.config.vocab_size, seed=0)
    results = {"static": [], "continuous": []}
    for _ in range(args.repeats):  # interleaved, so drift hits both alike
        for mode in results:
            results[mode].append(run(llm, requests, static=mode == "static"))
    summary = {
        mode: {
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
            "steps": runs[0]["steps"],
            "runs": runs,
        }
        for mode, runs in results.items()
    }
    ratio = summary["continuous"]["tokens_per_s_median"] / summary["static"]["tokens_per_s_median"]
    print(f"| batching   | tokens/s (median of {args.repeats}) | steps |")
    print("|------------|------------------------|-------|")
    for mode, s in summary.items():
        print(f"| {mode:<10} | {s['tokens_per_s_median']:>22.1f} | {s['steps']:>5} |")
    print(
        f"\ncontinuous / static = {ratio:.2f}x  ({args.requests} requests, "
        f"max_batch {args.max_batch}, output lengths 8-128)"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "model": str(llm.model_path),
                "machine": cpu_description(),
                "requests": args.requests,
                "max_batch": args.max_batch,
                "ratio": ratio,
                **summary,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
