"""A sequence's token eviction as the pool applies it: slot moves per (layer, KV head)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Compaction:
    """Token eviction in one sequence's blocks: copies of the blocks it writes that are shared or
    cached (into fresh ones), then per (layer, KV head) slot `src` into slot `dst` (flat pool slots)."""
    copies: tuple[tuple[int, int], ...]
    layer: torch.Tensor
    head: torch.Tensor
    src: torch.Tensor
    dst: torch.Tensor


def move_slots(layers: list[list[torch.Tensor]], c: Compaction) -> None:
    """A compaction's slot moves in every layer's page tensors ([num_blocks, block_size, kv_heads,
    ...] each: K and V, or each field of a compressed format); every source is read first."""
    device = layers[0][0].device
    layer, head, src, dst = (t.to(device) for t in (c.layer, c.head, c.src, c.dst))
    for i, tensors in enumerate(layers):
        sel = layer == i
        h, s, d = head[sel], src[sel], dst[sel]
        for t in tensors:
            flat = t.view(-1, *t.shape[2:])
            flat[d, h] = flat[s, h]
