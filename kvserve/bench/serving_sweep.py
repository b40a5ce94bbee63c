"""A request-rate sweep of `kvserve bench serve`: one run per rate, drawn as the latency-throughput
curve (`vllm bench serve` users sweep `--request-rate` by hand and plot the same two axes)."""
from __future__ import annotations

import math
from pathlib import Path

from kvserve.bench.serving import ServingSummary


def sweep_table(rows: list[tuple[float, ServingSummary]]) -> list[str]:
    """One row per rate: what the server sustained and the latencies it cost."""
    lines = ["| request rate (req/s) | completed req/s | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms "
             "| goodput req/s |", "|---|---|---|---|---|---|"]
    for rate, s in rows:
        ttft, tpot = s.ms["ttft"], s.ms["tpot"]
        goodput = "-" if s.goodput is None else f"{s.goodput:.2f}"
        lines.append(f"| {'inf' if math.isinf(rate) else f'{rate:g}'} | {s.request_throughput:.2f} | "
                     f"{s.output_tok_s:.1f} | {ttft['p50']:.0f} / {ttft['p99']:.0f} | "
                     f"{tpot['p50']:.1f} / {tpot['p99']:.1f} | {goodput} |")
    return lines


def plot_sweep(curves: dict[str, list[tuple[float, ServingSummary]]], path: Path) -> None:
    """p99 TTFT and p99 TPOT against output tok/s, a point per rate labelled with it, a curve per
    server."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric in zip(axes, ("ttft", "tpot")):
        for name, rows in curves.items():
            x = [s.output_tok_s for _, s in rows]
            y = [s.ms[metric]["p99"] for _, s in rows]
            ax.plot(x, y, marker="o", label=name)
            for rate, xi, yi in zip((r for r, _ in rows), x, y):
                ax.annotate("inf" if math.isinf(rate) else f"{rate:g}/s", (xi, yi), fontsize=8,
                            textcoords="offset points", xytext=(4, 4))
        ax.set(xlabel="output tok/s", ylabel=f"p99 {metric.upper()} (ms)",
               title=f"p99 {metric.upper()} against throughput, one point per request rate")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
