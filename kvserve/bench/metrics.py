"""Per-request timings and the summary statistics reported by the benchmarks."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields

import numpy as np


@dataclass
class RequestTiming:
    """Times are seconds on the time.perf_counter clock."""

    prompt_len: int
    output_len: int
    arrival: float
    first_token: float
    finish: float


@dataclass
class BenchSummary:
    name: str
    num_requests: int
    wall_s: float
    output_tok_s: float
    total_tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    tpot_p50_ms: float
    tpot_p90_ms: float
    tpot_p99_ms: float
    e2e_p50_ms: float
    e2e_p90_ms: float
    # Engine-specific numbers (e.g. peak KV memory, KV waste) that not every run has.
    extra: dict[str, float] = field(default_factory=dict)


def _percentiles_ms(values_s: list[float], qs: tuple[int, ...]) -> list[float]:
    # NaN rather than an exception keeps a summary printable when, e.g., every
    # request produced a single token and TPOT is undefined.
    if not values_s:
        return [math.nan] * len(qs)
    return [float(v) * 1000.0 for v in np.percentile(values_s, qs)]


def summarize(
    name: str,
    timings: list[RequestTiming],
    wall_s: float,
    extra: dict[str, float] | None = None,
) -> BenchSummary:
    output_tokens = sum(t.output_len for t in timings)
    total_tokens = output_tokens + sum(t.prompt_len for t in timings)
    ttft = [t.first_token - t.arrival for t in timings]
    # TPOT excludes the first token, whose latency is prefill-dominated and
    # already counted by TTFT.
    tpot = [(t.finish - t.first_token) / (t.output_len - 1) for t in timings if t.output_len >= 2]
    e2e = [t.finish - t.arrival for t in timings]
    ttft_p50, ttft_p90, ttft_p99 = _percentiles_ms(ttft, (50, 90, 99))
    tpot_p50, tpot_p90, tpot_p99 = _percentiles_ms(tpot, (50, 90, 99))
    e2e_p50, e2e_p90 = _percentiles_ms(e2e, (50, 90))
    return BenchSummary(
        name=name,
        num_requests=len(timings),
        wall_s=wall_s,
        output_tok_s=output_tokens / wall_s,
        total_tok_s=total_tokens / wall_s,
        ttft_p50_ms=ttft_p50,
        ttft_p90_ms=ttft_p90,
        ttft_p99_ms=ttft_p99,
        tpot_p50_ms=tpot_p50,
        tpot_p90_ms=tpot_p90,
        tpot_p99_ms=tpot_p99,
        e2e_p50_ms=e2e_p50,
        e2e_p90_ms=e2e_p90,
        extra=dict(extra or {}),
    )


def format_table(summaries: list[BenchSummary]) -> str:
    """Markdown table, one row per summary; extra keys become trailing columns."""
    base = [f.name for f in fields(BenchSummary) if f.name != "extra"]
    # dict.fromkeys keeps first-seen order, so columns follow the runs' own ordering.
    extra_keys = list(dict.fromkeys(k for s in summaries for k in s.extra))
    lines = [
        "| " + " | ".join(base + extra_keys) + " |",
        "|" + "---|" * (len(base) + len(extra_keys)),
    ]
    for s in summaries:
        cells = [_fmt(getattr(s, name)) for name in base]
        cells += [_fmt(s.extra.get(k, math.nan)) for k in extra_keys]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _fmt(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def ratio(a: BenchSummary, b: BenchSummary) -> dict[str, float]:
    """a / b for headline metrics: >1 means a is faster for throughput, slower for latency."""
    keys = ("output_tok_s", "total_tok_s", "ttft_p50_ms", "tpot_p50_ms", "e2e_p50_ms")
    return {k: _safe_div(getattr(a, k), getattr(b, k)) for k in keys}


def _safe_div(num: float, den: float) -> float:
    return num / den if den else math.nan


def same_budget_table(names: list[str], rounds: list[list[BenchSummary]], what: str) -> str:
    """One row per configuration of runs at one KV budget, repeated in rounds that each run every
    configuration in turn (`names[i]` is configuration i): medians over the rounds, and the median
    of each round's ratio to that round's first configuration, so the machine's drift between
    rounds cancels out of the ratio."""
    each = len(rounds) > 1
    lines = [f"| {what} | KV bytes/token | capacity (tokens) | peak running seqs | mean running seqs (time-weighted) "
             "| output tok/s | vs first |" + (" vs first, each round |" if each else ""),
             "|---|---|---|---|---|---|---|" + ("---|" if each else "")]
    for i, name in enumerate(names):
        runs = [r[i] for r in rounds]
        peak, mean = (statistics.median(run.extra[k] / r[0].extra[k] for run, r in zip(runs, rounds))
                      for k in ("peak_running", "mean_running"))
        ratios = [run.output_tok_s / r[0].output_tok_s for run, r in zip(runs, rounds)]
        lines.append(f"| {name} | {runs[0].extra['kv_bytes_per_token']:.0f} | {runs[0].extra['capacity_tokens']:.0f} | "
                     f"{statistics.median(run.extra['peak_running'] for run in runs):.0f} ({peak:.2f}x) | "
                     f"{statistics.median(run.extra['mean_running'] for run in runs):.2f} ({mean:.2f}x) | "
                     f"{statistics.median(run.output_tok_s for run in runs):.1f} | {statistics.median(ratios):.2f}x |"
                     + (" " + ", ".join(f"{x:.2f}x" for x in ratios) + " |" if each else ""))
    return "\n".join(lines)
