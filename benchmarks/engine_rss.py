"""The engine's RSS with requests arriving continuously, in one process (no server):
`python benchmarks/engine_rss.py [requests] [engine options as JSON]`.

32 requests run at once; each finished one is replaced by a new one (random token prompts of
20-400 tokens, 4-60 output tokens). Prints RSS every 100 requests and, from request 100 on,
the growth of Python allocations (tracemalloc), to tell native memory from Python objects.
"""
from __future__ import annotations

import gc
import json
import os
import random
import sys
import time
import tracemalloc

from kvserve import LLM, SamplingParams
from kvserve.bench.soak import rss_mib


def main() -> None:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    engine = LLM(kv_cache_memory="256MiB", max_model_len=2048, max_num_seqs=32, **options).engine
    rng = random.Random(0)

    def add() -> None:
        engine.add_request([rng.randrange(100, 5000) for _ in range(rng.randint(20, 400))],
                           SamplingParams(max_tokens=rng.randint(4, 60), ignore_eos=True))

    for _ in range(32):
        add()
    tracemalloc.start()
    done, start, base, snapshot = 0, time.time(), 0.0, None
    while done < total:
        for out in engine.step():
            if not out.finished:
                continue
            done += 1
            add()
            if done == 100:
                gc.collect()
                snapshot, base = tracemalloc.take_snapshot(), rss_mib(os.getpid())
            if done % 100 == 0:
                print(f"{done} requests: RSS {rss_mib(os.getpid()):,.0f} MiB ({time.time() - start:.0f} s)", flush=True)
    gc.collect()
    python_growth = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(snapshot, "filename"))
    print(f"from request 100 on: RSS {rss_mib(os.getpid()) - base:+,.0f} MiB, Python allocations "
          f"{python_growth / 2**10:+,.0f} KiB")


if __name__ == "__main__":
    main()
