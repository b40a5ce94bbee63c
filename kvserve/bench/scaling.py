"""Time per generated token against sequence length: cached decoding vs recompute (`no-cache`)."""
from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from kvserve.sampling_params import SamplingParams


def time_per_token(llm: Any, prompt_ids: list[int], num_tokens: int, desc: str) -> list[float]:
    """Seconds each generated token took, in order, for one sequence alone in the engine."""
    params = SamplingParams(max_tokens=num_tokens, temperature=0, ignore_eos=True)
    times = []
    last = time.perf_counter()
    for _ in tqdm(llm.stream(prompt_ids, params), total=num_tokens, desc=desc, unit="tok"):
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def mean_decode_s(times: list[float]) -> float:
    """A run's mean decode step: its first token includes the prefill."""
    return statistics.mean(times[1:])


def median_ratios(rounds: list[dict[str, float]], ours: str) -> dict[str, float]:
    """Per other series, the median over rounds of its mean step / ours in the same round (how many
    times its tokens/s ours gives). Each round runs every series in turn, so a machine that drifts
    between rounds moves both sides of a round's ratio alike."""
    return {name: statistics.median(r[name] / r[ours] for r in rounds) for name in rounds[0] if name != ours}


def plot(prompt_len: int, series: dict[str, list[float]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (per_token, total) = plt.subplots(1, 2, figsize=(11, 4))
    for name, times in series.items():
        lengths = [prompt_len + i + 1 for i in range(len(times))]
        per_token.plot(lengths, [t * 1e3 for t in times], label=name, lw=1)
        cumulative = [sum(times[:i + 1]) for i in range(len(times))]
        total.plot(lengths, cumulative, label=name)
    per_token.set(xlabel="sequence length (tokens)", ylabel="ms per generated token",
                  title="cost of one decode step")
    total.set(xlabel="sequence length (tokens)", ylabel="total seconds",
              title="total generation time (linear vs quadratic)")
    for ax in (per_token, total):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
