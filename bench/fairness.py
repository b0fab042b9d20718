"""Fairness in wall-clock time: tenant B's latency alone, beside a flood, beside an equal load.

    .venv/bin/python bench/fairness.py [--model PATH] [--rounds 5] [--probes 10]
        [--max-batch 8] [--token-budget 64] [--max-queue 16]
        [--b-prompt-tokens 16] [--b-output-tokens 16]
        [--load-prompt-tokens 16] [--load-output-tokens 64:128]
        [--out bench/results/fairness.json]
    .venv/bin/python bench/fairness.py --quick    # 1 round of 3 probes, short outputs

Starts `jaxserve serve` (SmolLM2-135M-Instruct unless --model) with an API-keys file of
tenants A, B, C and an admin key, then runs rounds; each round runs the three conditions,
in an order rotated from round to round:

- alone: B's probes on an idle server;
- flood: tenant A keeps more requests in flight than it may run: the rows it may hold
  while B is active (max batch − reserved rows) plus its share of the queue's places
  (bench/serve.py at that concurrency, in its own process);
- equal: tenant C keeps as many requests in flight as A holds rows, none queued: the
  batch as full as beside the flood, without the flood.

Before each condition the server is idle and B sends one unmeasured probe, so B is active
(the scheduler keeps rows back only for tenants active in the last 30 s). B's probes go
one at a time, each a streamed completion of --b-prompt-tokens + --b-output-tokens
tokens (temperature 0, ignore_eos): TTFT = sent → first text chunk, ITL = the gaps
between text chunks. Each probe waits until the load holds every row it may (a flood,
with requests queued too), read from /admin/requests, and records what it held.

Ratios: B beside the flood ÷ B alone (the server issue's "within 2×"; on a CPU a step's
cost grows with its rows, so it measures the full batch's step as much as the
scheduling), and B beside the flood ÷ B beside the equal load (what the flood's queue
costs B, the batch being as full in both). The property the scheduler owns, in steps,
is tested exactly in tests/test_fairness_steps.py.

Writes the JSON (`--out`), a markdown report and a plot of B's TTFT and ITL
distributions beside it (same stem, .md and .png).
"""

import argparse
import asyncio
import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import numpy as np
from common import (
    RESULTS,
    cpu_description,
    fmt,
    free_port,
    markdown_table,
    pyplot,
    server_process,
    summarize,
    write_json,
)
from serve import Lengths, Outcome, Workload, send_one

from server.admission import QueuePolicy

ROOT = Path(__file__).resolve().parents[1]
CONDITIONS = ("alone", "flood", "equal")
LOAD_TENANT = {"flood": "A", "equal": "C"}
RATIOS = {"flood_over_alone": "alone", "flood_over_equal": "equal"}  # name -> denominator
METRICS = [(m, p) for m in ("ttft_ms", "itl_ms") for p in ("p50", "p95")]


def tenant_keys() -> dict[str, str]:
    """Tenant -> its API key (loopback only: the keys need not be secret)."""
    return {name: f"fairness-{name.lower()}" for name in ("A", "B", "C", "admin")}


def write_keys_file(path: Path, keys: dict[str, str]) -> None:
    """The server's --api-keys-file (server/tenants.py): key -> {tenant, admin}."""
    path.write_text(json.dumps(
        {key: {"tenant": name, "admin": name == "admin"} for name, key in keys.items()}
    ))


def load_in_flight(max_batch: int, reserved_rows: int, max_queue: int) -> dict[str, int]:
    """Requests each load keeps in flight: the flood, every row it may hold and its share
    of the queue (so it is never refused); the equal load, the same rows and no more."""
    rows = max_batch - reserved_rows
    return {"flood": rows + QueuePolicy().tenant_share(max_queue), "equal": rows}


def summarize_condition(outcomes: Sequence[Outcome], load: Sequence[tuple[int, int]]) -> dict:
    """B's TTFT and ITL percentiles over its probes, and the load's (rows, queued) read
    before each probe."""
    ok = [o for o in outcomes if o.status == "ok"]
    itls = [b - a for o in ok for a, b in zip(o.chunk_times, o.chunk_times[1:])]
    rows, queued = zip(*load) if load else ((), ())
    return {
        "num_probes": len(outcomes),
        "num_ok": len(ok),
        "errors": sorted({o.error for o in outcomes if o.status != "ok"}),
        "ttft_ms": summarize([o.ttft for o in ok], 1e3),
        "itl_ms": summarize(itls, 1e3),
        "load_rows_p50": float(np.median(rows)) if rows else None,
        "load_queued_p50": float(np.median(queued)) if queued else None,
    }


