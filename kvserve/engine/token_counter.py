"""Counts what the engine computed and sampled, as tokens join their sequences."""
from __future__ import annotations

from kvserve.engine.sequence import Sequence


class TokenCounter:
    def __init__(self) -> None:
        self.computed = 0  # tokens run through the model, prefill and decode
        self.generated = 0  # tokens sampled, beams and forks included

    def append(self, seq: Sequence, token: int, now: float) -> None:
        """The step computed every token but the new one."""
        seq.output_token_ids.append(token)
        self.count(seq, now)

    def count(self, seq: Sequence, now: float) -> None:
        """A token already in `seq` (a read placeholder's) was sampled at `now`."""
        self.generated += 1
        seq.out.first_token_time = seq.out.first_token_time or now
