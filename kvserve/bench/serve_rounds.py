"""Rounds of `kvserve bench serve --rounds N`: the servers take turns round by round (kvserve,
each peer, kvserve again, ...), so that a shared machine drifting between runs (10-20% here) moves
every server alike; the comparison reports each metric's median over the rounds, and each ratio
(kvserve / peer) as the median of the rounds' own ratios, each taken between runs minutes apart.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import numpy as np

from kvserve.bench.serving import ServingSummary

Metric = Callable[[ServingSummary], float | None]

# The metrics the comparison gives as kvserve / peer: above 1 is kvserve ahead for throughputs,
# below 1 for latencies.
RATIOS: dict[str, Metric] = {
    "output tok/s": lambda s: s.output_tok_s,
    "total tok/s": lambda s: s.total_tok_s,
    "goodput": lambda s: s.goodput,
    "TTFT p99": lambda s: s.ms["ttft"]["p99"],
    "TPOT p99": lambda s: s.ms["tpot"]["p99"],
    "ITL p99": lambda s: s.ms["itl"]["p99"],
    "E2EL p99": lambda s: s.ms["e2el"]["p99"],
}


def round_order(servers: list[str], rounds: int) -> list[tuple[int, str]]:
    """(round, server) in the order they run: every server once per round, in the given order."""
    return [(r, name) for r in range(rounds) for name in servers]


def median_summary(runs: list[ServingSummary]) -> ServingSummary:
    """Each metric's median over `runs` (the counts: the lower median, a count one round had;
    goodput only where every round has SLOs)."""
    def med(values: list[float]) -> float:
        return float(np.median(values))  # NaN where a round has none (numpy's, unlike statistics')

    goodputs = [s.goodput for s in runs]
    return ServingSummary(
        completed=statistics.median_low(s.completed for s in runs), failed=statistics.median_low(s.failed for s in runs),
        duration_s=med([s.duration_s for s in runs]), request_throughput=med([s.request_throughput for s in runs]),
        output_tok_s=med([s.output_tok_s for s in runs]), total_tok_s=med([s.total_tok_s for s in runs]),
        goodput=None if None in goodputs else med([g for g in goodputs if g is not None]),
        ms={metric: {stat: med([s.ms[metric][stat] for s in runs]) for stat in stats}
            for metric, stats in runs[0].ms.items()})


def median_ratio(ours: list[ServingSummary], peer: list[ServingSummary], metric: Metric) -> float | None:
    """The median over rounds of ours / peer in the same round; None where a round has no ratio
    (the peer's value 0 or missing, as a goodput no request met)."""
    ratios = []
    for a, b in zip(ours, peer, strict=True):
        x, y = metric(a), metric(b)
        if x is None or y is None or not y > 0 or math.isnan(x):
            return None
        ratios.append(x / y)
    return statistics.median(ratios)


def comparison_table(runs: dict[str, list[ServingSummary]], skipped: dict[str, str]) -> list[str]:
    """One row per server (medians over its rounds), one of ratios per peer against the first
    server, one per skipped peer with its reason."""
    lines = ["| server | rounds | completed req/s | output tok/s | total tok/s | goodput req/s | TTFT p50 / p99 ms "
             "| TPOT p50 / p99 ms | ITL p99 ms | E2EL p99 ms | failed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, summaries in runs.items():
        s = median_summary(summaries)
        ttft, tpot = s.ms["ttft"], s.ms["tpot"]
        lines.append(f"| {name} | {len(summaries)} | {s.request_throughput:.2f} | {s.output_tok_s:.1f} | "
                     f"{s.total_tok_s:.1f} | {'-' if s.goodput is None else f'{s.goodput:.2f}'} | "
                     f"{ttft['p50']:.0f} / {ttft['p99']:.0f} | {tpot['p50']:.1f} / {tpot['p99']:.1f} | "
                     f"{s.ms['itl']['p99']:.1f} | {s.ms['e2el']['p99']:.0f} | {s.failed} |")
    first, *peers = runs
    for peer in peers:
        r = {k: median_ratio(runs[first], runs[peer], metric) for k, metric in RATIOS.items()}

        def x(key: str) -> str:
            return "-" if r[key] is None else f"{r[key]:.2f}x"
        lines.append(f"| {first} / {peer} | | | {x('output tok/s')} | {x('total tok/s')} | {x('goodput')} | "
                     f"p99 {x('TTFT p99')} | p99 {x('TPOT p99')} | {x('ITL p99')} | {x('E2EL p99')} | |")
    lines += [f"| {name} | skipped: {reason} | | | | | | | | | |" for name, reason in skipped.items()]
    return lines


def each_round(runs: dict[str, list[ServingSummary]]) -> list[str]:
    """Each server's values round by round, the raw numbers behind the medians."""
    def values(summaries: list[ServingSummary], metric: Metric, digits: int) -> str:
        return ", ".join("-" if (v := metric(s)) is None else f"{v:.{digits}f}" for s in summaries)

    return [f"- {name}, each round: output tok/s {values(summaries, RATIOS['output tok/s'], 1)}; TTFT p99 ms "
            f"{values(summaries, RATIOS['TTFT p99'], 0)}; TPOT p99 ms {values(summaries, RATIOS['TPOT p99'], 1)}; "
            f"goodput {values(summaries, RATIOS['goodput'], 2)}" for name, summaries in runs.items()]