def ratios(conditions: dict[str, dict]) -> dict[str, dict[str, float | None]]:
    """B beside the flood ÷ B alone and ÷ B beside the equal load, per metric."""
    out = {}
    for name, base in RATIOS.items():
        out[name] = {}
        for metric, pct in METRICS:
            top, bottom = conditions["flood"][metric][pct], conditions[base][metric][pct]
            out[name][f"{metric}_{pct}"] = top / bottom if top is not None and bottom else None
    return out


def tables(report: dict) -> str:
    """The two markdown tables: each condition's figures, then the ratios."""
    conditions = report["conditions"]
    rows = [
        [name, f"{c['num_ok']}/{c['num_probes']}",
         *(fmt(c[m][p]) for m, p in METRICS),
         fmt(c["load_rows_p50"], 0) if c["load_rows_p50"] is not None else "-",
         fmt(c["load_queued_p50"], 0) if c["load_queued_p50"] is not None else "-"]
        for name, c in conditions.items()
    ]
    first = markdown_table(
        ["B's condition", "probes ok", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms",
         "load rows p50", "load queued p50"], rows)
    labels = {"flood_over_alone": "beside flood ÷ alone",
              "flood_over_equal": "beside flood ÷ beside equal"}
    second = markdown_table(
        ["ratio", "TTFT p50", "TTFT p95", "ITL p50", "ITL p95"],
        [[labels[name], *(fmt(r[f"{m}_{p}"], 2) for m, p in METRICS)]
         for name, r in report["ratios"].items()],
    )
    return f"{first}\n\n{second}"


def markdown(report: dict) -> str:
    machine, setup = report["machine"], report["setup"]
    return (
        f"# Fairness in wall-clock time: {Path(report['model']).name}\n\n"
        f"Made {report['date']} on {machine['model']} ({machine['cores']} cores) by:\n\n"
        f"```bash\n{report['command']}\n```\n\n"
        f"Server: `{report['server_command']}`, with an API-keys file of tenants A, B, C "
        f"and an admin. Rounds: {setup['rounds']}, each of {setup['probes']} probes per "
        f"condition; B's probes {setup['b_prompt_tokens']} "
        f"prompt + {setup['b_output_tokens']} output tokens; the loads' requests "
        f"{setup['load_prompt_tokens']} + {setup['load_output_tokens']} tokens, "
        f"{setup['in_flight']['flood']} in flight for the flood (tenant A), "
        f"{setup['in_flight']['equal']} for the equal load (tenant C).\n\n"
        f"{tables(report)}\n\n"
        "Beside flood ÷ alone is the server issue's comparison; on a CPU a step's cost "
        "grows with its rows, so it measures the full batch's step as much as the "
        "scheduling. Beside flood ÷ beside equal holds the batch as full in both: what "
        f"the flood's queue costs B. JSON: `{Path(report['json']).name}`"
        + (f"; plot: `{Path(report['plot']).name}`" if report["plot"] else "") + ".\n"
    )


def plot(report: dict, samples: dict[str, dict[str, list[float]]], path: Path) -> bool:
    """CDFs of B's TTFT and ITL per condition; False when matplotlib is missing."""
    plt = pyplot()
    if plt is None:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, metric, title in zip(axes, ("ttft_ms", "itl_ms"), ("B's TTFT", "B's ITL")):
        for name in CONDITIONS:
            values = sorted(samples[name][metric])
            if values:
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post",
                        label=name)
        ax.set(title=title, xlabel="ms (log scale)", ylabel="fraction", ylim=(0, 1.02),
               xscale="log")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{Path(report['model']).name}: B alone, beside a flood, beside an equal load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


# ---------------------------------------------------------------- measuring


