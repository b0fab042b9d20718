"""Open-loop load generator for any OpenAI-compatible server (jaxserve, llama.cpp, vLLM).

    .venv/bin/python bench/serve.py --base-url http://127.0.0.1:8000 [--model NAME[,NAME...]]
        [--rate 4 | --concurrency 8] [--requests 200] [--duration 60]
        [--prompt-tokens 256 | 128:512] [--output-tokens 128 | 32:256]
        [--shared-prefix-tokens 0] [--ttft-slo-ms 1000] [--tpot-slo-ms 100]
        [--temperature 0] [--top-p 1]
        [--out bench/results/serve.json]

Arrivals: `--rate R` sends requests at Poisson times (R a second on average) whether or not
earlier ones have finished (open loop); the default rate, inf, sends them all at once (a
burst). `--concurrency C` caps the requests in flight; with no rate that is a closed loop
at fixed concurrency C. `--requests N` and `--duration S` stop sending at whichever comes
first; requests in flight then run to their end.

Prompts: words drawn at random from a list of common English words that are each one token
in Llama/SmolLM2-style BPE vocabularies, so a prompt of n words is about n tokens. A length
is `N` (every request N) or `MIN:MAX` (uniform). `--shared-prefix-tokens P` makes the first
P of each prompt's tokens the same for every request. Several model names (a base model
and its LoRA adapters) are taken in turn, request by request. Requests are streaming
/v1/completions with temperature 0 (or `--temperature`, and `--top-p`, as chat clients send
them), `ignore_eos` and `min_tokens` = max_tokens, so outputs run to max_tokens on servers
that honour either (`--no-ignore-eos`: send neither).

Metrics, per request then p50/p95/p99 over the completed ones:
- TTFT: request sent → first chunk carrying text.
- TPOT: (end-to-end − TTFT) ÷ (output tokens − 1); ITL: the gaps between text chunks.
- output tokens: the server's streamed usage when it sends one, else text chunks counted.
- duration: first request sent → last response ended; tokens/s and goodput are over it.
- goodput: completed requests with TTFT ≤ --ttft-slo-ms and TPOT ≤ --tpot-slo-ms, per second.
Outcomes: completed, rejected with 429, or error (any other status, a broken stream, a
timeout); completed + 429 + errors = sent.
"""

import argparse
import asyncio
import itertools
import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from common import RESULTS, Progress, fmt, markdown_table, pyplot, summarize, write_json

WORDS = (
    "the of and to in is was for on with as by at from his her they this that which not but "
    "are have had were one all their there been has more when who will would no out so said "
    "what up its about into than them can only other new some could time these two may then "
    "first any now such like our over man even most made after also did many before must "
    "through back years where much your way well down should because each just those people "
    "how too little state good very make world still own see men work long get here between "
    "both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three"
).split()


@dataclass(frozen=True, slots=True)
class Lengths:
    """Token counts drawn uniformly from [low, high] (low == high: fixed)."""

    low: int
    high: int

    @staticmethod
    def parse(spec: str | int) -> "Lengths":
        """`N` or `MIN:MAX`."""
        low, _, high = str(spec).partition(":")
        lengths = Lengths(int(low), int(high or low))
        if not 1 <= lengths.low <= lengths.high:
            raise ValueError(f"a length must be N or MIN:MAX with 1 <= MIN <= MAX, got {spec!r}")
        return lengths

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True, slots=True)
class Workload:
    """What to send and when; the same workload gives the same prompts on any server."""

    requests: int | None = 100  # None: until `duration_s`
    duration_s: float | None = None
    rate: float = math.inf  # requests/s, Poisson; inf: all at once
    concurrency: int | None = None  # cap on requests in flight
    prompt_tokens: Lengths = Lengths(256, 256)  # including the shared prefix
    output_tokens: Lengths = Lengths(128, 128)
    shared_prefix_tokens: int = 0
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 100.0
    ignore_eos: bool = True
    timeout_s: float = 600.0  # per request
    seed: int = 0
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # 1: off (not sent)

    def __post_init__(self) -> None:
        if self.requests is None and self.duration_s is None:
            raise ValueError("give a number of requests, a duration, or both")
        if not self.rate > 0 or (self.concurrency is not None and self.concurrency < 1):
            raise ValueError("need rate > 0 and concurrency >= 1")
        if self.requests is None and math.isinf(self.rate) and self.concurrency is None:
            raise ValueError("a burst with no concurrency cap needs a number of requests")

    def prompts(self) -> Iterator[tuple[str, int]]:
        """(prompt text, max_tokens) for each request, endless; the same for a given seed."""
        rng = random.Random(self.seed)
        prefix = [rng.choice(WORDS) for _ in range(self.shared_prefix_tokens)]
        while True:
            n = max(1, self.prompt_tokens.draw(rng) - len(prefix))
            words = prefix + [rng.choice(WORDS) for _ in range(n)]
            yield " ".join(words), self.output_tokens.draw(rng)


