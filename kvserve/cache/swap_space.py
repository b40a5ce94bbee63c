"""Tiers below the device pool for preempted sequences: host memory, then a file.

A swapped-out sequence's blocks are copied into tier slots and its device blocks are released;
swapping in copies them back into fresh device blocks. `swap_out` and `swap_in` return the copies;
the scheduler puts them in its step's block moves, and they are applied before the step's other
moves, in an order that keeps every read ahead of any overwrite: swap-outs, then swap-ins, then
the slots that were read are released.

The file tier's space is reserved when it is made (posix_fallocate: an OSError then, which the
engine turns into a refusal at start-up), and it is written and read with pwrite / pread, not
through a memory map: a mapped page with no disk behind it (a sparse file on a full filesystem)
was a SIGBUS on the first swap-out, which killed the process. A copy that still fails at run time
(an I/O error, a file shrunk under the engine) is an OSError: `apply` logs it and returns the
sequences whose pages were lost, which the engine recomputes.
"""
from __future__ import annotations

import errno
import logging
import os
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.cache.kv_pool import KVPool

logger = logging.getLogger(__name__)


class HostTier:
    """Slots in host memory (pinned on CUDA: the copies are fast and may be asynchronous)."""
    name = "host"

    def __init__(self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.data = torch.zeros((num_slots, *shape), dtype=dtype, pin_memory=pin)
        self.num_slots = num_slots
        self.free = list(range(num_slots))

    def write(self, slots: list[int], data: torch.Tensor) -> None:
        self.data[torch.tensor(slots)] = data.to(self.data.device)

    def read(self, slots: list[int]) -> torch.Tensor:
        return self.data[torch.tensor(slots)]


class DiskTier:
    """Slots in a file in `directory`, its space reserved up front. Raises OSError when the
    space cannot be reserved; `write` and `read` raise it when the disk fails a copy."""
    name = "disk"

    def __init__(self, num_slots: int, shape: tuple[int, ...], dtype: torch.dtype,
                 directory: str | Path | None) -> None:
        self.shape, self.dtype, self.num_slots = shape, dtype, num_slots
        self.slot_bytes = torch.Size(shape).numel() * dtype.itemsize
        self._file = tempfile.NamedTemporaryFile(dir=directory, prefix="kvserve-swap-", suffix=".bin")
        try:
            os.posix_fallocate(self._file.fileno(), 0, num_slots * self.slot_bytes)
        except OSError:
            self._file.close()
            raise
        self.free = list(range(num_slots))

    def write(self, slots: list[int], data: torch.Tensor) -> None:
        rows = data.contiguous().view(torch.uint8).reshape(len(slots), -1).numpy()
        for slot, row in zip(slots, rows):
            if os.pwrite(self._file.fileno(), row, slot * self.slot_bytes) != self.slot_bytes:
                raise OSError(errno.EIO, f"short write to slot {slot}")

    def read(self, slots: list[int]) -> torch.Tensor:
        out = torch.empty((len(slots), *self.shape), dtype=self.dtype)
        rows = out.view(torch.uint8).reshape(len(slots), -1).numpy()
        for slot, row in zip(slots, rows):
            if os.preadv(self._file.fileno(), [row], slot * self.slot_bytes) != self.slot_bytes:
                raise OSError(errno.EIO, f"short read of slot {slot}")
        return out


Tier = HostTier | DiskTier


@dataclass(frozen=True)
class TierUsage:
    name: str
    total: int
    used: int
    free: int


class SwapSpace:
    def __init__(self, pool: KVPool, host_blocks: int, disk_blocks: int,
                 disk_dir: str | Path | None = None) -> None:
        """Raises OSError when the file tier's space cannot be reserved in `disk_dir`."""
        k0 = pool.layers[0][0]
        shape = (len(pool.layers), 2, *k0.shape[1:])  # per slot: [layers, 2 (K, V), block_size, kv_heads, head_dim]
        self.tiers: list[Tier] = []
        if host_blocks > 0:
            self.tiers.append(HostTier(host_blocks, shape, k0.dtype, pin=k0.device.type == "cuda"))
        if disk_blocks > 0:
            self.tiers.append(DiskTier(disk_blocks, shape, k0.dtype, disk_dir))
        self.swapped: dict[str, list[tuple[int, int]]] = {}  # seq_id -> (tier index, slot) per block
        # The sequence each held slot belongs to, until it is read back or discarded: a copy that
        # fails names the sequences it lost.
        self._owner: dict[tuple[int, int], str] = {}
        self.swap_outs: Counter[str] = Counter()     # blocks swapped out, per tier
        self.swap_ins: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()      # copies a tier failed, per "tier out" / "tier in"

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
            self._owner[slots[-1]] = seq_id
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
        """A swapped sequence was aborted, or its copy failed: its slots are free again."""
        for tier, slot in self.swapped.pop(seq_id, []):
            self.tiers[tier].free.append(slot)
            del self._owner[tier, slot]

    def apply(self, pool: KVPool, swap_out: Sequence[tuple[int, int, int]],
              swap_in: Sequence[tuple[int, int, int]]) -> set[str]:
        """Copies out (every read first), then back in; slots read back are free again. Returns
        the sequences whose pages a tier failed to take or give back (logged and counted): their
        copies are lost, so they must be recomputed."""
        device = pool.layers[0][0].device
        lost: set[str] = set()
        for index, tier in enumerate(self.tiers):
            out = [(b, s) for b, t, s in swap_out if t == index]
            if out:
                blocks = torch.tensor([b for b, _ in out], device=device)
                data = torch.stack([torch.stack((k[blocks], v[blocks]), dim=1) for k, v in pool.layers], dim=1)
                try:
                    tier.write([s for _, s in out], data.cpu())
                except OSError as err:
                    lost |= self._failed(index, "out", [s for _, s in out], err)
        for index, tier in enumerate(self.tiers):
            back = [(s, b) for t, s, b in swap_in if t == index]
            if back:
                slots = [s for s, _ in back]
                try:
                    data = tier.read(slots)
                except OSError as err:
                    lost |= self._failed(index, "in", slots, err)
                else:
                    blocks = torch.tensor([b for _, b in back], device=device)
                    for layer, (k, v) in enumerate(pool.layers):
                        k[blocks] = data[:, layer, 0].to(device)
                        v[blocks] = data[:, layer, 1].to(device)
                for slot in slots:
                    del self._owner[index, slot]
                tier.free.extend(slots)
        return lost

    def _failed(self, index: int, direction: str, slots: list[int], err: OSError) -> set[str]:
        tier = self.tiers[index]
        lost = {self._owner[index, slot] for slot in slots}
        self.failures[f"{tier.name} {direction}"] += len(slots)
        logger.warning("kvserve: the %s swap tier failed to swap %s %d blocks (%s); their %d sequences are "
                       "recomputed", tier.name, direction, len(slots), err, len(lost))
        return lost

    def usage(self) -> list[TierUsage]:
        return [TierUsage(t.name, t.num_slots, t.num_slots - len(t.free), len(t.free)) for t in self.tiers]
