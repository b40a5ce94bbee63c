"""The cheapest per-layer format assignment within a quality budget (or the best within a size).

Each layer picks one option; option f of layer l costs `size[l, f]` bytes and `loss[l, f]` (KL or
perplexity loss when only that layer is compressed so, summed over layers: to first order small
per-layer errors add). An exact dynamic programme over the total size: `best[s]` is the least loss
of any assignment of the layers so far whose sizes sum to exactly s.
"""
from __future__ import annotations

import numpy as np


def solve(size: np.ndarray, loss: np.ndarray, max_loss: float | None = None,
          max_size: int | None = None) -> list[int]:
    """Option index per layer: with `max_loss`, the smallest total size whose summed loss is at
    most it (ties: the lower loss); with `max_size`, the least summed loss within that size.
    size [L, F] non-negative ints, loss [L, F]. Raises ValueError when nothing meets the bound."""
    if (max_loss is None) == (max_size is None):
        raise ValueError("solve: give exactly one of max_loss and max_size")
    size = np.asarray(size, dtype=np.int64)
    loss = np.asarray(loss, dtype=np.float64)
    layers, options = size.shape
    total = int(size.max(axis=1).sum())
    best = np.full(total + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros((layers, total + 1), dtype=np.int16)
    for layer in range(layers):
        nxt = np.full(total + 1, np.inf)
        for f in range(options):
            s = int(size[layer, f])
            shifted = np.full(total + 1, np.inf)
            shifted[s:] = best[:total + 1 - s] + loss[layer, f]
            better = shifted < nxt
            nxt[better] = shifted[better]
            choice[layer, better] = f
        best = nxt
    if max_loss is not None:
        feasible = np.flatnonzero(best <= max_loss + 1e-12)
        if not len(feasible):
            raise ValueError(f"no assignment has a loss of at most {max_loss:g} (the least is {best.min():g})")
        at = int(feasible[0])
    else:
        within = best[:max_size + 1] if max_size >= 0 else best[:0]
        if not np.isfinite(within).any():
            smallest = int(np.flatnonzero(np.isfinite(best))[0])
            raise ValueError(f"no assignment fits {max_size} (the smallest is {smallest})")
        at = int(np.argmin(within))
    picks = []
    for layer in range(layers - 1, -1, -1):
        f = int(choice[layer, at])
        picks.append(f)
        at -= int(size[layer, f])
    return picks[::-1]
