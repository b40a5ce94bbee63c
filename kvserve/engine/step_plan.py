"""The step plan: everything the runner reads to run one step, built from the scheduler's output,
the block manager's tables and the sequences, on the scheduler's side of the engine.

The runner reads no scheduler state: a plan names each sequence's token span, slot offset (after
evictions), block table and scored positions, the input ids (or where the previous step's
device-side tokens go), every block move of the step, and the pool's write plan. A test can write
one by hand (tests/engine/test_step_plan.py).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from kvserve.cache.block_manager import BlockManager, on_device
from kvserve.cache.block_ops import BlockOps
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.page_step import WritePlan
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.device_copy import to_device
from kvserve.engine.logprobs import prompt_span
from kvserve.engine.pending_tokens import PendingTokens
from kvserve.engine.scheduler import SchedulerOutput
from kvserve.engine.sequence import Sequence


@dataclass(frozen=True)
class TokenFill:
    """Input positions whose token the host has not read yet: the previous step's samples, taken
    on the device (async scheduling)."""
    rows: torch.Tensor | None  # positions in the step's input ids (None: every one, in order)
    tokens: torch.Tensor       # their tokens, where the model runs


@dataclass(frozen=True)
class SeqSpan:
    """One sequence's part of a step: positions [start, start + num_tokens) run, in slots
    `evicted` lower (the tokens its eviction dropped before them hold no slot)."""
    start: int
    num_tokens: int
    tables: tuple[list[int], ...]        # its block table per KV cache group, whole: attention reads the context's
    evicted: int = 0
    prompt_rows: tuple[int, int] | None = None  # positions whose logits score prompt tokens (logprobs)
    score_from: int | None = None        # first position whose query its eviction policy scores
    draft: int = 0                       # its last `draft` positions run draft tokens (speculative decoding)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class StepPlan:
    spans: list[SeqSpan]
    input_ids: list[int]             # every span's tokens in batch order; empty where `fill` takes them all
    ops: BlockOps                    # every block move to apply before the forward pass
    kv_plan: WritePlan | None        # a compressed pool's writes for the step (QuantizedKVPool.write_plan)
    offloaded: bool = False          # some table holds host blocks (offload)
    fill: TokenFill | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.spans)


def plan_step(batch: SchedulerOutput, bm: BlockManager, pool: KVPool | QuantizedKVPool, device: torch.device,
              score_from: list[int | None] | None = None, pending: PendingTokens | None = None) -> StepPlan:
    """The plan of `batch`. `score_from[i]`: the position from which sequence i's queries count
    toward the attention scores its eviction policy reads (None: not scored). `pending`: the
    previous step's tokens, not yet read by the host, that some of these sequences end in."""
    seqs, num_scheduled = batch.seqs, batch.num_scheduled
    starts = [s.num_computed_tokens for s in seqs]
    ends = [start + n for start, n in zip(starts, num_scheduled)]
    fill = None if pending is None else _fill(seqs, starts, num_scheduled, pending, device)
    # Taken whole from the device in the steady state of async scheduling: no list to build.
    drafts = batch.drafts or ((),) * len(seqs)
    input_ids = [] if fill is not None and fill.rows is None else \
        [t for s, start, end, d in zip(seqs, starts, ends, drafts) for t in s.tokens(start, end - len(d)) + list(d)]
    evicted = [s.num_evicted for s in seqs]
    tables = [bm.tables_of(s.seq_id) for s in seqs]
    scored = score_from or [None] * len(seqs)
    spans = [SeqSpan(start, n, table, e, prompt_span(s, start, start + n) if s.params.prompt_logprobs is not None
                     else None, f, len(d))
             for s, start, n, table, e, f, d in zip(seqs, starts, num_scheduled, tables, evicted, scored, drafts)]
    staging = None if bm.staging is None else bm.staging.plan(
        ((bm.tables[s.seq_id], start - e, end - e) for s, start, end, e in zip(seqs, starts, ends, evicted)),
        batch.block_ops.copies)
    kv_plan = pool.write_plan(staging)
    offloaded = bool(bm.num_host_blocks) and not all(on_device(b) for t in tables for b in t[0])
    return StepPlan(spans, input_ids, batch.block_ops, kv_plan, offloaded, fill)


def _fill(seqs: list[Sequence], starts: list[int], num_scheduled: list[int], pending: PendingTokens,
          device: torch.device) -> TokenFill | None:
    """Where the step's input ids take `pending`'s tokens: a pending sequence's last token, if
    this step runs it (a decode, or the end of a recomputed prompt after a preemption)."""
    if len(seqs) == len(pending.seqs) == sum(num_scheduled) and all(map(operator.is_, seqs, pending.seqs)):
        return TokenFill(None, pending.device.to(device))  # the steady state: the same decodes
    dest, src, offset = [], [], 0
    for seq, start, n in zip(seqs, starts, num_scheduled):
        row, last = pending.rows.get(seq.seq_id), seq.num_tokens - 1
        # The same object: a request aborted with a token pending may be sent again by its id.
        if row is not None and pending.seqs[row] is seq and start <= last < start + n:
            dest.append(offset + last - start)
            src.append(row)
        offset += n
    if not dest:
        return None
    return TokenFill(to_device(torch.tensor(dest), device),
                     pending.device[to_device(torch.tensor(src), pending.device.device)].to(device))
