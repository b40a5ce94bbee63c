"""A sequence's new token becomes text, ends it when a stop condition holds, and becomes the
output its caller sees (vLLM v1's output processor and stop checker)."""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvserve.engine.sequence import RequestOutput, Sequence


@dataclass(frozen=True)
class OutputProcessor:
    eos_token_id: int | None
    max_model_len: int

    def append_text(self, seq: Sequence, token: int) -> None:
        """Detokenizes `token` (the last of `seq.output_token_ids`) and sets `seq.out.finish_reason`
        if it ends the sequence: EOS, a stop token, a stop string (cut from the text), length."""
        new_chars = self._detokenize(seq)
        p = seq.params
        if not p.ignore_eos and token == self.eos_token_id:
            seq.out.finish_reason = "stop"
        elif token in p.stop_token_ids:
            seq.out.finish_reason = "stop"
        elif p.stop and (hit := find_stop(seq.out.text, p.stop_pattern, p.stop_hold, new_chars)) >= 0:
            seq.out.text = seq.out.text[:hit]
            seq.out.finish_reason = "stop"
        elif len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.out.finish_reason = "length"

    @staticmethod
    def output(seq: Sequence) -> RequestOutput | None:
        """What the caller sees of `seq` now (None: it runs on and its caller wants the final
        output only). A running output holds back a stop string's possible start; text sent
        stays sent."""
        if seq.out.finish_reason is not None:
            shown = len(seq.out.text)
        elif seq.params.output_kind == "final":
            return None
        elif seq.params.stop:
            shown = max(len(seq.out.text) - seq.params.stop_hold, seq.out.text_sent)
        else:  # what the line above gives with no stop string, without its ~1 us a sequence
            shown = len(seq.out.text)
        text = seq.out.text
        delta, seq.out.text_sent = text[seq.out.text_sent:shown], shown
        return RequestOutput.of(seq, text[:shown], delta)

    @staticmethod
    def _detokenize(seq: Sequence) -> int:
        """Appends the text of the sequence's new tokens; returns its length."""
        if seq.out.detokenizer is None:
            return 0
        delta = seq.out.detokenizer.step(seq.output_token_ids)
        seq.out.text += delta
        return len(delta)


def find_stop(text: str, stops: re.Pattern[str], hold: int, new_chars: int) -> int:
    """Where the earliest stop string starts in `text` (-1: nowhere): one search of their
    alternation `stops`, only where its last `new_chars` characters can complete one (`hold`: the
    longest stop string's length - 1), since the whole text per token would grow with the output."""
    found = stops.search(text, max(len(text) - new_chars - hold, 0))
    return -1 if found is None else found.start()
