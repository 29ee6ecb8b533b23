"""Clients that go away mid-stream must not leak anything: against a running server (`--url`),
stream `--requests` completions at once, cancel every other one after its first chunks, and
check that the rest stream all their tokens, that the server then holds no request (its
`/flush_cache` answers 200 within `--settle` seconds: it refuses while any request is in flight)
and that it still serves. Prints one JSON object; exit 1 on a failure.

    python3 scripts/server_abort_check.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from typing import Any

import httpx
import openai

from minisgl.benchmark.serving import open_stream


async def one(
    client: Any, prompt: list[int], max_tokens: int, seed: int, cancel_after: int | None
) -> int:
    stream = await open_stream(client, prompt, max_tokens, seed)
    chunks, tokens = 0, 0
    async for chunk in stream:
        chunks += 1
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if cancel_after is not None and chunks >= cancel_after:
            await stream.close()  # the client goes away mid-stream
            return -1
    return tokens


async def storm(url: str, n: int, vocab: int) -> tuple[int, int]:
    rng = random.Random(7)
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    async with client:
        jobs = []
        for i in range(n):
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(50, 600))]
            jobs.append(one(client, prompt, 256, i, rng.randint(1, 20) if i % 2 else None))
        results = await asyncio.gather(*jobs)
    full = sum(r == 256 for r in results)
    return full, sum(r == -1 for r in results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--settle", type=float, default=30.0)
    args = p.parse_args()
    start = time.perf_counter()
    full, cancelled = asyncio.run(storm(args.url, args.requests, args.vocab))
    deadline = time.monotonic() + args.settle
    flushed = False
    while time.monotonic() < deadline:
        if httpx.post(f"{args.url}/flush_cache", timeout=30).status_code == 200:
            flushed = True
            break
        time.sleep(0.2)
    after = asyncio.run(storm(args.url, 4, args.vocab))  # still serving afterwards
    result = {
        "requests": args.requests,
        "completed_in_full": full,
        "cancelled": cancelled,
        "expected_in_full": args.requests - args.requests // 2,
        "flushed_after_storm": flushed,
        "served_after": after[0],
        "seconds": time.perf_counter() - start,
    }
    ok = flushed and full == result["expected_in_full"] and after[0] == 2
    result["ok"] = ok
    print(json.dumps(result))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
