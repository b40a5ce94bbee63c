"""Runs one scheduled batch through the model and samples each sequence's next token."""
from __future__ import annotations

import logging
import operator
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol

import torch

from kvserve.attention import AttentionBackend, StepAttention, StepMetadata
from kvserve.attention.rotation import KVRotation
from kvserve.attention.scores import ScorePlan
from kvserve.cache.block_bytes import write_blocks
from kvserve.cache.block_manager import BlockManager, on_device
from kvserve.cache.block_ops import BlockOps
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.cache.swap_space import SwapSpace
from kvserve.device_copy import to_device
from kvserve.engine.cpu_stack import CPUDecodeStack
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.logprobs import prompt_span
from kvserve.engine.pending_tokens import PendingTokens
from kvserve.engine.sampler import sample
from kvserve.engine.sequence import Sequence
from kvserve.model.cpu_linear import SMALL_BATCH, cpu_linear_kind, replace_linears
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.ops import resolve_ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenFill:
    """Input positions whose token the host has not read yet: the previous step's samples, taken
    on the device (async scheduling)."""
    rows: torch.Tensor | None  # positions in the step's input ids (None: every one, in order)
    tokens: torch.Tensor       # their tokens, where the model runs


@dataclass(frozen=True)
class StepInput:
    """One step as every tensor-parallel rank runs it (rank 0 builds it, the others receive it)."""
    ops: BlockOps
    input_ids: list[int]                # empty where `fill` takes every one from the device
    metadata: StepMetadata
    rows: torch.Tensor                  # the logits rows: each sequence's last token, then prompt_span's
    scoring: ScorePlan | None
    num_seqs: int
    fill: TokenFill | None = None


@dataclass(frozen=True)
class BlockMoves:
    """A step's block moves and the pool's plan for them; alone, the step in which no sequence runs."""
    ops: BlockOps
    kv_plan: Any


