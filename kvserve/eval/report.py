"""`kvserve eval`'s report: a table per text, the worst case over texts, and a plot of quality
against bytes per token (eval.md, eval.json, eval.png).

Each row of a text carries its windows' perplexities, so the change against the reference is
shown as its mean over the text's windows with their standard deviation: a difference smaller
than the spread between windows is noise, not a result. The worst case of a cache is its largest
perplexity change over the texts (the overall change per text, not per window).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

REFERENCE = 0  # every text's rows start with the reference cache


def cell(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):  # not measured (e.g. --greedy-prompts 0)
        return "-"
    if isinstance(value, float) and value >= 100:
        return f"{value:,.0f}"
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def format_row(row: dict[str, Any]) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                     if not isinstance(v, list))


def change(row: dict[str, Any], reference: dict[str, Any]) -> float:
    """Perplexity change against the reference cache on the same windows, percent."""
    return 100 * (row["perplexity"] / reference["perplexity"] - 1)


def window_change(row: dict[str, Any], reference: dict[str, Any]) -> tuple[float, float] | None:
    """Mean and standard deviation over windows of each window's perplexity change, percent; None
    for rows measured without per-window perplexities (kvpress, HF)."""
    if "window_perplexity" not in row:
        return None
    changes = [100 * (p / r - 1) for p, r in zip(row["window_perplexity"], reference["window_perplexity"])]
    return statistics.fmean(changes), statistics.stdev(changes) if len(changes) > 1 else 0.0


def worst_case(texts: dict[str, list[dict[str, Any]]]) -> list[tuple[str, float, str]]:
    """(cache, largest perplexity change over the texts, the text it was on) for every cache that
    every text measured, in the first text's order."""
    by_text = {name: {r["cache"]: change(r, rows[REFERENCE]) for r in rows} for name, rows in texts.items()}
    first = next(iter(texts.values()))
    out = []
    for row in first:
        found = [(c[row["cache"]], name) for name, c in by_text.items() if row["cache"] in c]
        if len(found) == len(texts):
            worst, where = max(found)
            out.append((row["cache"], worst, where))
    return out


def text_table(rows: list[dict[str, Any]], header: str) -> list[str]:
    base = rows[REFERENCE]
    cols = ["bytes_per_token", "perplexity", "kl", "top1", "greedy_agree",
            *[k for k in base if k.startswith("passkey@")]]
    lines = [header, "", "| cache | " + " | ".join(cols) + " | ppl vs reference | per window (mean ± sd) |",
             "|---" * (len(cols) + 3) + "|"]
    for r in rows:
        spread = window_change(r, base)
        per_window = "-" if spread is None else f"{spread[0]:+.2f}% ± {spread[1]:.2f}"
        lines.append(f"| {r['cache']} | " + " | ".join(cell(r.get(c)) for c in cols)
                     + f" | {change(r, base):+.2f}% | {per_window} |")
    for r in rows:
        if "top1_vs_kvpress_full" in r:
            lines.append(f"\n{r['cache']}: top-1 agreement with kvpress' full cache {r['top1_vs_kvpress_full']:.3f}")
        if "hf_full_perplexity" in r:
            lines.append(f"\n{r['cache']}: HF full-precision cache perplexity {r['hf_full_perplexity']:.3f} "
                         f"in the same run; top-1 agreement with it {r['top1_vs_hf_full']:.3f}")
        if "kept_fraction" in r:
            lines.append(f"\n{r['cache']}: kept fraction {r['kept_fraction']}")
    return lines


def write_report(texts: dict[str, list[dict[str, Any]]], protocol: str, out: Path, notes: list[str]) -> str:
    """Writes eval.md, eval.json and eval.png under `out`; returns the markdown."""
    lines = [protocol]
    for name, rows in texts.items():
        lines += ["", *text_table(rows, f"### {name}")]
    if len(texts) > 1:
        lines += ["", f"### Worst case over the {len(texts)} texts", "", "| cache | largest ppl change | on |",
                  "|---|---|---|"]
        lines += [f"| {cache} | {worst:+.2f}% | {where} |" for cache, worst, where in worst_case(texts)]
    lines += [f"\n{note}" for note in notes]
    text = "\n".join(lines)
    (out / "eval.md").write_text(text + "\n")
    (out / "eval.json").write_text(json.dumps(texts, indent=2))
    _plot(texts, out / "eval.png")
    return text


def _plot(texts: dict[str, list[dict[str, Any]]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(texts), figsize=(7 * len(texts), 4.5), squeeze=False)
    for ax, (name, rows) in zip(axes[0], texts.items()):
        for r in rows:
            if "bytes_per_token" not in r:  # kvpress rows: same bytes as the reference, fewer tokens
                continue
            ax.scatter(r["bytes_per_token"], r["perplexity"], marker="s" if r["cache"].startswith("HF") else "o")
            ax.annotate(r["cache"].replace("kvserve ", "").replace("HF QuantizedCache", "HF"),
                        (r["bytes_per_token"], r["perplexity"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("KV bytes per token (all layers, K+V)")
        ax.set_ylabel(f"perplexity (decoded half), {name}")
        ax.set_title("KV-cache format: quality vs memory")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
