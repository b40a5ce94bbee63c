"""Prompt attention alone, over SmolLM2's shapes (9 query heads, 3 KV heads, head dim 64) on bf16
pages: `python benchmarks/prompt_attention.py ROOT SEQS PREFIX NEW [REPS]`.

Each of SEQS sequences adds NEW tokens after PREFIX tokens already in its pages, as a multi-turn
prefill step after a prefix-cache hit does, through 30 layers' pools (random keys and values in
blocks handed out in a random order). Prints the median of REPS (default 10) passes over the 30
layers and the rate in GFLOP/s (4 x head dim per query row and key it sees: the scores' and the
values' multiply-adds). ROOT is a kvserve source tree, so that two builds can be alternated.
"""

import statistics
import sys
import time


def main(root: str, seqs: int, prefix: int, new: int, reps: int) -> None:
    sys.path.insert(0, root)
    import kvserve  # noqa: F401  (before torch: kvserve sets OpenMP's spin, threads.py)
    import torch
    from kvserve.attention import StepMetadata
    from kvserve.attention.selector import BACKENDS
    from kvserve.cache.kv_pool import KVPool

    layers, heads, kv_heads, dim, block = 30, 9, 3, 64, 16
    ctx = prefix + new
    blocks = -(-ctx // block)
    gen = torch.Generator().manual_seed(0)
    runs = []
    for _ in range(layers):
        pool = KVPool(1, blocks * seqs, block, kv_heads, dim, torch.bfloat16, torch.device("cpu"))
        for pages in pool.layers[0]:
            pages.normal_(generator=gen)
        order = torch.randperm(blocks * seqs, generator=gen).tolist()
        tables = [order[i * blocks:(i + 1) * blocks] for i in range(seqs)]
        backend = BACKENDS["cpu"](pool, heads)
        step = StepMetadata.build([new] * seqs, [ctx] * seqs, tables, block, torch.device("cpu"),
                                  kv_plan=pool.write_plan(None))
        runs.append((backend, backend.prepare(step)))
    q = torch.randn(seqs * new, heads, dim, generator=gen).bfloat16()
    none = torch.empty(0)

    def sweep() -> float:
        start = time.perf_counter()
        for backend, meta in runs:
            backend.forward(0, q, none, none, meta, dim ** -0.5)  # the pages hold every key already
        return time.perf_counter() - start

    sweep()
    ms = statistics.median(sweep() for _ in range(reps)) * 1e3
    pairs = seqs * heads * sum(prefix + i + 1 for i in range(new))
    gflop = layers * pairs * dim * 4 / 1e9
    print(f"{seqs} x {new} new after {prefix}: {ms:.1f} ms for {layers} layers, {gflop / ms * 1e3:.0f} GFLOP/s")


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) not in (4, 5):
        sys.exit(__doc__)
    main(args[0], int(args[1]), int(args[2]), int(args[3]), int(args[4]) if len(args) == 5 else 10)