class StepPeers(Protocol):
    """The other tensor-parallel ranks (distributed/tp_group.py), as rank 0's runner sees them."""

    def broadcast(self, step: StepInput | BlockMoves) -> None: ...


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor                # [len(seqs), vocab]: after each sequence's last token run
    prompt_logits: torch.Tensor         # [R, vocab]: after each position `prompt_span` names, in batch order
    scores: dict[int, torch.Tensor] | None  # batch index -> [layers, kv_heads, slots] attention received


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool | QuantizedKVPool, block_manager: BlockManager | None,
                 device: torch.device, backend: AttentionBackend, kernels: ModuleType | None,
                 swap: SwapSpace | None = None, rotation: KVRotation | None = None,
                 peers: StepPeers | None = None, cuda_graphs: tuple[int, int] | None = None,
                 cpu_stack: bool = False) -> None:
        """`rotation`: the rotation of q, k and v (or v alone) before the pages (attention/rotation.py);
        `peers`: the tensor-parallel ranks that run each step beside this one (rank 0's runner);
        `block_manager` is None on those ranks, which only `execute`; `cuda_graphs`: (sequences,
        slots) up to which decode steps are replayed from CUDA graphs (engine/cuda_graphs.py);
        `cpu_stack`: run small steps through the decoder stack in one C++ call where the
        configuration allows (engine/cpu_stack.py; never on a tensor-parallel rank)."""
        self.model, self.pool, self.block_manager, self.device = model, pool, block_manager, device
        self.peers = peers
        self.rotation = None if rotation is None else rotation.to(device)
        self.backend, self.ops, self.swap = backend, resolve_ops(kernels), swap
        self.linear_kind = cpu_linear_kind(device, next(model.parameters()).dtype, kernels)
        if self.linear_kind is not None:
            replace_linears(model, self.linear_kind, kernels)
        self.graphs = None if cuda_graphs is None else DecodeGraphs(model, backend, self.ops, self.rotation,
                                                                    *cuda_graphs, device)
        self.stack = None
        if cpu_stack:
            reason = CPUDecodeStack.unsupported(model, backend, self.linear_kind, self.rotation)
            if reason is None:
                self.stack = CPUDecodeStack(model, backend, kernels)
            logger.info("kvserve: %s", f"steps of up to {SMALL_BATCH} tokens run the decoder stack in one C++ call"
                        if reason is None else f"the decoder layers run one by one from Python: {reason}")

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], num_scheduled: list[int], ops: BlockOps,
                score_from: list[int | None] | None = None, pending: PendingTokens | None = None) -> StepResult:
        """Runs the next `num_scheduled[i]` uncomputed tokens of each sequence (all of them, or a
        prompt chunk), after the step's block moves. `score_from[i]`: the position from which
        sequence i's queries count toward the attention scores its eviction policy reads (None:
        not scored). `pending`: the previous step's tokens, not yet read by the host, that some of
        these sequences end in. With tensor-parallel peers, they run the same step first."""
        try:
            step = self.prepare(seqs, num_scheduled, ops, score_from, pending)
        except BaseException:
            # The scheduler counts on its moves once made (blocks loaded from the remote tier are
            # in the prefix cache; swaps came before): they happen even if the step cannot run.
            self.move_blocks(ops)
            raise
        if self.peers is not None:
            self.peers.broadcast(step)
        return self.execute(step)

    def prepare(self, seqs: list[Sequence], num_scheduled: list[int], ops: BlockOps,
                score_from: list[int | None] | None = None, pending: PendingTokens | None = None) -> StepInput:
        """Everything a rank needs to run the step, from the scheduler's state (rank 0 only)."""
        bm = self.block_manager
        starts = [s.num_computed_tokens for s in seqs]
        ends = [start + n for start, n in zip(starts, num_scheduled)]
        fill = None if pending is None else self._fill(seqs, starts, num_scheduled, pending)
        # Taken whole from the device in the steady state of async scheduling: no list to build.
        input_ids = [] if fill is not None and fill.rows is None else \
            [t for s, start, end in zip(seqs, starts, ends) for t in s.tokens(start, end)]
        # Only a sequence that evicts holds fewer slots than tokens.
        evicted = [s.num_evicted for s in seqs] if any(s.kv_state is not None for s in seqs) else [0] * len(seqs)
        has_evicted = any(evicted)
        slot_ends = [end - e for end, e in zip(ends, evicted)] if has_evicted else ends
        tables = [bm.tables[s.seq_id] for s in seqs]  # whole: the builder reads the blocks holding context
        step = StepMetadata.build(
            num_scheduled, slot_ends, tables, self.pool.block_size, self.device,
            offloaded=bool(bm.num_host_blocks) and not all(on_device(b) for t in tables for b in t),
            # A generator: only a pool that plans its writes reads it.
            kv_plan=self.pool.plan_step(bm, ((s.seq_id, start - e, end - e)
                                             for s, start, end, e in zip(seqs, starts, ends, evicted)),
                                        list(ops.copies)),
            evicted=evicted if has_evicted else None)
        first_rows = {i: max(f - start, 0) for i, (f, start) in enumerate(zip(score_from or [], starts))
                      if f is not None}
        rows = step.query_start[1:] - 1
        # Row of position p of sequence i: query_start[i] + p - start_i.
        spans = [(i, *prompt_span(s, start, end)) for i, (s, start, end) in enumerate(zip(seqs, starts, ends))
                 if s.params.prompt_logprobs is not None]
        extra = [torch.arange(lo, hi) + int(step.query_start[i]) - starts[i] for i, lo, hi in spans if hi > lo]
        if extra:
            rows = torch.cat([rows, *extra])
        return StepInput(ops, input_ids, step, rows, ScorePlan.build(step, first_rows) if first_rows else None,
                         len(seqs), fill)

    def _fill(self, seqs: list[Sequence], starts: list[int], num_scheduled: list[int],
              pending: PendingTokens) -> TokenFill | None:
        """Where the step's input ids take `pending`'s tokens: a pending sequence's last token, if
        this step runs it (a decode, or the end of a recomputed prompt after a preemption)."""
        if len(seqs) == len(pending.seqs) == sum(num_scheduled) and all(map(operator.is_, seqs, pending.seqs)):
            return TokenFill(None, pending.device.to(self.device))  # the steady state: the same decodes
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
        return TokenFill(to_device(torch.tensor(dest), self.device),
                         pending.device[to_device(torch.tensor(src), pending.device.device)].to(self.device))

    def move_blocks(self, ops: BlockOps) -> set[str]:
        """Block moves outside a forward pass: a step's swaps, ahead of the rest (LLMEngine._swap),
        those of a step in which no sequence runs (async scheduling skips the sequences awaiting
        their last token, and the step may preempt all the others: a swap-out lost here would
        readmit a sequence over pages never written), and the compactions of the evictions a
        step decided, right after it. No write plan: a compressed pool's would retire staged
        blocks that only a forward pass seals (the copy-on-write copies of a step without
        sequences belong to sequences it preempted, so they need no staging copy; evicting
        pools stage nothing). Returns the sequences whose pages a swap tier lost."""
        moves = BlockMoves(ops, None)
        if self.peers is not None:
            self.peers.broadcast(moves)
        return self.apply(moves)

    @torch.inference_mode()
    def apply(self, moves: BlockMoves) -> set[str]:
        """Applies a step's block moves to this rank's pool. Returns the sequences whose pages a
        swap tier failed to take or give back (SwapSpace.apply)."""
        ops = moves.ops
        if ops.compactions:  # first: they read blocks the moves below may reuse
            self.pool.compact(ops.compactions)
        lost: set[str] = set()
        if ops.swap_out or ops.swap_in:
            assert self.swap is not None, "swaps scheduled without a swap space"
            lost = self.swap.apply(self.pool, ops.swap_out, ops.swap_in)
        if ops.offloads:  # only dense pools offload (EngineConfig checks)
            self.pool.offload_blocks(list(ops.offloads))
        if ops.loads:
            write_blocks(self.pool.block_tensors, list(ops.loads))
        self.pool.copy_blocks(list(ops.copies), moves.kv_plan)
        if ops.seals:  # only staged (compressed) pools have them
            self.pool.seal(ops.seals)
        return lost

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepResult:
        """Applies the step's block moves to this rank's pool, then runs the model. The step's
        swaps were applied before it was built (LLMEngine._swap), where a sequence whose pages a
        tier lost can still leave it: none are left here."""
        self.apply(BlockMoves(step.ops, step.metadata.kv_plan))
        fill = step.fill
        if fill is not None and fill.rows is None:
            input_ids = fill.tokens
        else:
            input_ids = to_device(torch.tensor(step.input_ids), self.device)
            if fill is not None:
                input_ids[fill.rows] = fill.tokens
        n = step.num_seqs
        if self.graphs is not None and step.scoring is None and self.graphs.serves(step.metadata, len(step.rows)):
            logits = self.graphs.run(step.metadata, input_ids)
            return StepResult(logits, logits[n:], None)
        if self.stack is not None and step.scoring is None and self.stack.serves(step.metadata):
            logits = self.stack.run(step.metadata, input_ids, step.rows)
            return StepResult(logits[:n], logits[n:], None)
        attention = StepAttention.of(self.backend, step.metadata, step.scoring, self.rotation)
        logits = self.model(input_ids, attention, to_device(step.rows, self.device), self.ops)
        scores = None if attention.scoring is None else dict(zip(attention.scoring.batch_index,
                                                                 attention.scores.cpu().unbind(1)))
        return StepResult(logits[:n], logits[n:], scores)

    @staticmethod
    def sample(seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """[len(seqs)] next tokens, where `logits` are (reading them is the caller's sync)."""
        return sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                      [len(s.output_token_ids) for s in seqs])