@dataclass
class Outcome:
    """One request as the client saw it (times in seconds from the benchmark's start)."""

    sent: float
    prompt_tokens: int  # estimated; replaced by the server's usage when it reports one
    max_tokens: int
    status: str = "error"  # "ok", "429" or "error"
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    end: float | None = None  # when the response ended, whatever its outcome
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)  # text chunks' arrival

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


async def send_one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    outcome: Outcome,
    t0: float,
) -> None:
    """Send one streaming completion and fill `outcome` as the chunks arrive."""
    usage = None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                outcome.status = "429" if resp.status == 429 else "error"
                outcome.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    outcome.error = f"stream error: {str(chunk['error'])[:200]}"
                    return
                usage = chunk.get("usage") or usage
                if any(c.get("text") for c in chunk.get("choices") or ()):
                    now = time.perf_counter() - t0
                    if outcome.ttft is None:
                        outcome.ttft = now - outcome.sent
                    outcome.chunk_times.append(now)
        outcome.e2e = time.perf_counter() - t0 - outcome.sent
        if usage:
            outcome.output_tokens = usage.get("completion_tokens") or len(outcome.chunk_times)
            outcome.prompt_tokens = usage.get("prompt_tokens") or outcome.prompt_tokens
        else:
            outcome.output_tokens = len(outcome.chunk_times)
        if outcome.ttft is None:
            outcome.error = "the stream ended without any text"
            return
        outcome.status = "ok"
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as err:
        outcome.status, outcome.error = "error", f"{type(err).__name__}: {err}"[:200]
    finally:
        outcome.end = time.perf_counter() - t0


