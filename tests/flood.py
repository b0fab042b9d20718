"""A tenant's flood from its own process: `python tests/flood.py URL TENANT WORKERS MODEL`.

Each worker sends completions of random lengths back to back until SIGTERM, then the
script prints {"done": N, "refused": M}. Its own process keeps the flood's client
work off the event loop of the test that measures the other tenant.
"""

import asyncio
import json
import random
import signal
import sys

import aiohttp


async def main(url: str, tenant: str, workers: int, model: str) -> None:
    stop, counts = asyncio.Event(), {"done": 0, "refused": 0}
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)

    async def worker(session, seed):
        rng = random.Random(seed)  # varied lengths: the requests do not end in lockstep
        while not stop.is_set():
            job = {"model": model, "prompt": "Flood", "max_tokens": rng.randint(64, 128),
                   "temperature": 0,
                   "ignore_eos": True}
            async with session.post(url + "/v1/completions", json=job,
                                    headers={"X-Tenant": tenant}) as resp:
                await resp.read()
                if resp.status not in (200, 429):
                    raise RuntimeError(f"flood got {resp.status}")
                counts["done" if resp.status == 200 else "refused"] += 1
                if resp.status == 429:
                    await asyncio.sleep(0.05)

    connector = aiohttp.TCPConnector(limit=100)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        await asyncio.gather(*(worker(session, i) for i in range(workers)))
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    url, tenant, workers, model = sys.argv[1:]
    asyncio.run(main(url, tenant, int(workers), model))
