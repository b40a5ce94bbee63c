"""Token eviction after a forward pass: which queries a sequence's policy scores in a step, and the
compactions of the sequences whose policy is due."""
from __future__ import annotations

from collections import Counter

import torch

from kvserve.cache.block_manager import BlockManager
from kvserve.cache.compaction import Compaction
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import Sequence
from kvserve.eviction.state import EvictionState
from kvserve.model.config import ModelConfig


def score_from(seq: Sequence, num_scheduled: int) -> int | None:
    """The first position whose query counts toward the scores `seq`'s policy ranks by this step
    (None: none does): H2O every query, TOVA the newest (on a step that evicts), SnapKV those
    from the observation window before the prompt's end (or its chunk's) on."""
    policy = seq.eviction
    prompt = len(seq.prompt_token_ids)
    computed = seq.num_computed_tokens
    if policy is None or not policy.scored or (not policy.during_decode and computed >= prompt):
        return None
    end = computed + num_scheduled
    state = seq.kv_state
    if policy.name == "tova" and computed >= prompt and state is not None and \
            not policy.decode_due(end - state.num_evicted):
        return None  # TOVA ranks by the newest query alone: only the evicting step's matters
    stop = policy.prompt_stop(computed, prompt) if computed < prompt else prompt
    first = {"h2o": 0, "tova": end - 1, "snapkv": stop - policy.observation_window}[policy.name]
    return first if first < end else None


class EvictionStep:
    def __init__(self, block_manager: BlockManager, scheduler: Scheduler, model_config: ModelConfig) -> None:
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.model_config = model_config
        self.evicted_tokens: Counter[str] = Counter()  # by policy

    def evict(self, seqs: list[Sequence], num_scheduled: list[int], score_from: list[int | None],
              scores: dict[int, torch.Tensor], requests: dict[str, list[Sequence]]) -> tuple[Compaction, ...]:
        """Each evicting sequence's slots grow by the tokens the step computed; one whose prompt
        is computed and whose policy is due drops tokens, and the block manager compacts it.
        Returns the compactions, for the pool. One whose compaction finds no blocks for its
        copies of shared blocks would, run on un-evicted, keep other tokens than it keeps alone:
        it is recomputed, at once, so that the sequences after it see its blocks back (two that
        share a prefix and both lack blocks would otherwise be recomputed together forever).
        Beams, and a prompt about to fork its samples, wait for their next due step instead."""
        cfg = self.model_config
        ran = {s.seq_id for s in seqs}
        compactions: list[Compaction] = []
        for i, seq in enumerate(seqs):
            if seq.eviction is None:
                continue
            state = seq.kv_state or EvictionState.empty(seq.eviction, cfg.num_layers, cfg.num_kv_heads)
            end = seq.num_computed_tokens
            slots = end - state.num_evicted
            step = scores.get(i)
            counted = end - max(score_from[i] or 0, end - num_scheduled[i])  # queries scored this step
            state.grow(end, None if step is None else step[..., :slots], counted if step is not None else 0)
            seq.kv_state = state
            prompt = len(seq.prompt_token_ids)
            if not state.due(end, prompt, prompt_end=end - num_scheduled[i] < prompt <= end):
                continue
            if seq.beam is not None and any(b.seq_id not in ran for b in requests[seq.request_id]):
                continue  # it will recompute its last token in its slot (the beams' step): no moves now
            moves, after = state.evicted()
            compaction = self.block_manager.compact(seq.seq_id, moves.layer, moves.head, moves.src, moves.dst,
                                                    moves.kept)
            if compaction is not None:
                compactions.append(compaction)
                seq.kv_state = after
                self.evicted_tokens[seq.eviction.name] += after.num_evicted - state.num_evicted
            elif seq.beam is None and not seq.num_forks:
                self.scheduler.recompute(seq)
        return tuple(compactions)
