"""Speculative decoding's bookkeeping: a speculating sequence's back-off (`SpecState`) and what the
engine's drafts proposed and won (`SpecDecodeStats`, vLLM's spec-decode metrics).

Back-off: a draft of which nothing is accepted cost a step's extra positions for nothing, so a
sequence whose drafts keep missing (open-ended text, where an n-gram recurs by chance) drafts
less often: after m misses in a row it skips 2^m - 1 steps (at most `MAX_SKIP`), and one accepted
token resets it. A step with no draft costs nothing, so a sequence with no n-gram match is not
counted as a miss.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

MAX_SKIP = 31


@dataclass(eq=False)
class SpecState:
    misses: int = 0  # drafts in a row of which nothing was accepted
    skip: int = 0    # steps left to decode without a draft

    def take_turn(self) -> bool:
        """Whether this step may draft; a skipped step counts down the back-off."""
        if self.skip:
            self.skip -= 1
            return False
        return True

    def record(self, accepted: int) -> None:
        self.misses = 0 if accepted else self.misses + 1
        self.skip = min(2 ** self.misses - 1, MAX_SKIP)


@dataclass
class SpecDecodeStats:
    drafts: int = 0           # drafts verified
    draft_tokens: int = 0     # tokens they proposed
    accepted_tokens: int = 0  # of those, accepted
    accepted_lengths: Counter[int] = field(default_factory=Counter)  # tokens accepted per draft -> drafts

    def record(self, proposed: int, accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        self.accepted_lengths[accepted] += 1

    def summary(self) -> dict[str, float | dict[int, int]]:
        return {"drafts": self.drafts, "draft_tokens": self.draft_tokens, "accepted_tokens": self.accepted_tokens,
                "accepted_lengths": dict(sorted(self.accepted_lengths.items())),
                "mean_acceptance_length": self.mean_acceptance_length}

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft step yields on average: its accepted tokens and the one the
        target model adds after them (vLLM's mean acceptance length)."""
        return 1 + self.accepted_tokens / self.drafts if self.drafts else 0.0
