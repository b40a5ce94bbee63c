"""What a step's forward pass changes on the host: prompt logprobs, the scheduler's progress, new
prefix-cache blocks, evictions, beams and forks, sampled tokens, verified drafts (their accepted
tokens join the sequence, their rejected ones' slots go back: `_take_drafts`), stops and outputs.

With async scheduling a plain step's tokens are sampled on the device and read one step later,
while the next forward runs (`PendingTokens`); the sequences hold a placeholder until then.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from kvserve.cache.block_bytes import read_blocks
from kvserve.cache.block_manager import BlockManager
from kvserve.cache.block_ops import BlockOps
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.block_tier import BlockTier
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.device_copy import to_device
from kvserve.engine.draft_verifier import DraftVerifier
from kvserve.engine.eviction_step import EvictionStep, score_from
from kvserve.engine.forks import Forks
from kvserve.engine.logprobs import prompt_span, token_logprobs
from kvserve.engine.model_runner import ModelRunner, StepResult
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.penalties import apply_penalties
from kvserve.engine.pending_tokens import PendingTokens
from kvserve.engine.scheduler import Scheduler, SchedulerOutput
from kvserve.engine.sequence import PLACEHOLDER, RequestOutput, Sequence, TokenLogprobs
from kvserve.engine.token_counter import TokenCounter
from kvserve.profiling import label

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepScores:
    """Which of the step's sequences are plain (`is_plain`) and, for the others, the first
    position whose query their eviction policy scores (None: none)."""
    plain: bool
    score_from: list[int | None] | None


def is_plain(seq: Sequence) -> bool:
    """None of what acts on a sequence's new token on the host at once (beams and forks step
    there, penalties count the outputs, logprobs and forced tokens come with the token, eviction
    ranks the step's attention): its steps skip those stages, and with async scheduling its token
    may be read a step late."""
    p = seq.params
    return (seq.beam is None and not seq.num_forks and seq.eviction is None and not p.penalized
            and p.logprobs is None and p.forced_token_ids is None)


def rows_of(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits of `rows`, indexed on the device (a Python list index is copied there
    synchronously, which would stall async scheduling)."""
    if rows == list(range(logits.shape[0])):
        return logits
    return logits.index_select(0, to_device(torch.tensor(rows, dtype=torch.long), logits.device))


