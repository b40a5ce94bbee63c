"""Attention backends side by side on one layer: the same pages, block tables and queries."""
from __future__ import annotations

import time

import torch

from kvserve.attention import StepMetadata
from kvserve.attention.selector import BACKENDS
from kvserve.cache.formats import make_format
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import QuantizedKVPool

# (name, query length per sequence, context per sequence, sequences)
SHAPES = [("decode 1 x 256", 1, 256, 1), ("decode 1 x 2048", 1, 2048, 1),
          ("decode 32 x 256", 1, 256, 32), ("decode 32 x ragged 16..1024", 1, 0, 32),
          ("prefill 4 x 256", 256, 256, 4)]


def _pool(fmt: str, num_blocks: int, block_size: int, kv_heads: int, dim: int,
          dtype: torch.dtype) -> KVPool | QuantizedKVPool:
    if fmt == "auto":
        return KVPool(1, num_blocks, block_size, kv_heads, dim, dtype, torch.device("cpu"))
    formats = make_format(fmt, "k"), make_format(fmt, "v")
    return QuantizedKVPool(num_blocks, block_size, kv_heads, dim, dtype, torch.device("cpu"), [formats], 0, 0)


def time_backends(formats: list[str], heads: int = 9, kv_heads: int = 3, dim: int = 64, block_size: int = 16,
                  dtype: torch.dtype = torch.bfloat16, reps: int = 20) -> list[dict[str, object]]:
    """Median microseconds per layer call of every backend that serves each format."""
    for fmt in formats:
        if fmt != "auto" and not make_format(fmt, "k").per_token:
            raise ValueError(f"--formats: {fmt} pages are encoded a block at a time through full-precision staging, "
                             "which this one-layer bench does not model; time them with `kvserve bench kv-formats`")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for fmt in formats:
        for name, q_len, ctx, batch in SHAPES:
            ctxs = ([int(c) for c in torch.randint(16, 1025, (batch,), generator=gen)] if ctx == 0
                    else [ctx] * batch)
            blocks = [-(-c // block_size) for c in ctxs]
            perm = torch.randperm(sum(blocks), generator=gen).tolist()
            tables, start = [], 0
            for n in blocks:
                tables.append(perm[start:start + n])
                start += n
            total = q_len * batch
            q = torch.randn(total, heads, dim, generator=gen).to(dtype)
            k = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
            v = torch.randn(total, kv_heads, dim, generator=gen).to(dtype)
            row: dict[str, object] = {"format": fmt, "shape": name}
            for backend_name, cls in BACKENDS.items():
                pool = _pool(fmt, sum(blocks), block_size, kv_heads, dim, dtype)
                if cls.unsupported(pool, torch.device("cpu")) is not None:
                    row[backend_name] = None
                    continue
                backend = cls(pool, heads)
                # No staging here: the pool's plan is the same per-token one for every step.
                step = StepMetadata.build([q_len] * batch, ctxs, tables, block_size, torch.device("cpu"),
                                          kv_plan=pool.write_plan(None))
                meta = backend.prepare(step)
                backend.forward(0, q, k, v, meta, dim ** -0.5)
                times = []
                for _ in range(reps):
                    start_t = time.perf_counter()
                    backend.forward(0, q, k, v, meta, dim ** -0.5)
                    times.append(time.perf_counter() - start_t)
                row[backend_name] = sorted(times)[len(times) // 2] * 1e6
            rows.append(row)
    return rows


def format_rows(rows: list[dict[str, object]]) -> str:
    names = list(BACKENDS)
    lines = ["| format | step | " + " | ".join(f"{n} us" for n in names) + " | torch / cpu |",
             "|---|---|" + "---|" * (len(names) + 1)]
    for row in rows:
        cells = ["-" if row[n] is None else f"{row[n]:.0f}" for n in names]
        speedup = (f"{row['torch'] / row['cpu']:.1f}x" if row.get("cpu") and row.get("torch") else "-")
        lines.append(f"| {row['format']} | {row['shape']} | " + " | ".join(cells) + f" | {speedup} |")
    return "\n".join(lines)
