"""A block's pages as one byte string, for tiers that store blocks outside the pool (kv_remote).

A pool lists its per-block tensors (`block_tensors`, every one with the block as its first
dim) in a fixed order; a block's bytes are their rows, one after another.
"""
from __future__ import annotations

import torch


def read_blocks(tensors: list[torch.Tensor], block_ids: list[int]) -> list[bytes]:
    if not block_ids:
        return []
    index = torch.tensor(block_ids, device=tensors[0].device)
    rows = [t.index_select(0, index).view(torch.uint8).reshape(len(block_ids), -1).cpu() for t in tensors]
    return [b"".join(r[i].numpy().tobytes() for r in rows) for i in range(len(block_ids))]


def block_nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t[0].nbytes for t in tensors)


def write_blocks(tensors: list[torch.Tensor], blocks: list[tuple[int, bytes]]) -> None:
    """Each (block id, bytes from `read_blocks` of a pool with the same layout) into its rows."""
    nbytes = block_nbytes(tensors)
    for block_id, payload in blocks:
        if len(payload) != nbytes:  # the tier checks lengths when it unpacks: a caller's fault
            raise ValueError(f"a block of this pool is {nbytes} bytes, got {len(payload)} bytes")
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        offset = 0
        for t in tensors:
            n = t[0].nbytes
            # cloned: a dtype view needs an offset aligned to the dtype's size
            t[block_id].copy_(data[offset:offset + n].clone().view(t.dtype).view(t.shape[1:]))
            offset += n