class StepUpdate:
    def __init__(self, scheduler: Scheduler, runner: ModelRunner, block_manager: BlockManager,
                 pool: KVPool | QuantizedKVPool, remote: BlockTier | None, forks: Forks,
                 eviction: EvictionStep, counter: TokenCounter, output_processor: OutputProcessor,
                 async_scheduling: bool) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.block_manager = block_manager
        self.pool = pool
        self.remote = remote
        self.forks = forks
        self.eviction = eviction
        self.counter = counter
        self.output_processor = output_processor
        self.async_scheduling = async_scheduling
        self.verifier = DraftVerifier(runner.ops.argmax)
        self.requests: dict[str, list[Sequence]] = {}  # unfinished requests: their samples
        self.pending: PendingTokens | None = None  # the last step's tokens, not read yet

    def scores(self, batch: SchedulerOutput) -> StepScores:
        """A step of plain sequences (most) skips the stages that serve the others: scores,
        evictions, beams, forks, penalties, forced tokens, logprobs."""
        if all(map(is_plain, batch.seqs)):
            return StepScores(True, None)
        starts = [score_from(s, n) for s, n in zip(batch.seqs, batch.num_scheduled)]
        return StepScores(False, None if all(f is None for f in starts) else starts)

    def apply(self, batch: SchedulerOutput, scores: StepScores, result: StepResult,
              pending: PendingTokens | None) -> list[RequestOutput]:
        logits, prompt_logits = result.logits, result.prompt_logits
        if prompt_logits.shape[0]:
            self._score_prompts(batch.seqs, batch.num_scheduled, prompt_logits)
        done = self.scheduler.complete_step(batch)  # a prompt chunk with more to come gets no token
        ready = batch.seqs
        if len(done) < len(ready):  # only then copy the logits rows that get a token
            logits, ready = rows_of(logits, done), [ready[i] for i in done]
        plain = scores.plain
        launched = None
        if self.async_scheduling and ready and (plain or all(map(is_plain, ready))):
            with label("kvserve.sample"):
                launched = PendingTokens.launch(ready, self.runner.sample(ready, logits))
        # The step before's tokens, read while this one computes: its stops and outputs first.
        outputs = self.read(pending)
        self._register_blocks(batch.seqs)  # before any eviction
        if not plain:
            starts = scores.score_from or [None] * len(batch.seqs)
            compactions = self.eviction.evict(batch.seqs, batch.num_scheduled, starts, result.scores or {},
                                              self.requests)
            if compactions:  # applied at the head of the next step's moves
                self.scheduler.carry(BlockOps(compactions=compactions))
        if launched is not None:
            for seq in ready:  # one that the read above finished drops its sample
                if not seq.finished:
                    seq.output_token_ids.append(PLACEHOLDER)
            self.pending = launched
            return outputs
        if pending is not None and any(s.finished for s in ready):
            keep = [i for i, s in enumerate(ready) if not s.finished]
            logits, ready = rows_of(logits, keep), [ready[i] for i in keep]
        now = time.perf_counter()
        if batch.drafts:  # the drafting sequences' tokens; the others' as in any step
            drafts = {id(s): d for s, d in zip(batch.seqs, batch.drafts) if d}
            outputs += self._take_drafts(ready, drafts, logits, result.draft_logits, now)
            keep = [i for i, s in enumerate(ready) if id(s) not in drafts]
            logits, ready = rows_of(logits, keep), [ready[i] for i in keep]
        if plain:
            with label("kvserve.sample"):
                seqs, tokens = ready, self.runner.sample(ready, logits).tolist()
            logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        else:
            outputs += self.forks.step_beams(ready, logits, now, self.requests)
            seqs, tokens, logprobs = self._sample_rows(ready, logits)
        for seq, token, logprob in zip(seqs, tokens, logprobs):
            if logprob is not None:
                seq.out.output_logprobs.append(logprob)
            self.counter.append(seq, token, now)
            if (out := self._emit(seq, token, now)) is not None:
                outputs.append(out)
        return outputs

    def read(self, pending: PendingTokens | None) -> list[RequestOutput]:
        """Puts the tokens the step before sampled in place of their placeholders."""
        if pending is None:
            return []
        tokens = pending.read()
        now = time.perf_counter()
        outputs = []
        for seq, token in zip(pending.seqs, tokens):
            if seq.finished:  # aborted since, or finished when read and sampled once more
                continue
            seq.output_token_ids[-1] = token
            self.counter.count(seq, now)
            if (out := self._emit(seq, token, now)) is not None:
                outputs.append(out)
        return outputs

    def _take_drafts(self, ready: list[Sequence], drafts: dict[int, tuple[int, ...]], logits: torch.Tensor,
                     draft_logits: torch.Tensor | None, now: float) -> list[RequestOutput]:
        """The new tokens of the sequences that ran a draft (`drafts`, by id; engine/draft_verifier.py),
        each a computed token but the last, up to a stop; then each gives back the slots past its
        tokens (its rejected draft's: never registered, since only computed blocks are) and
        registers what it filled."""
        rows = [i for i, s in enumerate(ready) if id(s) in drafts]
        seqs = [ready[i] for i in rows]
        new_tokens = self.verifier.verify(seqs, [drafts[id(s)] for s in seqs], rows_of(logits, rows), draft_logits)
        outputs = []
        for seq, tokens in zip(seqs, new_tokens):
            for j, token in enumerate(tokens):
                seq.num_computed_tokens += int(j > 0)  # the token before this one was a draft the step ran
                self.counter.append(seq, token, now)
                self._append_text(seq, token)
                if seq.out.finish_reason is not None:
                    break
            if (out := self._output(seq, now)) is not None:
                outputs.append(out)
            if not seq.finished:
                self.block_manager.trim(seq.seq_id, seq.num_slots)
        self._register_blocks(seqs)
        return outputs

    def _emit(self, seq: Sequence, token: int, now: float) -> RequestOutput | None:
        """A sequence's output after `token` joined it: text, stop checks, and its end if it ends
        (None: a running sequence whose caller wants its final output only)."""
        self._append_text(seq, token)
        return self._output(seq, now)

    def _append_text(self, seq: Sequence, token: int) -> None:
        try:
            self.output_processor.append_text(seq, token)
        except Exception as err:  # a fault in one request's bookkeeping ends that request only
            logger.exception("request %s failed", seq.request_id)
            seq.out.finish_reason, seq.out.error = "error", f"{type(err).__name__}: {err}"

    def _output(self, seq: Sequence, now: float) -> RequestOutput | None:
        if seq.out.finish_reason is not None:
            seq.out.finish_time = now
            self.scheduler.finish(seq)
            if all(s.finished for s in self.requests[seq.request_id]):
                del self.requests[seq.request_id]
        return self.output_processor.output(seq)

    def _register_blocks(self, seqs: list[Sequence]) -> None:
        """The blocks the step filled join the prefix cache (and the remote tier). Blocks computed
        after an eviction do not match a plain prefix; a sequence the read of its pending token
        finished has no blocks left."""
        joined: list[tuple[int, bytes]] = []
        bm = self.block_manager
        for seq in seqs:
            if not seq.finished and not seq.num_evicted and bm.has_unregistered_blocks(seq.seq_id,
                                                                                       seq.num_computed_tokens):
                joined += bm.register_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
        if joined and self.remote is not None and self.remote.available:
            payloads = read_blocks(self.pool.block_tensors, [block for block, _ in joined])
            self.remote.store([(h, payload) for (_, h), payload in zip(joined, payloads)])

    def _sample_rows(self, ready: list[Sequence], logits: torch.Tensor
                     ) -> tuple[list[Sequence], list[int], list[TokenLogprobs | None]]:
        """Tokens for the sampled (not beam) sequences, forks of a finished prompt included (each
        from its parent's row), after penalties, with forced tokens and logprobs."""
        sampled = [i for i, s in enumerate(ready) if s.beam is None]
        seqs, rows = self.forks.fork_samples([ready[i] for i in sampled], self.requests)
        with label("kvserve.sample"):
            rows_logits = apply_penalties(rows_of(logits, [sampled[r] for r in rows]), [s.params for s in seqs],
                                          [s.prompt_token_ids for s in seqs], [s.output_token_ids for s in seqs])
            tokens = [s.params.forced_token_ids[len(s.output_token_ids)] if s.params.forced_token_ids is not None
                      else t for s, t in zip(seqs, self.runner.sample(seqs, rows_logits).tolist())]
            logprobs = token_logprobs(rows_logits, [s.params.logprobs for s in seqs],
                                      [s.params.scale_temperature for s in seqs], tokens)
        return seqs, tokens, logprobs

    def _score_prompts(self, seqs: list[Sequence], num_scheduled: list[int], logits: torch.Tensor) -> None:
        """Prompt logprobs of the positions this step ran (rows in `prompt_span` order)."""
        owners, targets = [], []
        for seq, n in zip(seqs, num_scheduled):
            lo, hi = prompt_span(seq, seq.num_computed_tokens, seq.num_computed_tokens + n)
            owners += [seq] * (hi - lo)
            targets += seq.prompt_token_ids[lo + 1:hi + 1]
        scored = token_logprobs(logits, [s.params.prompt_logprobs for s in owners],
                                [s.params.scale_temperature for s in owners], targets)
        for seq, logprob in zip(owners, scored):
            seq.out.prompt_logprobs.append(logprob)
