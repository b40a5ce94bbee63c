"""Which sequences draft in a step, and how many tokens: the scheduler's side of speculative
decoding (the drafts travel in its output; engine/draft_verifier.py judges them after the step).

A draft never reaches past what the sequence may still produce: its tokens, the one the target
adds after them, and its context all fit `max_tokens` and `max_model_len`, so verification never
writes a slot outside the sequence's limits. A step that decodes `disable_by_batch_size`
sequences or more drafts nothing (vLLM's `speculative_disable_by_batch_size`): a CPU step of that
many tokens is compute-bound, and each draft token would cost about what it saves.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.engine.ngram_proposer import NgramProposer
from kvserve.engine.sequence import Sequence


@dataclass(frozen=True)
class DraftPolicy:
    proposer: NgramProposer
    disable_by_batch_size: int
    max_model_len: int

    def drafts_in(self, num_decoding: int) -> bool:
        return num_decoding < self.disable_by_batch_size

    def draft(self, seq: Sequence, room: int) -> tuple[int, ...]:
        """At most `room` draft tokens to follow `seq` this step (none: it decodes one token)."""
        if seq.spec is None or room <= 0 or not seq.spec.take_turn():
            return ()
        cap = min(room, self.proposer.num_speculative_tokens,
                  seq.params.max_tokens - len(seq.output_token_ids) - 1, self.max_model_len - seq.num_tokens - 1)
        return tuple(self.proposer.propose(seq.token_ids)[:cap]) if cap > 0 else ()
