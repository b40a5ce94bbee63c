"""What every attention backend is told about a step: pool-agnostic, built once by the runner."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvserve.cache.page_step import WritePlan
from kvserve.device_copy import to_device


@dataclass(frozen=True)
class StepMetadata:
    """Sequence b brings `query_len` new tokens (rows query_start[b] .. query_start[b + 1] of the
    step's [T] tokens) and attends to the `context_len` slots of its block table, its new ones
    last. Prefill is query_len == context_len, decode query_len == 1; recompute and chunks are
    the same shape. Slots and positions differ by the tokens a sequence has evicted: masks and
    kernels work in slots, RoPE in positions."""
    query_start: torch.Tensor    # [B + 1] int64, on the CPU (kernels and builders read it there)
    context_lens: torch.Tensor   # [B] int64, on the CPU
    block_tables: torch.Tensor   # [B, max_blocks] int64 block ids, padded with 0, on the device
    slot_mapping: torch.Tensor   # [T] flat pool slot each new token's K/V goes to, on the device
    positions: torch.Tensor      # [T] position of each new token in its sequence, on the device
    max_query_len: int
    offloaded: bool              # a table holds host blocks (ids >= the device pool's size)
    kv_plan: WritePlan | None    # a compressed pool's plan for this step's writes (QuantizedKVPool)
    # A sequence has evicted tokens: its slots no longer sit at their positions, which a
    # sliding window (a span of positions, masked in slots) needs.
    evicts: bool = False

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, offloaded: bool = False,
              kv_plan: WritePlan | None = None, evicted: list[int] | None = None) -> "StepMetadata":
        """`block_tables`: each sequence's blocks, at least those holding its context."""
        # numpy, then shared into tensors: a dozen small ops cost ~15 us where the same in torch
        # took ~45 (its per-op dispatch; one sequence), and on a CPU both run ~10x slower inside a
        # decode step, on caches the weights' read has just flushed (BENCHMARKS.md).
        batch = len(query_lens)
        q_lens = np.array(query_lens, dtype=np.int64)
        ctx = np.array(context_lens, dtype=np.int64)
        # Each table cut to the blocks holding context (a contiguous reservation's unused tail is
        # not read) and padded: one array from Python rows. Building it in numpy (one pass over
        # all ids, then masks) saved ~15 us at 64 sequences but cost ~30 at one: its eight calls
        # run cold inside a step.
        used = [-(-c // block_size) for c in context_lens]
        width = max(used)
        tables = np.array([t[:u] + [0] * (width - u) for t, u in zip(block_tables, used)], dtype=np.int64)
        query_start = np.zeros(batch + 1, dtype=np.int64)
        np.cumsum(q_lens, out=query_start[1:])
        seq_of = np.repeat(np.arange(batch), q_lens)
        # Token j of sequence b sits in slot ctx_b - q_len_b + j, at that plus its evicted count.
        slots = np.arange(int(query_start[-1])) - query_start[:-1][seq_of] + (ctx - q_lens)[seq_of]
        slot_mapping = tables[seq_of, slots // block_size] * block_size + slots % block_size
        positions = slots if evicted is None else slots + np.array(evicted, dtype=np.int64)[seq_of]
        tensor = torch.from_numpy
        return cls(tensor(query_start), tensor(ctx), to_device(tensor(tables), device),
                   to_device(tensor(slot_mapping), device), to_device(tensor(positions), device), max(query_lens),
                   offloaded, kv_plan, evicted is not None and any(evicted))

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