class Bench:
    """One server, three tenants; B's probes measured in this process, the loads each
    from their own (bench/serve.py), as other clients would."""

    def __init__(self, url: str, keys: dict[str, str], args: argparse.Namespace,
                 in_flight: dict[str, int]) -> None:
        self.url, self.keys, self.args, self.in_flight = url, keys, args, in_flight
        self.admin = {"Authorization": f"Bearer {keys['admin']}"}
        self.model = ""
        self.t0 = time.perf_counter()

    async def run(self) -> tuple[dict[str, list[Outcome]], dict[str, list[tuple[int, int]]]]:
        outcomes = {name: [] for name in CONDITIONS}
        load = {name: [] for name in CONDITIONS}
        timeout = aiohttp.ClientTimeout(total=self.args.timeout)
        headers = {"Authorization": f"Bearer {self.keys['B']}"}
        async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
            async with session.get(self.url + "/v1/models") as resp:
                resp.raise_for_status()
                self.model = (await resp.json())["data"][0]["id"]
            for r in range(self.args.rounds):
                shift = r % len(CONDITIONS)
                for name in CONDITIONS[shift:] + CONDITIONS[:shift]:
                    print(f"round {r + 1}/{self.args.rounds}: B {name}", file=sys.stderr)
                    await self.condition(session, name, r, outcomes[name], load[name])
        return outcomes, load

    async def condition(self, session, name: str, round_: int, outcomes: list,
                        load: list) -> None:
        await self.wait_idle(session)
        prompts = Workload(
            requests=1, prompt_tokens=self.args.b_prompt_tokens,
            output_tokens=Lengths(self.args.b_output_tokens, self.args.b_output_tokens),
            seed=1000 * round_ + CONDITIONS.index(name),  # fresh prompts: no cached prefix
        ).prompts()
        await self.probe(session, *next(prompts))  # B is active from here on
        tenant = LOAD_TENANT.get(name)
        proc = self.start_load(name, round_) if tenant else None
        try:
            for _ in range(self.args.probes):
                if tenant:
                    # each probe starts beside the whole load: a closed-loop client's row is
                    # empty for a moment between one request's end and the next's start
                    load.append(await self.wait_rows(session, tenant, proc,
                                                     queued=name == "flood"))
                outcomes.append(await self.probe(session, *next(prompts)))
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait(timeout=60)

    async def probe(self, session, prompt: str, max_tokens: int) -> Outcome:
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True, "min_tokens": max_tokens,
        }
        outcome = Outcome(time.perf_counter() - self.t0, len(prompt.split()), max_tokens)
        await send_one(session, self.url + "/v1/completions", body, outcome, self.t0)
        return outcome

    def start_load(self, name: str, round_: int) -> subprocess.Popen:
        args = self.args
        cmd = [
            sys.executable, str(ROOT / "bench" / "serve.py"), "--base-url", self.url,
            "--api-key", self.keys[LOAD_TENANT[name]], "--concurrency",
            str(self.in_flight[name]), "--duration", "86400",  # until stopped
            "--prompt-tokens", str(args.load_prompt_tokens),
            "--output-tokens", str(args.load_output_tokens), "--seed", str(round_ + 1),
            "--no-plots", "--no-progress", "--out", str(args.scratch / f"load-{name}.json"),
        ]
        with open(args.scratch / f"load-{name}.log", "w") as log:  # the child keeps it open
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    async def live(self, session) -> list[dict]:
        async with session.get(self.url + "/admin/requests", headers=self.admin) as resp:
            resp.raise_for_status()
            return (await resp.json())["data"]

    async def load_now(self, session, tenant: str) -> tuple[int, int]:
        """The tenant's (rows held, requests queued) now."""
        mine = [r for r in await self.live(session) if r["tenant"] == tenant]
        queued = sum(r["phase"] == "queued" for r in mine)
        return len(mine) - queued, queued

    async def wait_rows(self, session, tenant: str, proc, queued: bool) -> tuple[int, int]:
        """Until the load holds every row it may (and, a flood, has requests queued): the
        (rows held, requests queued) then, which may exceed what it may hold."""
        rows = self.args.max_batch - self.args.reserved_rows
        deadline = time.monotonic() + self.args.timeout
        while True:
            held, waiting = await self.load_now(session, tenant)
            if held >= rows and (waiting > 0 or not queued):
                return held, waiting
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tenant {tenant} never held its {rows} rows "
                                   f"(holds {held}, {waiting} queued); see {self.args.scratch}")
            await asyncio.sleep(0.05)

    async def wait_idle(self, session) -> None:
        deadline = time.monotonic() + self.args.timeout
        while await self.live(session):
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not go idle")
            await asyncio.sleep(0.1)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="served model (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--probes", type=int, default=10, help="B's probes per condition a round")
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--token-budget", type=int, default=64)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--num-pages", type=int, default=256)
    parser.add_argument("--b-prompt-tokens", type=Lengths.parse, default=Lengths(16, 16))
    parser.add_argument("--b-output-tokens", type=int, default=16)
    parser.add_argument("--load-prompt-tokens", type=Lengths.parse, default=Lengths(16, 16))
    parser.add_argument("--load-output-tokens", type=Lengths.parse, default=Lengths(64, 128))
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per wait")
    parser.add_argument("--quick", action="store_true", help="1 round of 3 probes, short outputs")
    parser.add_argument("--out", type=Path, default=RESULTS / "fairness.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.probes, args.b_output_tokens = 1, 3, 4
        args.load_output_tokens = Lengths(16, 32)
    if args.rounds < 1 or args.probes < 1 or args.b_output_tokens < 2:
        parser.error("need --rounds >= 1, --probes >= 1 and --b-output-tokens >= 2 (an ITL)")
    args.reserved_rows = max(1, args.max_batch // 8)  # the server's default, passed explicitly
    return args


def server_flags(args: argparse.Namespace) -> list[str]:
    """The flags of `jaxserve serve` that shape the measurement."""
    flags = ["--max-batch", str(args.max_batch), "--reserved-rows", str(args.reserved_rows),
             "--token-budget", str(args.token_budget), "--max-queue", str(args.max_queue),
             "--max-model-len", str(args.max_model_len), "--num-pages", str(args.num_pages)]
    return flags + (["--model", args.model] if args.model else [])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    in_flight = load_in_flight(args.max_batch, args.reserved_rows, args.max_queue)
    keys = tenant_keys()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="jaxserve-fairness-") as scratch:
        args.scratch = Path(scratch)
        write_keys_file(args.scratch / "keys.json", keys)
        port = free_port()
        cmd = [sys.executable, "-m", "jaxserve.cli", "serve", *server_flags(args),
               "--api-keys-file", str(args.scratch / "keys.json"), "--port", str(port),
               "--compilation-cache-dir", str(ROOT / ".cache" / "jax")]
        url = f"http://127.0.0.1:{port}"
        print("starting the server (start-up compiles its buckets) ...", file=sys.stderr)
        with server_process(cmd, url + "/health", args.scratch / "server.log", cwd=ROOT):
            bench = Bench(url, keys, args, in_flight)
            outcomes, load = asyncio.run(bench.run())
    conditions = {name: summarize_condition(outcomes[name], load[name]) for name in CONDITIONS}
    cpu = cpu_description()
    out = args.out
    report = {
        "model": args.model or bench.model,
        "date": datetime.date.today().isoformat(),
        "command": shlex.join(["bench/fairness.py", *(sys.argv[1:] if argv is None else argv)]),
        "server_command": shlex.join(["jaxserve", "serve", *server_flags(args)]),
        "machine": {**cpu, "cores": os.cpu_count()},
        "setup": {
            "rounds": args.rounds, "probes": args.probes,
            "b_prompt_tokens": str(args.b_prompt_tokens), "b_output_tokens": args.b_output_tokens,
            "load_prompt_tokens": str(args.load_prompt_tokens),
            "load_output_tokens": str(args.load_output_tokens),
            "max_batch": args.max_batch, "reserved_rows": args.reserved_rows,
            "token_budget": args.token_budget, "max_queue": args.max_queue,
            "in_flight": in_flight,
        },
        "seconds": time.monotonic() - started,
        "conditions": conditions,
        "ratios": ratios(conditions),
        "json": str(out),
        "plot": str(out.with_suffix(".png")),
    }
    samples = {
        name: {"ttft_ms": [o.ttft * 1e3 for o in outcomes[name] if o.status == "ok"],
               "itl_ms": [(b - a) * 1e3 for o in outcomes[name] if o.status == "ok"
                          for a, b in zip(o.chunk_times, o.chunk_times[1:])]}
        for name in CONDITIONS
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    if not plot(report, samples, out.with_suffix(".png")):
        report["plot"] = None
    report["probes"] = samples
    write_json(out, report)
    out.with_suffix(".md").write_text(markdown(report))
    print(tables(report))
    print(f"\nwrote {out}, {out.with_suffix('.md')}" + (f", {report['plot']}" if report["plot"]
                                                        else ""))
    return report


if __name__ == "__main__":
    main()
