import pytest

from kvserve.bench.scaling import mean_decode_s, median_ratios


def test_the_mean_decode_step_leaves_out_the_first_token_which_holds_the_prefill() -> None:
    assert mean_decode_s([0.5, 0.01, 0.02, 0.03]) == pytest.approx(0.02)


def test_ratios_are_taken_within_each_round_then_the_median_over_rounds() -> None:
    # Round 2 ran on a machine twice as slow for both engines: its ratio is round 1's. The median
    # of per-round ratios (1.5, 1.5, 1.0) is 1.5; the ratio of the medians would give 15 / 12 = 1.25.
    rounds = [{"ours": 0.010, "peer": 0.015},
              {"ours": 0.020, "peer": 0.030},
              {"ours": 0.012, "peer": 0.012}]
    assert median_ratios(rounds, "ours") == {"peer": pytest.approx(1.5)}


def test_every_other_series_gets_a_ratio_and_ours_none() -> None:
    rounds = [{"ours": 0.01, "a": 0.02, "b": 0.005}]
    assert median_ratios(rounds, "ours") == {"a": pytest.approx(2.0), "b": pytest.approx(0.5)}