async def _first_model(session: aiohttp.ClientSession, base_url: str) -> str:
    async with session.get(base_url + "/v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _drive(
    base_url: str, model: str | None, workload: Workload, api_key: str | None, progress: Progress
) -> tuple[str, list[Outcome], float]:
    """Send the workload; return the model name, every outcome and the duration."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = aiohttp.ClientTimeout(total=workload.timeout_s)
    connector = aiohttp.TCPConnector(limit=0)  # open loop: never queue on the client side
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as s:
        model = model or await _first_model(s, base_url)
        names = itertools.cycle(model.split(","))  # several: one request each in turn
        url = base_url + "/v1/completions"
        arrivals = random.Random(workload.seed + 1)
        slots = asyncio.Semaphore(workload.concurrency) if workload.concurrency else None
        outcomes: list[Outcome] = []
        tasks: list[asyncio.Task] = []
        t0 = time.perf_counter()
        next_at = 0.0

        def elapsed() -> float:
            return time.perf_counter() - t0

        def over() -> bool:
            return workload.duration_s is not None and elapsed() >= workload.duration_s

        async def send(body: dict, outcome: Outcome) -> None:
            try:
                await send_one(s, url, body, outcome, t0)
            finally:
                if slots:
                    slots.release()

        bar = asyncio.create_task(_show_progress(workload, outcomes, elapsed, progress))
        for prompt, max_tokens in itertools.islice(workload.prompts(), workload.requests):
            if math.isfinite(workload.rate):
                next_at += arrivals.expovariate(workload.rate)
                await asyncio.sleep(max(0.0, next_at - elapsed()))
            if slots:
                await slots.acquire()
            if over():
                if slots:
                    slots.release()
                break
            body = {
                "model": next(names),
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": workload.temperature,
                **({"top_p": workload.top_p} if workload.top_p < 1 else {}),
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if workload.ignore_eos:  # vLLM and jaxserve read either; llama.cpp min_tokens
                body.update(ignore_eos=True, min_tokens=max_tokens)
            outcome = Outcome(elapsed(), len(prompt.split()), max_tokens)
            outcomes.append(outcome)
            tasks.append(asyncio.create_task(send(body, outcome)))
            await asyncio.sleep(0)  # let a burst's requests start as they are made
        await asyncio.gather(*tasks)
        duration = max(o.end for o in outcomes) - outcomes[0].sent if outcomes else 0.0
        bar.cancel()
        _progress_line(workload, outcomes, elapsed(), progress, final=True)
        return model, outcomes, duration


def _progress_line(
    workload: Workload,
    outcomes: list[Outcome],
    elapsed: float,
    progress: Progress,
    final: bool = False,
) -> None:
    counts = Counter(o.status for o in outcomes if o.end is not None)
    done = sum(counts.values())
    fractions = [done / workload.requests if workload.requests else 0.0]
    if workload.duration_s:
        fractions.append(elapsed / workload.duration_s)
    total = f"/{workload.requests}" if workload.requests else ""
    limit = f"/{workload.duration_s:g}" if workload.duration_s else ""
    progress.show(
        1.0 if final else max(fractions),
        f"{done}{total} done, {len(outcomes) - done} in flight, {counts['429']} × 429, "
        f"{counts['error']} errors, {elapsed:.1f}{limit}s",
        final=final,
    )


async def _show_progress(
    workload: Workload, outcomes: list[Outcome], elapsed: Callable[[], float], progress: Progress
) -> None:
    while True:
        _progress_line(workload, outcomes, elapsed(), progress)
        await asyncio.sleep(0.25)


def summarize_outcomes(outcomes: list[Outcome], duration: float, workload: Workload) -> dict:
    """The report: counts, throughput, goodput and latency percentiles (see the docstring)."""
    ok = [o for o in outcomes if o.status == "ok"]
    counts = Counter(o.status for o in outcomes)
    output_tokens = sum(o.output_tokens for o in ok)
    prompt_tokens = sum(o.prompt_tokens for o in ok)
    tpots = [o.tpot for o in ok if o.tpot is not None]
    itls = [b - a for o in ok for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    good = [
        o
        for o in ok
        if o.ttft * 1e3 <= workload.ttft_slo_ms
        and (o.tpot is None or o.tpot * 1e3 <= workload.tpot_slo_ms)
    ]
    per_s = 1 / duration if duration > 0 else 0.0
    return {
        "num_sent": len(outcomes),
        "num_completed": counts["ok"],
        "num_429": counts["429"],
        "num_errors": counts["error"],
        "errors": dict(Counter(o.error for o in outcomes if o.status == "error").most_common(5)),
        "duration_s": duration,
        "request_throughput": counts["ok"] * per_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens * per_s,
        "total_tokens_per_s": (prompt_tokens + output_tokens) * per_s,
        "goodput": len(good) * per_s,
        "num_good": len(good),
        "ttft_ms": summarize([o.ttft for o in ok], 1e3),
        "tpot_ms": summarize(tpots, 1e3),
        "itl_ms": summarize(itls, 1e3),
        "e2e_ms": summarize([o.e2e for o in ok], 1e3),
        "timeline": _timeline(ok, duration),
    }


def _timeline(ok: list[Outcome], duration: float, num_bins: int = 60) -> dict:
    """Output tokens/s in `num_bins` equal bins over the run (bins of 0.5 s at least); each
    text chunk carries its request's output tokens ÷ its number of chunks."""
    bin_s = max(duration / num_bins, 0.5)
    tokens = [0.0] * (int(duration / bin_s) + 1)
    for o in ok:
        share = o.output_tokens / max(1, len(o.chunk_times))
        for t in o.chunk_times:
            tokens[min(len(tokens) - 1, int(t / bin_s))] += share
    return {"bin_s": bin_s, "output_tokens_per_s": [n / bin_s for n in tokens]}


def run(
    base_url: str,
    model: str | None = None,
    workload: Workload = Workload(),
    *,
    api_key: str | None = None,
    out: Path | None = None,
    plots: bool = True,
    progress: bool = True,
) -> dict:
    """Run `workload` against the server; return the report (and write it to `out`)."""
    base_url = base_url.rstrip("/").removesuffix("/v1")
    model, outcomes, duration = asyncio.run(
        _drive(base_url, model, workload, api_key, Progress(progress))
    )
    report = {
        "base_url": base_url,
        "model": model,
        "workload": {
            **asdict(workload),
            "rate": workload.rate if math.isfinite(workload.rate) else None,  # None: burst
            "prompt_tokens": str(workload.prompt_tokens),
            "output_tokens": str(workload.output_tokens),
        },
        **summarize_outcomes(outcomes, duration, workload),
        "requests": [
            {
                "sent_s": o.sent,
                "status": o.status,
                "prompt_tokens": o.prompt_tokens,
                "output_tokens": o.output_tokens,
                "ttft_ms": None if o.ttft is None else o.ttft * 1e3,
                "tpot_ms": None if o.tpot is None else o.tpot * 1e3,
                "e2e_ms": None if o.e2e is None else o.e2e * 1e3,
            }
            for o in outcomes
        ],
    }
    if out is not None:
        report["plots"] = _plot(report, out) if plots else []
        write_json(out, report)
    return report


