"""`kvserve eval`'s report: the worst case over texts and the per-window spread, against numbers
worked by hand."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvserve.eval.report import window_change, worst_case, write_report


def row(cache: str, ppl: float, windows: list[float] | None = None) -> dict:
    out = {"cache": cache, "bytes_per_token": 100.0, "perplexity": ppl}
    return out if windows is None else {**out, "window_perplexity": windows}


TEXTS = {
    "prose": [row("ref", 10.0, [8.0, 12.0]), row("int4", 10.5, [8.8, 12.0]), row("kivi2", 10.2, [8.0, 12.6])],
    "code": [row("ref", 4.0, [4.0, 4.0]), row("int4", 4.1, [4.0, 4.2]), row("kivi2", 4.4, [4.4, 4.4])],
}


def test_the_worst_case_is_each_caches_largest_change_over_the_texts() -> None:
    # int4: +5% on prose, +2.5% on code; kivi2: +2% on prose, +10% on code; ref: 0 on both.
    got = {cache: (worst, where) for cache, worst, where in worst_case(TEXTS)}
    assert got["int4"] == (pytest.approx(5.0), "prose") and got["kivi2"] == (pytest.approx(10.0), "code")
    assert got["ref"] == (0.0, "prose") or got["ref"] == (0.0, "code")


def test_a_cache_one_text_lacks_has_no_worst_case() -> None:
    texts = {"prose": TEXTS["prose"] + [row("HF 4-bit", 11.0)], "code": TEXTS["code"]}
    assert "HF 4-bit" not in [cache for cache, _, _ in worst_case(texts)]


def test_the_spread_is_over_each_windows_own_change() -> None:
    # int4 on prose: windows +10% and 0% -> mean 5, sample sd 7.071; no per-window data -> None.
    mean, sd = window_change(TEXTS["prose"][1], TEXTS["prose"][0])
    assert mean == pytest.approx(5.0) and sd == pytest.approx(50 ** 0.5)
    assert window_change(row("kvpress", 10.0), TEXTS["prose"][0]) is None


def test_the_report_has_a_table_per_text_and_the_worst_case(tmp_path: Path) -> None:
    text = write_report(TEXTS, "protocol", tmp_path, ["a note"])
    assert text.index("### prose") < text.index("### code") < text.index("### Worst case over the 2 texts")
    assert "| kivi2 | +10.00% | code |" in text and "| int4 | 100 | 4.1 | - | - | - | +2.50% | +2.50% ± 3.54 |" in text
    assert (tmp_path / "eval.png").stat().st_size > 0 and "a note" in (tmp_path / "eval.md").read_text()
