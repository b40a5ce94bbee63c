"""Draft verification against hand-worked cases and against the law it must keep: the target's
distribution, token for token, as Leviathan et al.'s rejection sampling gives it."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from kvserve.engine.draft_verifier import DraftVerifier
from kvserve.engine.sampler import sample
from kvserve.engine.sequence import Sequence
from kvserve.engine.spec_state import MAX_SKIP, SpecState
from kvserve.sampling_params import SamplingParams

V = 6


def seq(params: SamplingParams, seed: int = 0, outputs: int = 0) -> Sequence:
    return Sequence("r", [1, 2], params, seed, output_token_ids=[3] * outputs, spec=SpecState())


def peaked(tokens: list[int]) -> torch.Tensor:
    """Logits rows whose argmax is each of `tokens`."""
    rows = torch.zeros(len(tokens), V)
    rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return rows


@pytest.mark.parametrize("draft, targets, want", [
    ((4, 1, 2), [4, 1, 2, 5], [4, 1, 2, 5]),   # all accepted, plus the target's next token
    ((4, 1, 2), [4, 0, 2, 5], [4, 0]),         # the second differs: the target's token replaces it
    ((4, 1, 2), [3, 1, 2, 5], [3]),            # the first differs: one token, as without a draft
    ((), [2], [2]),                            # no draft: a plain decode
])
def test_greedy_accepts_the_longest_matching_prefix(draft: tuple[int, ...], targets: list[int],
                                                    want: list[int]) -> None:
    verifier = DraftVerifier()
    s = seq(SamplingParams(temperature=0))
    rows = peaked(targets)
    got = verifier.verify([s], [draft], rows[-1:], rows[:-1] if draft else None)
    assert got == [want]
    if draft:
        assert verifier.stats.accepted_lengths == Counter({len(want) - 1: 1})


def test_rows_of_several_sequences_are_matched_to_their_own_drafts() -> None:
    a, b, c = (seq(SamplingParams(temperature=0)) for _ in range(3))
    drafts = [(1, 2), (), (3,)]
    # Rows before each draft token, sequence by sequence: a's two, c's one; then each one's last.
    draft_rows, last_rows = peaked([1, 0, 3]), peaked([4, 5, 2])
    assert DraftVerifier().verify([a, b, c], drafts, last_rows, draft_rows) == [[1, 0], [5], [3, 2]]


def test_sampled_tokens_keep_the_targets_law_and_each_seeds_tokens() -> None:
    """Drafting token 2 at temperature 1: over many seeds the first token is distributed as p (not
    biased toward the draft), it is the token the same seed draws with no draft, and the draft is
    accepted about p(2) of the time (rejection sampling's rate for a certain proposal)."""
    params = SamplingParams(temperature=1.0)
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.4, 0.05, 0.15, 0.1]]))
    p = torch.softmax(logits[0], dim=-1)
    first, accepted, trials = Counter(), 0, 4000
    for seed in range(trials):
        got = DraftVerifier().verify([seq(params, seed)], [(2,)], logits, logits)[0]
        plain = sample(logits, [params], [seed], [0]).item()
        assert got[0] == plain
        first[got[0]] += 1
        accepted += got[0] == 2
    for token in range(V):
        assert abs(first[token] / trials - p[token].item()) < 0.03, (token, first)
    assert abs(accepted / trials - p[2].item()) < 0.03


def test_back_off_doubles_after_misses_and_resets_on_a_hit() -> None:
    state = SpecState()
    skipped = []
    for _ in range(6):
        state.record(0)
        skipped.append(state.skip)
    assert skipped == [1, 3, 7, 15, MAX_SKIP, MAX_SKIP]
    turns = [state.take_turn() for _ in range(MAX_SKIP + 1)]
    assert turns == [False] * MAX_SKIP + [True]
    state.record(2)
    assert (state.misses, state.skip, state.take_turn()) == (0, 0, True)
