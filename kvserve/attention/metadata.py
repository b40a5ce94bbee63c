"""What every attention backend is told about a step: pool-agnostic, built once by the runner."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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
    kv_plan: Any                 # the pool's own plan for this step's writes (QuantizedKVPool)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device, offloaded: bool = False,
              kv_plan: Any = None, evicted: list[int] | None = None) -> "StepMetadata":
        batch = len(query_lens)
        max_blocks = max(len(t) for t in block_tables)
        # One tensor from padded Python rows: cheaper than a copy per sequence.
        tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx = torch.tensor(context_lens, dtype=torch.long)
        query_start = torch.zeros(batch + 1, dtype=torch.long)
        torch.cumsum(q_lens, 0, out=query_start[1:])
        total = int(query_start[-1])
        seq_of = torch.repeat_interleave(torch.arange(batch), q_lens, output_size=total)
        # Token j of sequence b sits in slot ctx_b - q_len_b + j, at that plus its evicted count.
        slots = torch.arange(total) - query_start[:-1][seq_of] + (ctx - q_lens)[seq_of]
        block_ids = tables[seq_of, slots // block_size]
        slot_mapping = block_ids * block_size + slots % block_size
        positions = slots if evicted is None else slots + torch.tensor(evicted, dtype=torch.long)[seq_of]
        return cls(query_start, ctx, tables.to(device), slot_mapping.to(device), positions.to(device),
                   max(query_lens), offloaded, kv_plan)

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]
