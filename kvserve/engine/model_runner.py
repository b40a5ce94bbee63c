"""Runs one scheduled batch through the model and samples each sequence's next token.

Its only inputs are a `StepPlan` (engine/step_plan.py) and the model: it reads no scheduler
state. `prepare` (rank 0) turns the plan into a `StepInput` (one packed batch, its
`StepMetadata`, the logits rows); `execute` (every tensor-parallel rank) first applies the step's
`BlockOps` in one place (`apply`, in the order block_ops.py gives: every read of a block ahead of
any write that may reuse it), then runs a decode step from a CUDA graph (engine/cuda_graphs.py),
a small CPU step through the fused decoder stack (engine/cpu_stack.py), or else the layered model
with the backend bound to the step (`StepAttention`). On CPU the model's linears are replaced
once, at construction, where one of model/cpu_linear.py's fits the dtype and kernels.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch

from kvserve.attention import AttentionBackend, StepAttention, StepMetadata
from kvserve.attention.rotation import KVRotation
from kvserve.attention.scores import ScorePlan
from kvserve.cache.block_bytes import write_blocks
from kvserve.cache.block_ops import BlockOps
from kvserve.cache.kv_pool import KVPool
from kvserve.cache.page_step import WritePlan
from kvserve.cache.quantized_pool import QuantizedKVPool
from kvserve.cache.swap_space import SwapSpace
from kvserve.device_copy import to_device
from kvserve.engine.cpu_stack import CPUDecodeStack
from kvserve.engine.cuda_graphs import DecodeGraphs
from kvserve.engine.sampler import sample
from kvserve.engine.sequence import Sequence
from kvserve.engine.step_plan import StepPlan, TokenFill
from kvserve.huge_pages import move_to_huge_pages
from kvserve.model.cpu_linear import SMALL_BATCH, cpu_linear_kind, replace_linears
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.ops import resolve_ops

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepInput:
    """One step as every tensor-parallel rank runs it (rank 0 builds it, the others receive it)."""
    ops: BlockOps
    input_ids: list[int]                # empty where `fill` takes every one from the device
    metadata: StepMetadata              # over the first KV cache group's block tables
    rows: torch.Tensor                  # the logits rows: each sequence's last token, prompt_span's, drafts'
    scoring: ScorePlan | None
    num_seqs: int
    fill: TokenFill | None = None
    other_groups: tuple[StepMetadata, ...] = ()  # the same tokens over the other groups' tables
    num_draft_rows: int = 0             # the rows' last: the positions before each draft token


@dataclass(frozen=True)
class BlockMoves:
    """A step's block moves and the pool's plan for them; alone, the step in which no sequence runs."""
    ops: BlockOps
    kv_plan: WritePlan | None


class StepPeers(Protocol):
    """The other tensor-parallel ranks (distributed/tp_group.py), as rank 0's runner sees them."""

    def broadcast(self, step: StepInput | BlockMoves) -> None: ...


