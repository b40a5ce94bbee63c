"""Sequences that share blocks with a parent: the n samples of a request, forked after its
prefill, and the beams of a beam search, forked or dropped at each step."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from kvserve.cache.block_manager import BlockManager
from kvserve.engine.detokenizer import Detokenizer
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.sequence import OutputState, RequestOutput, Sequence, SequenceStatus
from kvserve.engine.spec_state import SpecState
from kvserve.engine.token_counter import TokenCounter


class Forks:
    def __init__(self, block_manager: BlockManager, scheduler: Scheduler, tokenizer: Any,
                 detokenizer: Callable[[], Detokenizer | None], counter: TokenCounter) -> None:
        self.block_manager = block_manager
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.detokenizer = detokenizer
        self.counter = counter

    def fork(self, parent: Sequence, index: int, seed: int) -> Sequence:
        """A running copy of `parent` (same tokens and progress) sharing all of its blocks."""
        child = Sequence(parent.request_id, parent.prompt_token_ids, parent.params, seed,
                         prompt=parent.prompt, index=index, beam=parent.beam, cache_salt=parent.cache_salt,
                         eviction=parent.eviction, spec=None if parent.spec is None else SpecState(),
                         kv_state=None if parent.kv_state is None else parent.kv_state.clone(),
                         output_token_ids=list(parent.output_token_ids), num_computed_tokens=parent.num_computed_tokens,
                         num_cached_tokens=parent.num_cached_tokens,
                         arrival_time=parent.arrival_time, first_scheduled_time=parent.first_scheduled_time,
                         # Its text starts over from every output id.
                         out=OutputState(self.detokenizer(), output_logprobs=list(parent.out.output_logprobs),
                                         prompt_logprobs=list(parent.out.prompt_logprobs),
                                         first_token_time=parent.out.first_token_time))
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self.scheduler.add_running(child)
        return child

    def fork_samples(self, batch: list[Sequence], requests: dict[str, list[Sequence]]
                     ) -> tuple[list[Sequence], list[int]]:
        """After its prefill, a request with n samples forks n - 1 sequences that share its blocks
        and draw their first token from the same logits row. Sample i is seeded with seed + i, so
        it equals a separate request with that seed. Returns the sequences and their rows."""
        seqs, rows = list(batch), list(range(len(batch)))
        for row, parent in enumerate(batch):
            for index in range(1, parent.num_forks + 1):
                child = self.fork(parent, index, parent.seed + index)
                requests[parent.request_id].append(child)
                seqs.append(child)
                rows.append(row)
            parent.num_forks = 0
        return seqs, rows

    def step_beams(self, batch: list[Sequence], logits: torch.Tensor, now: float,
                   requests: dict[str, list[Sequence]]) -> list[RequestOutput]:
        """Advances every beam-search request whose beams all ran in this step; survivors reuse
        or fork their parent's blocks, dropped beams free theirs. Returns finished requests."""
        rows = {seq.seq_id: i for i, seq in enumerate(batch)}
        outputs = []
        for request_id in dict.fromkeys(s.request_id for s in batch if s.beam is not None):
            beams = requests[request_id]
            group = beams[0].beam
            if any(b.seq_id not in rows for b in beams):
                # A beam was preempted: the others wait for it, recomputing their last token.
                for b in beams:
                    b.num_computed_tokens = min(b.num_computed_tokens, b.num_tokens - 1)
                continue
            logprobs = torch.log_softmax(logits[[rows[b.seq_id] for b in beams]], dim=-1)
            survivors = group.step(logprobs, [b.output_token_ids for b in beams])
            kept: dict[int, Sequence] = {}
            new_beams: list[tuple[Sequence, int]] = []
            for parent_index, token in survivors:
                parent = beams[parent_index]
                if parent_index in kept:
                    child = self.fork(parent, group.next_index(), parent.seed)
                else:
                    child = kept[parent_index] = parent
                new_beams.append((child, token))
            for i, b in enumerate(beams):
                b.num_forks = 0
                if i not in kept:
                    self.scheduler.finish(b)
            for child, token in new_beams:
                self.counter.append(child, token, now)
            requests[request_id] = [c for c, _ in new_beams]
            if group.done:
                outputs.append(self._finish_beams(requests.pop(request_id), beams[0], now))
        return outputs

    def _finish_beams(self, beams: list[Sequence], first: Sequence, now: float) -> RequestOutput:
        for b in beams:
            self.scheduler.finish(b)
        best = first.beam.best()
        result = Sequence(first.request_id, first.prompt_token_ids, first.params, first.seed, prompt=first.prompt,
                          output_token_ids=best.token_ids, status=SequenceStatus.FINISHED,
                          arrival_time=first.arrival_time, first_scheduled_time=first.first_scheduled_time,
                          out=OutputState(first_token_time=first.out.first_token_time, finish_time=now,
                                          finish_reason="stop" if best.token_ids[-1] == first.beam.eos_token_id
                                          else "length"))
        if self.tokenizer is not None:
            result.out.text = self.tokenizer.decode(best.token_ids, skip_special_tokens=True)
        return dataclasses.replace(RequestOutput.of(result, result.out.text, result.out.text), beam_score=best.score)
