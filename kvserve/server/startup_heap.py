"""The server's startup heap, frozen out of the collector's reach once serving starts.

`kvserve serve` and each replica of `kvserve serve --replicas` call `freeze_startup_heap` when their
engine runs: everything made before then lives as long as the process.
"""
from __future__ import annotations

import gc


def freeze_startup_heap() -> None:
    """Moves every object alive now (the model, tokenizer and engine: ~230,000 objects for SmolLM2)
    out of the collector's reach. They live as long as the server, and each oldest-generation
    collection walked them all, with the whole server stopped: 131 ms in a 13-second multi-turn
    run, where the same collection after freezing took 0.5 ms (AMD Zen 4, BENCHMARKS.md). vLLM
    freezes its engine and API processes so too."""
    gc.collect()
    gc.freeze()
