"""The preallocated K and V pools: per layer, `num_blocks x block_size` token slots."""
from __future__ import annotations

import torch


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, num_host_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError("KVPool.num_blocks must be at least 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        # Zeros, not empty: masked-out slots are still multiplied by 0 in attention, and
        # uninitialised memory may hold NaN, which 0 does not cancel.
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]
        # Cold blocks of sequences longer than the device pool; block id num_blocks + i is host
        # block i. Pinned on CUDA so bringing them in for attention is a fast copy.
        pin = device.type == "cuda"
        self.host_layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros((num_host_blocks, *shape[1:]), dtype=dtype, pin_memory=pin),
             torch.zeros((num_host_blocks, *shape[1:]), dtype=dtype, pin_memory=pin))
            for _ in range(num_layers)] if num_host_blocks else []

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: block `src`'s K/V into block `dst`, in every layer."""
        if not pairs:
            return
        device = self.layers[0][0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for k, v in self.layers:
            k[dst] = k[src]
            v[dst] = v[src]

    def offload_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device block `src` into host block `dst` (a block id >= num_blocks), every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.layers[0][0].device)
        dst = torch.tensor([d - self.num_blocks for _, d in pairs])
        for (k, v), (hk, hv) in zip(self.layers, self.host_layers):
            hk[dst] = k[src].cpu()
            hv[dst] = v[src].cpu()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in self.layers)
