"""A soak run against `kvserve serve`: many mixed requests, a share of clients hanging up
mid-request, and the server's resident memory sampled over time (issue 10, item 12).

`concurrency` clients loop until `duration_s` runs out, each sending one request at a time
(streaming or not, a lognormal prompt from the workload); a `hangup` fraction disconnects after
its first bytes. RSS comes from /proc of the server process, every `sample_s` seconds.
"""
from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import httpx

from kvserve.bench.workload import WorkloadRequest


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


async def _client(http: httpx.AsyncClient, url: str, requests: list[WorkloadRequest], rng: random.Random,
                  hangup: float, deadline: float, counts: dict[str, int]) -> None:
    while time.monotonic() < deadline:
        r = rng.choice(requests)
        stream = rng.random() < 0.5
        body = {"prompt": r.prompt_token_ids, "max_tokens": r.max_tokens, "ignore_eos": True, "stream": stream}
        try:
            if rng.random() < hangup:
                # Hang up after the first bytes of the reply (or of waiting for them).
                with_timeout = http.stream("POST", f"{url}/v1/completions", json=body, timeout=2.0)
                async with with_timeout as response:
                    async for _ in response.aiter_raw():
                        break
                counts["hung_up"] += 1
                continue
            response = await http.post(f"{url}/v1/completions", json=body, timeout=600)
            counts["ok" if response.status_code == 200 else "error"] += 1
        except httpx.TimeoutException:
            counts["hung_up"] += 1
        except httpx.HTTPError:
            counts["error"] += 1


async def _soak(url: str, pid: int, requests: list[WorkloadRequest], concurrency: int, duration_s: float,
                hangup: float, sample_s: float, seed: int) -> dict[str, Any]:
    counts = {"ok": 0, "hung_up": 0, "error": 0}
    samples: list[tuple[float, float]] = []
    start = time.monotonic()
    deadline = start + duration_s

    async def sampler() -> None:
        while time.monotonic() < deadline:
            samples.append((time.monotonic() - start, rss_mib(pid)))
            await asyncio.sleep(sample_s)

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as http:
        await asyncio.gather(sampler(), *(_client(http, url, requests, random.Random(seed + i), hangup, deadline,
                                                  counts) for i in range(concurrency)))
    samples.append((time.monotonic() - start, rss_mib(pid)))
    return {"counts": counts, "rss_mib": samples}


def run_soak(url: str, pid: int, requests: list[WorkloadRequest], concurrency: int = 16, duration_s: float = 720,
             hangup: float = 0.3, sample_s: float = 30, seed: int = 0) -> dict[str, Any]:
    """Returns request counts and (seconds, RSS MiB) samples; `growth_after_warmup` compares the
    last sample with the first one taken after a fifth of the run."""
    result = asyncio.run(_soak(url, pid, requests, concurrency, duration_s, hangup, sample_s, seed))
    rss = result["rss_mib"]
    warm = next((m for t, m in rss if t >= duration_s / 5), rss[0][1])
    result["growth_after_warmup"] = rss[-1][1] / warm - 1
    return result
