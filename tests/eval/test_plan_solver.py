"""The plan solver against brute force over every assignment."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from kvserve.eval.plan_solver import solve


def brute(size: np.ndarray, loss: np.ndarray, max_loss: float | None, max_size: int | None) -> tuple[int, float]:
    """(size, loss) of the best assignment by enumeration: the same objective as `solve`."""
    best = None
    for picks in itertools.product(range(size.shape[1]), repeat=size.shape[0]):
        s = int(sum(size[i, f] for i, f in enumerate(picks)))
        c = float(sum(loss[i, f] for i, f in enumerate(picks)))
        if max_loss is not None and c <= max_loss + 1e-12:
            key = (s, c)
        elif max_size is not None and s <= max_size:
            key = (c, s)
        else:
            continue
        best = key if best is None or key < best else best
    assert best is not None
    return (best[0], best[1]) if max_loss is not None else (best[1], best[0])


@pytest.mark.parametrize("seed", range(12))
def test_solve_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    layers, options = rng.integers(1, 5), rng.integers(1, 4)
    size = rng.integers(1, 20, size=(layers, options))
    loss = rng.random((layers, options)).round(3)
    max_loss = float(loss.min(axis=1).sum() + rng.random())
    picks = solve(size, loss, max_loss=max_loss)
    got = (int(sum(size[i, f] for i, f in enumerate(picks))), float(sum(loss[i, f] for i, f in enumerate(picks))))
    want = brute(size, loss, max_loss, None)
    assert got[0] == want[0] and got[1] <= max_loss + 1e-9
    max_size = int(size.min(axis=1).sum() + rng.integers(0, 10))
    picks = solve(size, loss, max_size=max_size)
    got = (int(sum(size[i, f] for i, f in enumerate(picks))), float(sum(loss[i, f] for i, f in enumerate(picks))))
    want = brute(size, loss, None, max_size)
    assert got[0] <= max_size and got[1] == pytest.approx(want[1])


def test_a_worked_example_and_impossible_bounds() -> None:
    # Two layers; options (full 8 B, loss 0), (int8 4 B, 0.01 or 0.2), (int4 2 B, 0.05 or 0.9).
    size = np.array([[8, 4, 2], [8, 4, 2]])
    loss = np.array([[0.0, 0.01, 0.05], [0.0, 0.2, 0.9]])
    assert solve(size, loss, max_loss=0.06) == [2, 0]    # 10 B: the sensitive layer stays full
    assert solve(size, loss, max_loss=0.25) == [2, 1]    # 6 B
    assert solve(size, loss, max_size=8) == [1, 1]       # 0.21 beats int4 + full (0.05 + 0 at 10 B: too big)
    with pytest.raises(ValueError, match="no assignment has a loss"):
        solve(size, loss, max_loss=-1)
    with pytest.raises(ValueError, match="no assignment fits 3"):
        solve(size, loss, max_size=3)
    with pytest.raises(ValueError, match="exactly one"):
        solve(size, loss)