def _plot(report: dict, out: Path) -> list[str]:
    """Latency CDFs and tokens/s over time, as PNGs beside `out`."""
    plt = pyplot()
    if plt is None:
        return []
    ok = [r for r in report["requests"] if r["status"] == "ok"]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"), ("TTFT", "TPOT", "E2E")):
        values = sorted(r[key] for r in ok if r[key] is not None)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set(title=title, xlabel="ms", ylabel="fraction of requests", ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    fig.tight_layout()
    cdf = out.with_name(out.stem + "_latency_cdf.png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(cdf, dpi=100)
    plt.close(fig)

    timeline = report["timeline"]
    rates = timeline["output_tokens_per_s"]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot([i * timeline["bin_s"] for i in range(len(rates))], rates, drawstyle="steps-post")
    ax.set(title="output tokens/s over time", xlabel="s since start", ylabel="tokens/s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    rate_png = out.with_name(out.stem + "_tokens_per_s.png")
    fig.savefig(rate_png, dpi=100)
    plt.close(fig)
    return [str(cdf), str(rate_png)]


def print_report(report: dict) -> None:
    """The markdown summary printed on stdout."""
    w = report["workload"]
    load = "burst" if w["rate"] is None else f"Poisson {w['rate']:g}/s"
    if w["concurrency"]:
        load += f", at most {w['concurrency']} in flight"
    print(
        f"{report['model']} at {report['base_url']}: {load}; prompts {w['prompt_tokens']} "
        f"tokens (shared prefix {w['shared_prefix_tokens']}), outputs {w['output_tokens']}\n"
    )
    rows = [
        [name.upper(), *(fmt(report[f"{name}_ms"][k]) for k in ("mean", "p50", "p95", "p99"))]
        for name in ("ttft", "tpot", "itl", "e2e")
    ]
    print(markdown_table(["latency (ms)", "mean", "p50", "p95", "p99"], rows))
    print()
    print(
        markdown_table(
            ["sent", "completed", "429", "errors", "duration s", "req/s", "output tok/s",
             "total tok/s", "goodput req/s"],
            [[
                report["num_sent"], report["num_completed"], report["num_429"],
                report["num_errors"], fmt(report["duration_s"], 2),
                fmt(report["request_throughput"], 2), fmt(report["output_tokens_per_s"]),
                fmt(report["total_tokens_per_s"]), fmt(report["goodput"], 2),
            ]],
        )
    )
    print(f"\ngoodput SLOs: TTFT ≤ {w['ttft_slo_ms']:g} ms and TPOT ≤ {w['tpot_slo_ms']:g} ms")
    for error, count in report["errors"].items():
        print(f"error × {count}: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="NAME or NAME,NAME,... (taken in turn); default: the "
                        "first of /v1/models")
    parser.add_argument("--api-key")
    parser.add_argument("--rate", type=float, default=math.inf, help="requests/s (default: burst)")
    parser.add_argument("--concurrency", type=int, help="cap on requests in flight")
    parser.add_argument("--requests", type=int, help="default 100 unless --duration is given")
    parser.add_argument("--duration", type=float, help="seconds to keep sending")
    parser.add_argument("--prompt-tokens", type=Lengths.parse, default=Lengths(256, 256),
                        help="N or MIN:MAX, shared prefix included (default 256)")
    parser.add_argument("--output-tokens", type=Lengths.parse, default=Lengths(128, 128),
                        help="N or MIN:MAX (default 128)")
    parser.add_argument("--shared-prefix-tokens", type=int, default=0)
    parser.add_argument("--ttft-slo-ms", type=float, default=1000.0)
    parser.add_argument("--tpot-slo-ms", type=float, default=100.0)
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="send neither ignore_eos nor min_tokens")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="1: off")
    parser.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    try:
        workload = Workload(
            requests=args.requests if args.requests or args.duration else 100,
            duration_s=args.duration,
            rate=args.rate,
            concurrency=args.concurrency,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            shared_prefix_tokens=args.shared_prefix_tokens,
            ttft_slo_ms=args.ttft_slo_ms,
            tpot_slo_ms=args.tpot_slo_ms,
            ignore_eos=not args.no_ignore_eos,
            timeout_s=args.timeout,
            seed=args.seed,
            temperature=args.temperature,
            top_p=args.top_p,
        )
    except ValueError as err:
        parser.error(str(err))
    report = run(
        args.base_url, args.model, workload, api_key=args.api_key, out=args.out,
        plots=not args.no_plots, progress=not args.no_progress,
    )
    print_report(report)
    print(f"\nwrote {args.out}" + "".join(f", {p}" for p in report.get("plots", [])))
    sys.exit(0 if report["num_completed"] else 1)


if __name__ == "__main__":
    main()
