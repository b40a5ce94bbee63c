"""The preallocated KV pool in the model's dtype: per layer, `num_blocks x block_size` token slots.

The pages are zeroed, not left empty: a masked, never-written slot is still multiplied by 0 in
attention, and uninitialised memory may hold NaN. Dense pages are the fast path and the only
pages that swap (cache/swap_space.py) and offload: a sequence longer than the device pool moves
its oldest blocks to host blocks (pinned on CUDA), which the torch backend and the CPU kernel
read in place (block ids from `num_blocks` on).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.cache.compaction import Compaction, move_slots
from kvserve.cache.page_step import PageStep
from kvserve.huge_pages import huge_page_zeros

if TYPE_CHECKING:
    from kvserve.cache.block_manager import HostBlock


class DenseLayerKV:
    """One layer's K and V pages, stored as they are computed. Offloaded blocks (ids >= the
    device pool's size) are read from the host copies."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, host_k: torch.Tensor | None,
                 host_v: torch.Tensor | None) -> None:
        self.k, self.v, self.host_k, self.host_v = k, v, host_k, host_v

    def write(self, k: torch.Tensor, v: torch.Tensor, meta: PageStep) -> None:
        """New tokens' K/V [T, kv_heads, head_dim] into their slots."""
        self.k.view(-1, *self.k.shape[2:])[meta.slot_mapping] = k.to(self.k.dtype)
        self.v.view(-1, *self.v.shape[2:])[meta.slot_mapping] = v.to(self.v.dtype)

    def seal(self, meta: PageStep) -> None:
        """Dense pages hold their final values from `write` on: nothing waits for the attention."""

    def gather(self, meta: PageStep) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [B, max_blocks, block_size, kv_heads, head_dim] of the block tables."""
        tables = meta.block_tables
        return (_gather(self.k, self.host_k if meta.offloaded else None, tables),
                _gather(self.v, self.host_v if meta.offloaded else None, tables))


def _gather(cache: torch.Tensor, host: torch.Tensor | None, tables: torch.Tensor) -> torch.Tensor:
    if host is None:
        return cache[tables]
    num_device = cache.shape[0]
    on_host = tables >= num_device
    from_device = cache[tables.clamp(max=num_device - 1)]
    from_host = host[(tables - num_device).clamp(min=0).cpu()].to(cache.device)
    return torch.where(on_host[:, :, None, None, None], from_host, from_device)


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError("KVPool.num_blocks must be at least 1")
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: masked-out slots are still multiplied by 0 in attention, and
        # uninitialised memory may hold NaN, which 0 does not cancel.
        pages = huge_page_zeros([(shape, dtype)] * (2 * num_layers), device)
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = list(zip(pages[0::2], pages[1::2]))
        # Cold blocks of sequences longer than the device pool; block id num_blocks + i is host
        # block i. Pinned on CUDA so bringing them in for attention is a fast copy.
        pin = device.type == "cuda"
        self.host_layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros((num_host_blocks, *shape[1:]), dtype=dtype, pin_memory=pin),
             torch.zeros((num_host_blocks, *shape[1:]), dtype=dtype, pin_memory=pin))
            for _ in range(num_layers)] if num_host_blocks else []
        self.kv = [DenseLayerKV(k, v, *(self.host_layers[i] if self.host_layers else (None, None)))
                   for i, (k, v) in enumerate(self.layers)]

    @property
    def block_tensors(self) -> list[torch.Tensor]:
        """Every tensor indexed by device block, in a fixed order (cache/block_bytes.py)."""
        return [t for pair in self.layers for t in pair]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def write_plan(self, staging: None) -> None:
        """Pages hold K/V as computed: nothing to plan per step (see QuantizedKVPool)."""
        return None

    def copy_blocks(self, pairs: list[tuple[int, int]], plan: None = None) -> None:
        """Copy-on-write: block `src`'s K/V into block `dst`, in every layer (`plan`: a
        compressed pool's; dense pages have none)."""
        if not pairs:
            return
        device = self.layers[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]

    def compact(self, compactions: tuple[Compaction, ...]) -> None:
        """Token eviction's moves, one sequence after another: a later one's copy-on-write may
        reuse a block an earlier one reads from."""
        for c in compactions:
            self.copy_blocks(list(c.copies))
            move_slots([list(kv) for kv in self.layers], c)

    def offload_blocks(self, pairs: list[tuple[int, HostBlock]]) -> None:
        """Copy device block `src` into host block `dst`, every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.layers[0][0].device)
        dst = torch.tensor([d.host_index for _, d in pairs])
        for (k, v), (hk, hv) in zip(self.layers, self.host_layers):
            hk[dst] = k[src].cpu()
            hv[dst] = v[src].cpu()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
