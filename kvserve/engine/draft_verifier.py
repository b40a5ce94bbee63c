"""Judges a step's drafts: which of each sequence's draft tokens the target model accepts, and the
token it adds after them (speculative decoding's verification, after engine/draft_policy.py).

The target's token at each drafted position is drawn exactly as a plain decode would draw it,
with the request's own sampler and its (seed, position) uniform (engine/sampler.py); a draft
token is accepted while it equals that token, and the first that differs is replaced by it. With
an n-gram draft (one token proposed with certainty) this is Leviathan et al.'s rejection sampling
in law: a draft token d is kept with probability p(d), and on rejection the replacement is drawn
from p without d, renormalized. Drawing it this way also keeps each request's tokens those of
the same seed with speculation off, greedy and sampled alike.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from kvserve.device_copy import to_device
from kvserve.engine.sampler import sample
from kvserve.engine.sequence import Sequence
from kvserve.engine.spec_state import SpecDecodeStats
from kvserve.model.ops import EagerOps


class DraftVerifier:
    def __init__(self, argmax: Callable[[torch.Tensor], torch.Tensor] = EagerOps.argmax) -> None:
        self.stats, self.argmax = SpecDecodeStats(), argmax  # the model's ops' (engine/sampler.py)

    def verify(self, seqs: list[Sequence], drafts: list[tuple[int, ...]], last_logits: torch.Tensor,
               draft_logits: torch.Tensor | None) -> list[list[int]]:
        """Each sequence's new tokens: its accepted draft tokens and the target's next one.
        `last_logits[i]`: after sequence i's last run token; `draft_logits`: the rows before each
        draft token, sequence by sequence (those with a draft), in the order of `seqs`."""
        lengths = [len(d) for d in drafts]
        if draft_logits is None:
            logits = last_logits
        else:  # each sequence's rows in position order: its drafts' then its last
            order, offset, num_draft = [], 0, draft_logits.shape[0]
            for i, k in enumerate(lengths):
                order += [*range(offset, offset + k), num_draft + i]
                offset += k
            index = to_device(torch.tensor(order), last_logits.device)
            logits = torch.cat([draft_logits, last_logits]).index_select(0, index)
        params = [s.params for s, k in zip(seqs, lengths) for _ in range(k + 1)]
        seeds = [s.seed for s, k in zip(seqs, lengths) for _ in range(k + 1)]
        positions = [len(s.output_token_ids) + j for s, k in zip(seqs, lengths) for j in range(k + 1)]
        targets = sample(logits, params, seeds, positions, self.argmax).tolist()
        new_tokens, offset = [], 0
        for seq, draft in zip(seqs, drafts):
            wanted = targets[offset:offset + len(draft) + 1]
            offset += len(draft) + 1
            accepted = next((j for j, (d, t) in enumerate(zip(draft, wanted)) if d != t), len(draft))
            new_tokens.append(wanted[:accepted + 1])
            if draft:
                assert seq.spec is not None, "a draft from a sequence that does not speculate"
                seq.spec.record(accepted)
                self.stats.record(len(draft), accepted)
        return new_tokens