@dataclass(frozen=True)
class StepResult:
    logits: torch.Tensor                # [len(seqs), vocab]: after each sequence's last token run
    prompt_logits: torch.Tensor         # [R, vocab]: after each position `prompt_span` names, in batch order
    scores: dict[int, torch.Tensor] | None  # batch index -> [layers, kv_heads, slots] attention received
    draft_logits: torch.Tensor | None = None  # [D, vocab]: before each draft token, in batch order

    @classmethod
    def split(cls, logits: torch.Tensor, step: StepInput,
              scores: dict[int, torch.Tensor] | None = None) -> StepResult:
        """The result from the logits of the step's rows, in their order."""
        n, d = step.num_seqs, step.num_draft_rows
        end = logits.shape[0] - d
        return cls(logits[:n], logits[n:end], scores, logits[end:] if d else None)


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, pool: KVPool | QuantizedKVPool,
                 device: torch.device, backend: AttentionBackend, kernels: ModuleType | None,
                 swap: SwapSpace | None = None, rotation: KVRotation | None = None,
                 peers: StepPeers | None = None, cuda_graphs: tuple[int, int] | None = None,
                 cpu_stack: bool = False, layer_map: tuple[tuple[int, int], ...] | None = None) -> None:
        """`rotation`: the rotation of q, k and v (or v alone) before the pages (attention/rotation.py);
        `peers`: the tensor-parallel ranks that run each step beside this one (rank 0's runner;
        the others only `execute`); `cuda_graphs`: (sequences,
        slots) up to which decode steps are replayed from CUDA graphs (engine/cuda_graphs.py);
        `cpu_stack`: run small steps through the decoder stack in one C++ call where the
        configuration allows (engine/cpu_stack.py; never on a tensor-parallel rank); `layer_map`:
        each layer's (KV cache group, pool tensor) with the hybrid KV cache (cache/kv_groups.py),
        None when one group holds layer i in tensor i."""
        self.model, self.pool, self.device = model, pool, device
        self.layer_map = layer_map
        self.peers = peers
        self.rotation = None if rotation is None else rotation.to(device)
        self.backend, self.ops, self.swap = backend, resolve_ops(kernels), swap
        self.linear_kind = cpu_linear_kind(device, next(model.parameters()).dtype, kernels)
        if self.linear_kind is not None:
            replace_linears(model, self.linear_kind, kernels)
        if device.type == "cpu":
            move_to_huge_pages(model)
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
    def forward(self, plan: StepPlan) -> StepResult:
        """Runs the plan's spans (a prompt, its chunk, or a decode per sequence) after the step's
        block moves. With tensor-parallel peers, they run the same step first."""
        try:
            step = self.prepare(plan)
        except BaseException:
            # The scheduler counts on its moves once made (blocks loaded from the remote tier are
            # in the prefix cache; swaps came before): they happen even if the step cannot run.
            self.move_blocks(plan.ops)
            raise
        if self.peers is not None:
            self.peers.broadcast(step)
        return self.execute(step)

    def prepare(self, plan: StepPlan) -> StepInput:
        """The tensors every rank needs to run the step (rank 0 only)."""
        spans = plan.spans
        # Only a sequence that evicts holds fewer slots than tokens.
        has_evicted = any(span.evicted for span in spans)
        query_lens, context_lens = [span.num_tokens for span in spans], [span.end - span.evicted for span in spans]
        step, *others = [StepMetadata.build(
            query_lens, context_lens, [span.tables[g] for span in spans], self.pool.block_size, self.device,
            offloaded=plan.offloaded, kv_plan=plan.kv_plan,
            evicted=[span.evicted for span in spans] if has_evicted else None)
            for g in range(len(spans[0].tables))]
        first_rows = {i: max(span.score_from - span.start, 0) for i, span in enumerate(spans)
                      if span.score_from is not None}
        rows = step.query_start[1:] - 1
        # Row of position p of sequence i: query_start[i] + p - start_i.
        extra = [torch.arange(lo, hi) + int(step.query_start[i]) - span.start
                 for i, span in enumerate(spans) if span.prompt_rows is not None
                 for lo, hi in [span.prompt_rows] if hi > lo]
        # The positions before each draft token: the last token's and the draft's own but its last.
        drafts = [torch.arange(span.num_tokens - 1 - span.draft, span.num_tokens - 1) + int(step.query_start[i])
                  for i, span in enumerate(spans) if span.draft]
        if extra or drafts:
            rows = torch.cat([rows, *extra, *drafts])
        return StepInput(plan.ops, plan.input_ids, step, rows,
                         ScorePlan.build(step, first_rows) if first_rows else None, plan.num_seqs, plan.fill,
                         tuple(others), sum(span.draft for span in spans))

    def move_blocks(self, ops: BlockOps) -> set[str]:
        """Block moves outside a forward pass: a step's swaps, ahead of the rest (LLMEngine._swap),
        those of a step in which no sequence runs (async scheduling skips the sequences awaiting
        their last token, and the step may preempt all the others: a swap-out lost here would
        readmit a sequence over pages never written), and compactions carried for a step that an
        idle engine will not run. No write plan: a compressed pool's would retire staged
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
        # Copies before loads: a copy's source may be a block a preempted sample gave back this
        # step, which an admission's remote-tier load may take; a copy never reads a loaded block.
        self.pool.copy_blocks(list(ops.copies), moves.kv_plan)
        if ops.loads:
            write_blocks(self.pool.block_tensors, list(ops.loads))
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
        if self.graphs is not None and step.scoring is None and self.graphs.serves(step.metadata, len(step.rows)):
            return StepResult.split(self.graphs.run(step.metadata, input_ids), step)
        if self.stack is not None and step.scoring is None and self.stack.serves(step.metadata):
            return StepResult.split(self.stack.run(step.metadata, input_ids, step.rows), step)
        attention = StepAttention.of(self.backend, step.metadata, step.scoring, self.rotation, step.other_groups,
                                     self.layer_map)
        logits = self.model(input_ids, attention, to_device(step.rows, self.device), self.ops)
        scores = None if attention.scoring is None else dict(zip(attention.scoring.batch_index,
                                                                 attention.scores.cpu().unbind(1)))
        return StepResult.split(logits, step, scores)

    def sample(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """[len(seqs)] next tokens, where `logits` are (reading them is the caller's sync)."""
        return sample(logits, [s.params for s in seqs], [s.seed for s in seqs],
                      [len(s.output_token_ids) for s in seqs], self.ops.argmax)
