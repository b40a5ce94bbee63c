"""Beam search over a request's beams, scored like HF transformers' `num_beams` search.

Each step takes the log-probabilities of every running beam, keeps the 2 x width best
continuations, retires those that end (EOS or max_tokens) if they rank within the top width,
and continues the best width that do not end. The engine maps the survivors onto sequences:
a survivor reuses its parent's blocks, and a second survivor of the same parent forks them.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

_NEG = -1.0e9


@dataclass
class Hypothesis:
    score: float            # sum of log-probs / length ** length_penalty
    token_ids: list[int]    # generated tokens, the final one included


@dataclass
class BeamGroup:
    width: int
    length_penalty: float
    early_stopping: bool
    max_tokens: int
    eos_token_id: int | None
    scores: list[float] = field(default_factory=lambda: [0.0])   # running beams' sum of log-probs
    finished: list[Hypothesis] = field(default_factory=list)     # best first, at most `width`
    done: bool = False
    _forks: int = 0

    def next_index(self) -> int:
        """Sample index for a forked beam: unique within the request, so seq ids never clash."""
        self._forks += 1
        return self._forks

    def step(self, logprobs: torch.Tensor, outputs: list[list[int]]) -> list[tuple[int, int]]:
        """logprobs: [running beams, vocab]; outputs: each running beam's generated tokens.
        Returns (parent beam, token) for each beam that keeps running, best first."""
        vocab = logprobs.shape[1]
        gen_len = len(outputs[0]) + 1
        total = (torch.tensor(self.scores, dtype=torch.float32)[:, None] + logprobs.float().cpu()).flatten()
        top_scores, top_index = total.topk(min(2 * self.width, total.numel()))
        full = len(self.finished) == self.width
        survivors: list[tuple[int, int]] = []
        new_scores: list[float] = []
        for rank, (score, index) in enumerate(zip(top_scores.tolist(), top_index.tolist())):
            parent, token = divmod(index, vocab)
            if token == self.eos_token_id or gen_len >= self.max_tokens:
                if rank < self.width and not (full and self.early_stopping):
                    self._add_finished(Hypothesis(score / gen_len ** self.length_penalty,
                                                  outputs[parent] + [token]))
            elif len(survivors) < self.width:
                survivors.append((parent, token))
                new_scores.append(score)
        self.scores = new_scores
        self.done = not survivors or not self._can_improve(gen_len)
        return [] if self.done else survivors

    def _add_finished(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score)  # stable: earlier finishers win ties
        del self.finished[self.width:]

    def _can_improve(self, gen_len: int) -> bool:
        if len(self.finished) < self.width:
            return True
        if self.early_stopping:
            return False
        best_running = self.scores[0] / gen_len ** self.length_penalty
        return best_running > self.finished[-1].score

    def best(self) -> Hypothesis:
        return self.finished[0]
