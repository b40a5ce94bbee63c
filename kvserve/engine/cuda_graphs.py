"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM's and
nano-vllm's design).

An eager decode step launches a few hundred small kernels from Python, and the GPU waits for
the host between them. A graph records the whole model once per bucket over static buffers;
a step then copies its token ids, positions, slots, context lengths and block tables into those
buffers and launches the graph: one launch for every layer.

A step of n sequences runs in the smallest bucket b >= n. The b - n pad rows repeat the first
sequence whole (token, position, slot, context length and block table), so every layer computes
the same K/V for them as for it and writes the same values to the same slot: they need no scratch
block, and their outputs are dropped. (With no context a pad row's attention output, and so its
next layer's K/V, would differ.)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvserve.attention import AttentionBackend, StepAttention, StepMetadata
from kvserve.attention.rotation import KVRotation
from kvserve.device_copy import to_device
from kvserve.model.llama import LlamaForCausalLM
from kvserve.model.ops import Ops

logger = logging.getLogger(__name__)

# Small buckets are dense because one stream and small batches are where the launch cost is
# the whole step; large ones sparse because a pad row costs little there.
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    def __init__(self, model: LlamaForCausalLM, backend: AttentionBackend, ops: Ops,
                 rotation: KVRotation | None, max_batch: int, max_context: int, device: torch.device,
                 capture: bool = True) -> None:
        """Captures a graph per bucket up to `max_batch` sequences of up to `max_context` slots.
        `capture=False` runs the same static-buffer step eagerly instead (on any device: how the
        tests check the buffers and the padding without a GPU)."""
        block_size = backend.pool.block_size
        self.max_blocks = -(-max_context // block_size)
        self.buckets = [b for b in BUCKETS if b < max_batch] + [max_batch]
        top = self.buckets[-1]
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.zeros(top, dtype=torch.long, device=device)
        self.context_lens = torch.zeros(top, dtype=torch.int32, device=device)
        self.tables = torch.zeros(top, self.max_blocks, dtype=torch.int32, device=device)
        self.runs: dict[int, Callable[[], torch.Tensor]] = {}
        start = time.perf_counter()
        pool = None
        with torch.inference_mode():
            for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory
                run = self._step_fn(model, backend, ops, rotation, b, self.max_blocks * block_size)
                if capture:
                    run, pool = _capture(run, pool)
                self.runs[b] = run
        if capture:
            torch.cuda.synchronize(device)
            logger.info("kvserve: %d decode CUDA graphs (batch 1..%d) captured in %.1f s",
                        len(self.buckets), top, time.perf_counter() - start)

    def _step_fn(self, model: LlamaForCausalLM, backend: AttentionBackend, ops: Ops,
                 rotation: KVRotation | None, batch: int, max_context: int) -> Callable[[], torch.Tensor]:
        device = self.input_ids.device
        step = StepMetadata(query_start=torch.arange(batch + 1), context_lens=torch.zeros(batch, dtype=torch.long),
                            block_tables=self.tables[:batch], slot_mapping=self.slots[:batch],
                            positions=self.positions[:batch], max_query_len=1, offloaded=False, kv_plan=None)
        attention = StepAttention(backend, step, (backend.prepare_graph(step, self.context_lens[:batch], max_context),),
                                  rotation=rotation)
        rows = torch.arange(batch, device=device)
        ids = self.input_ids[:batch]
        return lambda: model(ids, attention, rows, ops)

    def serves(self, step: StepMetadata, num_rows: int) -> bool:
        """A decode step (one token per sequence, only each last token's logits) that fits."""
        return (step.max_query_len == 1 and num_rows == step.num_seqs <= self.buckets[-1]
                and step.block_tables.shape[1] <= self.max_blocks)

    @torch.inference_mode()
    def run(self, step: StepMetadata, input_ids: torch.Tensor) -> torch.Tensor:
        """[n, vocab] fp32 logits of the step's n sequences (`input_ids` [n] on the device)."""
        n = step.num_seqs
        b = next(b for b in self.buckets if b >= n)
        width = step.block_tables.shape[1]
        for buffer, values in ((self.input_ids, input_ids), (self.positions, step.positions),
                               (self.slots, step.slot_mapping),
                               (self.context_lens, to_device(step.context_lens, self.context_lens.device)),
                               (self.tables[:, :width], step.block_tables)):
            buffer[:n].copy_(values)
            buffer[n:b].copy_(values[:1].expand(b - n, *values.shape[1:]))
        # A copy: the graph's output buffer is overwritten by the next replay.
        return self.runs[b]()[:n].clone()


@dataclass(frozen=True)
class _Captured:
    """A captured graph and its output. The graph reads the tensors `step` closes over (its row
    index, the attention's tiles) by address: they must live as long as it, or the allocator hands
    their memory to other tensors and a replay gathers by garbage indices."""
    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    step: Callable[[], torch.Tensor]

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.out


def _capture(run: Callable[[], torch.Tensor], pool: object) -> tuple[Callable[[], torch.Tensor], object]:
    """Records `run` in a CUDA graph; returns its replay and the graph's memory pool. A warm-up
    call first compiles the Triton kernels and settles cuBLAS's workspaces outside the capture
    (it writes one slot of block 0, before any request holds a block)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return _Captured(graph, out, run), graph.pool()
