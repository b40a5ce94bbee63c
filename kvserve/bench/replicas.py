"""`kvserve bench replicas`: N replicas on Ray Serve, requests that share a few system prompts,
each router with and without the Redis tier; prefix hits, tokens computed, TTFT and throughput.

Every configuration starts fresh replicas (cold caches) and, with the tier, an emptied
redis-server, and runs the same requests in the same order through `ReplicaFront` (the path
`kvserve serve --replicas` takes, without the HTTP hop).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class ReplicaRun:
    router: str
    remote: bool
    wall_s: float
    requests: int
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int       # prompt tokens not computed: local prefix hits and remote blocks
    remote_tokens: int       # of those, loaded from the Redis tier
    tokens_computed: int     # prompt and decode tokens run through the model, all replicas
    ttft_mean_s: float
    ttft_p50_s: float
    requests_per_replica: tuple[int, ...]

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def shared_prefix_prompts(ids: list[int], num_system: int, num_requests: int, system_len: int, user_len: int,
                          seed: int) -> list[list[int]]:
    """`num_requests` prompts: one of `num_system` system prompts (text slices of `system_len`
    tokens) then a user turn of its own (`user_len` tokens), in a random order."""
    rng = random.Random(seed)
    span = system_len + user_len
    if len(ids) < (num_system + num_requests) * span:
        raise ValueError("bench replicas: the text is too short for this many prompts; lower the lengths")
    systems = [ids[i * span:i * span + system_len] for i in range(num_system)]
    base = num_system * span
    return [systems[rng.randrange(num_system)] + ids[base + i * span:base + i * span + user_len]
            for i in range(num_requests)]


async def _drive(front: Any, prompts: list[list[int]], max_tokens: int,
                 concurrency: int) -> list[tuple[float, int, str]]:
    """(TTFT, output tokens, replica) per request, `concurrency` in flight at a time."""
    from kvserve.server.async_engine import Done

    gate = asyncio.Semaphore(concurrency)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)

    async def one(i: int, prompt: list[int]) -> tuple[float, int, str]:
        async with gate:
            start = time.perf_counter()
            ids, sink = await front.submit([prompt], params, f"bench-{i}")
            first, tokens = None, 0
            while not isinstance(item := await sink.get(), Done):
                if isinstance(item, Exception):
                    raise item
                if first is None and item.token_ids:
                    first = time.perf_counter() - start
                tokens = len(item.token_ids)
            return first or 0.0, tokens, front.served_by[ids[0]].replica

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))


def run_config(config: EngineConfig, prompts: list[list[int]], router: str, remote_url: str | None,
               num_replicas: int, max_tokens: int, concurrency: int, stats_period_s: float) -> ReplicaRun:
    from kvserve.replicas.front import ReplicaFront
    from kvserve.replicas.settings import ReplicaSettings

    front = ReplicaFront.start(config.replace(kv_remote=remote_url),
                               ReplicaSettings(num_replicas, router, stats_period_s), max_waiting=len(prompts))
    try:
        start = time.perf_counter()
        results = asyncio.run(_drive(front, prompts, max_tokens, concurrency))
        wall = time.perf_counter() - start
        counters = asyncio.run(front.each_replica("counters"))
        if len(counters) != num_replicas:
            raise RuntimeError(f"bench replicas: {num_replicas - len(counters)} replica(s) did not report counters")
    finally:
        ReplicaFront.stop()
    ttfts = [t for t, _, _ in results]
    served = [r for _, _, r in results]
    total = {key: sum(c[key] for c in counters.values())
             for key in ("prompt_tokens", "cached_tokens", "remote_tokens", "tokens_computed")}
    return ReplicaRun(router, remote_url is not None, wall, len(prompts), sum(n for _, n, _ in results),
                      total["prompt_tokens"], total["cached_tokens"], total["remote_tokens"], total["tokens_computed"],
                      statistics.mean(ttfts), statistics.median(ttfts),
                      tuple(sorted((served.count(r) for r in set(served)), reverse=True)))


def format_runs(runs: list[ReplicaRun]) -> str:
    lines = ["| router | redis tier | prompt tokens | prefix hit rate | of it remote | tokens computed | TTFT mean "
             "| TTFT p50 | output tok/s | requests per replica |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.router} | {'yes' if r.remote else 'no'} | {r.prompt_tokens:,} | {r.hit_rate:.1%} | "
                     f"{r.remote_tokens / max(r.prompt_tokens, 1):.1%} | {r.tokens_computed:,} | "
                     f"{r.ttft_mean_s:.2f} s | "
                     f"{r.ttft_p50_s:.2f} s | {r.tokens_per_s:.1f} | {' / '.join(map(str, r.requests_per_replica))} |")
    return "\n".join(lines)


def run_replicas_bench(args: argparse.Namespace, out: Path) -> None:
    """`kvserve bench replicas`: every router with and without the Redis tier, on shared-prefix prompts."""
    import redis

    from kvserve.bench.workload import load_text_ids
    from kvserve.engine_args import engine_kwargs, llm_from_args
    from kvserve.server.local_redis import start_local_redis

    config = EngineConfig.of(**engine_kwargs(args))
    tokenizer = llm_from_args(args, kv_cache_memory="16MiB").tokenizer  # for the text's ids only
    name, ids = load_text_ids(tokenizer, args.data)
    prompts = shared_prefix_prompts(ids, args.num_system_prompts, args.num_requests, args.system_len,
                                    args.user_len, args.seed)
    runs = []
    for remote in args.remote.split(","):
        url = start_local_redis() if remote == "redis" else None
        for router in args.routers.split(","):
            if url is not None:
                redis.Redis.from_url(url).flushall()
            runs.append(run_config(config, prompts, router, url, args.replicas, args.max_tokens, args.concurrency,
                                   args.router_stats_period))
            print(format_runs(runs[-1:]).splitlines()[-1], flush=True)
    # By hand: each system prompt is computed once, every later request using it hits its full blocks.
    bs = config.cache.block_size
    limit = (len(prompts) - len({tuple(p[:args.system_len]) for p in prompts})) * (args.system_len // bs * bs)
    total = sum(map(len, prompts))
    text = (f"{args.replicas} replicas (Ray Serve, one machine of {torch.get_num_threads()} threads shared), "
            f"{args.num_requests} requests sharing {args.num_system_prompts} system prompts of {args.system_len} "
            f"tokens (+{args.user_len} own), {args.max_tokens} tokens out, {args.concurrency} in flight; text {name}; "
            f"dtype {args.dtype}\n\n" + format_runs(runs) +
            f"\n\nHand limit (every repeat of a system prompt served from a cache, pools of any size): {limit:,} "
            f"of {total:,} prompt tokens cached ({limit / total:.1%}), {total - limit:,} computed.")
    print(text)
    (out / "replicas.md").write_text(text + "\n")
    (out / "replicas.json").write_text(json.dumps([asdict(r) for r in runs], indent=2))
