import math

import pytest

from kvserve.bench.metrics import RequestTiming, format_table, ratio, same_budget_table, summarize

TIMINGS = [
    # ttft 0.1s, tpot 0.4/4 = 0.1s, e2e 0.5s
    RequestTiming(prompt_len=10, output_len=5, arrival=0.0, first_token=0.1, finish=0.5),
    # ttft 0.2s, tpot 0.4/2 = 0.2s, e2e 0.6s
    RequestTiming(prompt_len=20, output_len=3, arrival=0.0, first_token=0.2, finish=0.6),
    # ttft 0.3s, no tpot (one token), e2e 0.3s
    RequestTiming(prompt_len=30, output_len=1, arrival=1.0, first_token=1.3, finish=1.3),
]


def test_summarize_hand_worked() -> None:
    s = summarize("toy", TIMINGS, wall_s=2.0)
    assert s.num_requests == 3
    assert s.output_tok_s == pytest.approx(9 / 2.0)
    assert s.total_tok_s == pytest.approx(69 / 2.0)
    # numpy linear interpolation: p90 of 3 values sits 0.8 of the way from 2nd to 3rd.
    assert (s.ttft_p50_ms, s.ttft_p90_ms, s.ttft_p99_ms) == pytest.approx((200, 280, 298))
    assert (s.tpot_p50_ms, s.tpot_p90_ms, s.tpot_p99_ms) == pytest.approx((150, 190, 199))
    assert (s.e2e_p50_ms, s.e2e_p90_ms) == pytest.approx((500, 580))
    assert s.extra == {}


def test_tpot_nan_when_all_single_token() -> None:
    s = summarize("one", TIMINGS[2:], wall_s=1.0)
    assert math.isnan(s.tpot_p50_ms)
    assert s.ttft_p50_ms == pytest.approx(300)


def test_format_table_includes_extra_columns() -> None:
    a = summarize("a", TIMINGS, wall_s=2.0, extra={"peak_kv_mib": 12.5})
    b = summarize("b", TIMINGS, wall_s=4.0)
    lines = format_table([a, b]).splitlines()
    assert len(lines) == 4
    assert lines[0].startswith("| name |") and lines[0].endswith("| peak_kv_mib |")
    assert lines[2].startswith("| a | 3 | 2.00 | 4.50 |") and lines[2].endswith("| 12.50 |")
    assert lines[3].endswith("| nan |")


def test_ratio() -> None:
    a = summarize("a", TIMINGS, wall_s=1.0)
    b = summarize("b", TIMINGS, wall_s=2.0)
    r = ratio(a, b)
    assert r["output_tok_s"] == pytest.approx(2.0)
    assert r["ttft_p50_ms"] == pytest.approx(1.0)


def test_same_budget_table_takes_medians_of_each_rounds_ratio() -> None:
    """Three rounds of two configurations, worked by hand: 9 output tokens over each wall time."""
    def run(wall: float, mean: float) -> object:
        return summarize("x", TIMINGS, wall_s=wall, extra={"kv_bytes_per_token": 100.0, "capacity_tokens": 640.0,
                                                             "peak_running": 10.0 if mean < 6 else 20.0,
                                                             "mean_running": mean})
    # base 9, 4.5, 18 tok/s; other 18, 6, 20: ratios 2.0, 1.33, 1.11 in their own rounds
    rounds = [[run(1.0, 5.0), run(0.5, 10.0)], [run(2.0, 5.0), run(1.5, 5.5)], [run(0.5, 5.0), run(0.45, 20.0)]]
    lines = same_budget_table(["kvserve a", "kvserve b"], rounds, "format").splitlines()
    assert lines[0].endswith("| vs first | vs first, each round |")
    assert lines[2] == "| kvserve a | 100 | 640 | 10 (1.00x) | 5.00 (1.00x) | 9.0 | 1.00x | 1.00x, 1.00x, 1.00x |"
    # b's median rate over the median base rate would say 2.00x; the rounds' own ratios say 1.33x
    assert lines[3] == "| kvserve b | 100 | 640 | 20 (2.00x) | 10.00 (2.00x) | 18.0 | 1.33x | 2.00x, 1.33x, 1.11x |"
    one = same_budget_table(["kvserve a", "kvserve b"], rounds[:1], "format").splitlines()
    assert one[0].endswith("| vs first |") and one[3].endswith("| 18.0 | 2.00x |")
