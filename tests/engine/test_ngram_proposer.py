"""Prompt lookup's proposer against drafts worked by hand and a brute-force search."""
from __future__ import annotations

import random

import pytest

from kvserve.engine.ngram_proposer import NgramProposer


def brute_force(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, position by position: the longest n in [lo, hi] whose suffix occurs
    earlier, its latest earlier occurrence, the k tokens after it."""
    for n in range(hi, lo - 1, -1):
        if n >= len(tokens):
            continue
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[-n:]:
                return tokens[start + n:start + n + k]
    return []


@pytest.mark.parametrize("tokens, k, want", [
    ([1, 2, 3, 4, 1, 2], 3, [3, 4, 1]),                 # the 2-gram [1, 2] occurred at 0
    ([5, 6, 7, 9, 6, 7, 8, 5, 6, 7], 3, [9, 6, 7]),     # [5, 6, 7] beats the more recent [6, 7]
    ([1, 2, 8, 1, 2, 9, 1, 2], 3, [9, 1, 2]),           # of two [1, 2]s, the later
    ([1, 2, 3, 4], 2, []),                              # nothing repeats
    ([7, 7], 4, [7]),                                   # the draft stops where the tokens do
    ([3], 2, []),                                       # no earlier token at all
])
def test_drafts_worked_by_hand(tokens: list[int], k: int, want: list[int]) -> None:
    assert NgramProposer(k, 1, 3).propose(tokens) == want


def test_prompt_lookup_min_leaves_out_shorter_matches() -> None:
    assert NgramProposer(2, 2, 3).propose([4, 9, 1, 4]) == []       # only the 1-gram [4] repeats
    assert NgramProposer(2, 1, 3).propose([4, 9, 1, 4]) == [9, 1]


def test_drafts_equal_a_brute_force_search() -> None:
    rng = random.Random(0)
    for _ in range(500):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 40))]
        k, lo = rng.randint(1, 5), rng.randint(1, 3)
        hi = lo + rng.randint(0, 3)
        assert NgramProposer(k, lo, hi).propose(tokens) == brute_force(tokens, k, lo, hi), (tokens, k, lo, hi)
