"""Attention that reads keys and values from the paged KV pool.

One function serves prefill, decode and a mix of both: every sequence in the step brings
`query_len` new tokens and attends to `context_len` cached tokens (its new ones included).
Queries are padded into a [batch, max_query_len] grid, keys are gathered from the pool
through the block tables, and one `scaled_dot_product_attention` call does the rest.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F


class LayerKV(Protocol):
    """One layer's paged K/V store (kvserve.cache): dense pages or compressed ones."""

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: "AttentionMetadata") -> None: ...

    def gather(self, meta: "AttentionMetadata") -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass
class AttentionMetadata:
    """Per-step indexing shared by every layer; built once by the model runner."""
    slot_mapping: torch.Tensor   # [T] flat pool slot that each new token's K/V is written to
    block_tables: torch.Tensor   # [B, max_blocks] block ids, padded with 0 (masked out)
    query_index: torch.Tensor | None  # [T] flat index of each new token in the [B * max_query_len]
                                      # grid; None when every sequence brings max_query_len tokens
    positions: torch.Tensor      # [T] position of each new token in its sequence (for RoPE)
    mask: torch.Tensor           # [B, 1, max_query_len * group, max_blocks * block_size] bool
    max_query_len: int
    offloaded: bool = False  # a block table holds host blocks (ids >= the device pool's size)
    kv_plan: Any = None      # where a compressed pool stores this step's tokens (QuantizedKVPool)

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, group: int, device: torch.device) -> "AttentionMetadata":
        """`group` is query heads per KV head: queries of one group share their KV head, so
        they are folded into the query axis instead of copying K/V per query head."""
        batch = len(query_lens)
        max_q = max(query_lens)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros(batch, max_blocks, dtype=torch.long)
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = torch.tensor(table, dtype=torch.long)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        ctx_lens = torch.tensor(context_lens, dtype=torch.long)

        # Token j of sequence b sits at grid row b * max_q + j and at position ctx - q_len + j.
        starts = torch.repeat_interleave(torch.arange(batch) * max_q, q_lens)
        offsets = torch.arange(int(q_lens.sum())) - torch.repeat_interleave(
            torch.cumsum(q_lens, 0) - q_lens, q_lens)
        query_index = starts + offsets
        positions = torch.repeat_interleave(ctx_lens - q_lens, q_lens) + offsets
        block_ids = tables.flatten()[
            torch.repeat_interleave(torch.arange(batch) * max_blocks, q_lens) + positions // block_size]
        slot_mapping = block_ids * block_size + positions % block_size

        # Padded query rows keep position 0 so they attend to one key instead of none (no NaN).
        q_pos = torch.zeros(batch * max_q, dtype=torch.long)
        q_pos[query_index] = positions
        k_pos = torch.arange(max_blocks * block_size)
        mask = (k_pos[None, None, :] <= q_pos.view(batch, max_q, 1)) & (
            k_pos[None, None, :] < ctx_lens[:, None, None])
        mask = mask.repeat_interleave(group, dim=1).unsqueeze(1)
        padded = len(query_index) != batch * max_q
        return cls(slot_mapping.to(device), tables.to(device),
                   query_index.to(device) if padded else None, positions.to(device),
                   mask.to(device), max_q)


def paged_attention(q: torch.Tensor, kv: LayerKV, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, heads, head_dim] for the step's new tokens; returns [T, heads, head_dim]."""
    total, heads, dim = q.shape
    # [B, max_blocks, block_size, kvh, D]: the pages of the block tables, decoded if compressed.
    k_pages, v_pages = kv.gather(meta)
    kv_heads = k_pages.shape[3]
    group = heads // kv_heads
    batch = meta.block_tables.shape[0]
    max_q = meta.max_query_len

    if meta.query_index is None:
        grid = q
    else:
        grid = q.new_zeros(batch * max_q, heads, dim)
        grid[meta.query_index] = q
    # [B, Lq, kvh, group, D] -> [B, kvh, Lq * group, D]: row i * group + g is query i, head g.
    grid = grid.view(batch, max_q, kv_heads, group, dim).permute(0, 2, 1, 3, 4)
    grid = grid.reshape(batch, kv_heads, max_q * group, dim)

    # [B, max_blocks, block_size, kvh, D] -> [B, kvh, keys, D]
    k = k_pages.flatten(1, 2).transpose(1, 2).to(q.dtype)
    v = v_pages.flatten(1, 2).transpose(1, 2).to(q.dtype)
    out = F.scaled_dot_product_attention(grid, k, v, attn_mask=meta.mask, scale=scale)

    out = out.view(batch, kv_heads, max_q, group, dim).permute(0, 2, 1, 3, 4)
    out = out.reshape(batch * max_q, heads, dim)
    return out if meta.query_index is None else out[meta.query_index]
