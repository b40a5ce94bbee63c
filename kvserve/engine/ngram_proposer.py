"""Prompt lookup (n-gram) speculation's proposer, as vLLM's `speculative="ngram"` names it: the
draft for a sequence is what followed the last earlier occurrence of its trailing n-gram.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, the sequence's last n tokens are
looked for among its earlier tokens (prompt and output alike); the longest n that occurs wins,
and of its occurrences the most recent, whose next `num_speculative_tokens` tokens (fewer where
the sequence ends first) are the draft. Copying tasks (editing a given text, answering from a
document, a chat that quotes earlier turns) repeat long runs of their context, which is where a
draft that costs no model pays. No occurrence: no draft, and the sequence decodes as usual.

One numpy pass per n over a sequence's tokens (a sliding-window comparison), not a Python loop
over positions; the engine asks only for the sequences that speculate this step.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view



@dataclass(frozen=True)
class NgramProposer:
    """Settings as SpeculativeOptions checked them (every one >= 1, min <= max)."""
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4

    def propose(self, token_ids: list[int]) -> list[int]:
        """The draft that follows `token_ids` (empty: nothing earlier matches its end)."""
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1):
            # Windows starting at 0 .. len - n - 1: every earlier n-gram, not the suffix itself.
            windows = sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n
                return tokens[start:start + self.num_speculative_tokens].tolist()
        return []
