"""Request lengths with the long tail real traffic shows: the bench harness's synthetic workloads
and the memory planner's batches draw them the same way."""
from __future__ import annotations

import math

import numpy as np


def lognormal_lengths(
    rng: np.random.Generator, median: int, sigma: float, n: int, low: int, high: int
) -> np.ndarray:
    # A lognormal's median is exp(mu), so mu = log(median) pins the median
    # while sigma controls the long tail real request lengths show.
    raw = rng.lognormal(mean=math.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(raw), low, high).astype(np.int64)
