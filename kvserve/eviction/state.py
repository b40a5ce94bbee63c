"""One evicting sequence's view of its slots: the position each holds and the attention each has
received, per layer and KV head, and the moves that compact the kept ones.

Keys are cached after RoPE, so a slot's key already carries its position: attention over the
slots does not care about their order. Compaction therefore fills each dropped slot below the
kept count with a kept slot from above it (at most the dropped count of moves, per head) and
the blocks past the kept count return to the pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.eviction import select
from kvserve.eviction.policy import EvictionPolicy


@dataclass(frozen=True)
class SlotMoves:
    """Per (layer, head): slot `src` is copied into slot `dst`; all reads happen before writes."""
    layer: torch.Tensor  # [M] int64
    head: torch.Tensor   # [M]
    src: torch.Tensor    # [M] slot index within the sequence
    dst: torch.Tensor    # [M]
    kept: int            # slots the sequence holds afterwards


@dataclass
class EvictionState:
    policy: EvictionPolicy
    positions: torch.Tensor   # [L, H, S] int64: the token position each slot holds
    scores: torch.Tensor      # [L, H, S] fp32: attention received (what the policy accumulates)
    num_evicted: int = 0      # tokens dropped so far (the same count in every layer and head)
    scored_queries: int = 0   # queries whose attention `scores` sums (snapkv's since its last compaction)

    @classmethod
    def empty(cls, policy: EvictionPolicy, layers: int, heads: int) -> "EvictionState":
        return cls(policy, torch.zeros(layers, heads, 0, dtype=torch.long), torch.zeros(layers, heads, 0))

    def clone(self) -> "EvictionState":
        return EvictionState(self.policy, self.positions.clone(), self.scores.clone(), self.num_evicted,
                             self.scored_queries)

    @property
    def num_slots(self) -> int:
        return self.positions.shape[-1]

    def grow(self, end: int, step_scores: torch.Tensor | None, queries: int) -> None:
        """The step computed tokens up to position `end` (exclusive); `step_scores` [L, H, slots]
        is the attention its `queries` scored rows gave each slot (None for unscored policies)."""
        new = end - self.num_evicted - self.num_slots
        layers, heads = self.positions.shape[:2]
        fresh = torch.arange(end - new, end).expand(layers, heads, new)
        self.positions = torch.cat([self.positions, fresh], dim=-1)
        self.scores = torch.cat([self.scores, self.scores.new_zeros(layers, heads, new)], dim=-1)
        if step_scores is not None:
            # TOVA ranks by the newest query alone; H2O and SnapKV by the sum over queries.
            self.scores = step_scores.clone() if self.policy.name == "tova" else self.scores + step_scores
            self.scored_queries += queries

    def due(self, end: int, prompt: int, prompt_end: bool) -> bool:
        """Whether to evict now, after a step that computed tokens up to position `end` of a
        sequence whose prompt has `prompt` tokens; `prompt_end` at the step that completed it."""
        if self.num_slots <= self.policy.budget:
            return False
        if end < prompt:
            return self.policy.chunk_ends_at(end)
        if not self.policy.during_decode or prompt_end:
            return prompt_end
        if self.policy.name == "snapkv" and self.num_evicted:
            return self.scored_queries >= self.policy.observation_window
        return self.policy.decode_due(self.num_slots)

    def evicted(self) -> tuple[SlotMoves, "EvictionState"]:
        """The policy applied: the slot moves, and the state after them (this one is unchanged,
        so the caller can drop both when the blocks cannot be compacted)."""
        keep = select.kept(self.policy, self.positions, self.scores if self.policy.scored else None)
        kept = int(keep[0, 0].sum())
        assert bool((keep.sum(-1) == kept).all()), "a policy must keep as many slots in every head"
        holes = (~keep[..., :kept]).nonzero()     # (layer, head, dst), row-major like the sources
        sources = keep[..., kept:].nonzero()      # (layer, head, src - kept)
        layer, head, dst = holes.unbind(-1)
        src = sources[:, 2] + kept
        positions = self.positions[..., :kept].clone()
        positions[layer, head, dst] = self.positions[layer, head, src]
        scores = self.scores[..., :kept].clone()
        scores[layer, head, dst] = self.scores[layer, head, src]
        queries = self.scored_queries
        if self.policy.name == "snapkv":  # the next round scores the next observation window
            scores.zero_()
            queries = 0
        after = EvictionState(self.policy, positions, scores, self.num_evicted + self.num_slots - kept, queries)
        return SlotMoves(layer, head, src, dst, kept), after
