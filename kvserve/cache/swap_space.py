"""Tiers below the device pool for preempted sequences: host memory, then a memory-mapped file.

A swapped-out sequence's blocks are copied into tier slots and its device blocks are released;
swapping in copies them back into fresh device blocks. `swap_out` and `swap_in` return the copies;
the scheduler puts them in its step's block moves, and the model runner applies them before its
next forward pass, in an order that keeps every read ahead of any overwrite: swap-outs, then
swap-ins, then the slots that were read are released.
"""
from __future__ import annotations

import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvserve.cache.kv_pool import KVPool


@dataclass
class Tier:
    name: str
    data: torch.Tensor  # [slots, layers, 2 (K, V), block_size, kv_heads, head_dim]
    free: list[int] = field(default_factory=list)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]


@dataclass(frozen=True)
class TierUsage:
    name: str
    total: int
    used: int
    free: int


class SwapSpace:
    def __init__(self, pool: KVPool, host_blocks: int, disk_blocks: int,
                 disk_dir: str | Path | None = None) -> None:
        k0 = pool.layers[0][0]
        shape = (len(pool.layers), 2, *k0.shape[1:])
        self.tiers: list[Tier] = []
        if host_blocks > 0:
            # On CUDA, pinned host memory makes the copies asynchronous-capable and fast.
            data = torch.zeros((host_blocks, *shape), dtype=k0.dtype,
                               pin_memory=k0.device.type == "cuda")
            self.tiers.append(Tier("host", data))
        self._file = None
        if disk_blocks > 0:
            self._file = tempfile.NamedTemporaryFile(dir=disk_dir, prefix="kvserve-swap-", suffix=".bin")
            numel = disk_blocks * torch.Size(shape).numel()
            self._file.truncate(numel * k0.element_size())
            data = torch.from_file(self._file.name, shared=True, size=numel, dtype=k0.dtype)
            self.tiers.append(Tier("disk", data.view(disk_blocks, *shape)))
        for tier in self.tiers:
            tier.free = list(range(tier.num_slots))
        self.swapped: dict[str, list[tuple[int, int]]] = {}  # seq_id -> (tier index, slot) per block
        self.swap_outs: Counter[str] = Counter()     # blocks swapped out, per tier
        self.swap_ins: Counter[str] = Counter()

    @property
    def free_slots(self) -> int:
        return sum(len(t.free) for t in self.tiers)

    def swap_out(self, seq_id: str, device_table: list[int]) -> tuple[tuple[int, int, int], ...] | None:
        """Reserve slots (host first). Returns the copies (device block, tier, slot) to make before
        the device blocks are reused; None, changing nothing, if the tiers are full."""
        if len(device_table) > self.free_slots:
            return None
        slots = []
        for block in device_table:
            tier = next(i for i, t in enumerate(self.tiers) if t.free)
            slots.append((tier, self.tiers[tier].free.pop()))
            self.swap_outs[self.tiers[tier].name] += 1
        self.swapped[seq_id] = slots
        return tuple((block, tier, slot) for block, (tier, slot) in zip(device_table, slots))

    def swap_in(self, seq_id: str, device_table: list[int]) -> tuple[tuple[int, int, int], ...]:
        """Returns the copies (tier, slot, device block) back into the first blocks of
        `device_table` (it may have grown room for the token that was waiting when the sequence
        was preempted); the slots free once copied."""
        slots = self.swapped.pop(seq_id)
        copies = tuple((tier, slot, block)
                       for (tier, slot), block in zip(slots, device_table[:len(slots)], strict=True))
        for tier, _ in slots:
            self.swap_ins[self.tiers[tier].name] += 1
        return copies

    def discard(self, seq_id: str) -> None:
        """A swapped sequence was aborted: its slots are free again."""
        for tier, slot in self.swapped.pop(seq_id, []):
            self.tiers[tier].free.append(slot)

    def apply(self, pool: KVPool, swap_out: Sequence[tuple[int, int, int]],
              swap_in: Sequence[tuple[int, int, int]]) -> None:
        """Copies out (every read first), then back in; slots read back are free again."""
        for tier_index, tier in enumerate(self.tiers):
            out = [(b, s) for b, t, s in swap_out if t == tier_index]
            if out:
                blocks = torch.tensor([b for b, _ in out], device=pool.layers[0][0].device)
                slots = torch.tensor([s for _, s in out])
                for layer, (k, v) in enumerate(pool.layers):
                    tier.data[slots, layer, 0] = k[blocks].to(tier.data.device)
                    tier.data[slots, layer, 1] = v[blocks].to(tier.data.device)
        for tier_index, tier in enumerate(self.tiers):
            back = [(s, b) for t, s, b in swap_in if t == tier_index]
            if back:
                slots = torch.tensor([s for s, _ in back])
                blocks = torch.tensor([b for _, b in back], device=pool.layers[0][0].device)
                for layer, (k, v) in enumerate(pool.layers):
                    k[blocks] = tier.data[slots, layer, 0].to(k.device)
                    v[blocks] = tier.data[slots, layer, 1].to(v.device)
                tier.free.extend(s for s, _ in back)

    def usage(self) -> list[TierUsage]:
        return [TierUsage(t.name, t.num_slots, t.num_slots - len(t.free), len(t.free)) for t in self.tiers]
