"""The full-precision staging slots of a compressed pool with a residual window or block-coded
formats (cache/quantized_pool.py says what staging is), owned by the block manager: which block
holds which slot, what a step takes, seals and gives back.

A step's plan is made once, from its token spans and copy-on-write copies, as slot numbers
(`StagingPlan`); the pool turns it into index tensors (`QuantizedKVPool.write_plan`). Slots
given back while a plan is made are reused only by a later step, since the step still reads
the blocks it seals from staging. Admission asks `room_for` first, so a step never finds the
slots exhausted: each running sequence may hold its window and partial block and take one
copy-on-write copy, and a step's chunks take a slot for every block they touch.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvserve.cache.blocks import Block


@dataclass(frozen=True)
class StagingPlan:
    """One step's staging, in the step's token offsets and slot numbers."""
    staged: tuple[tuple[int, int, int], ...]  # (first token offset in the step, first staging position, count)
    seals: tuple[tuple[int, int], ...]        # (block, slot): encoded from staging after attention
    reads: tuple[tuple[int, int], ...]        # (block, slot): every block the step reads from staging
    copies: tuple[tuple[int, int], ...]       # copy-on-write: (source slot, destination slot)


class StagingSlots:
    def __init__(self, num_slots: int, block_size: int, residual: int, blocks: list[Block]) -> None:
        self.num_slots, self.block_size, self.residual = num_slots, block_size, residual
        self._blocks = blocks
        self.stage_of: dict[int, int] = {}  # block -> staging slot
        self._free = list(range(num_slots - 1, -1, -1))

    def per_sequence(self) -> int:
        """Slots a running sequence may hold between steps (its window and partial block) and
        take in one (a copy-on-write copy)."""
        return -(-self.residual // self.block_size) + 2

    @property
    def num_free(self) -> int:
        return len(self._free)

    def room_for(self, num_seqs: int, step_tokens: int) -> bool:
        """Whether `num_seqs` running sequences and chunks of `step_tokens` tokens in all fit."""
        return num_seqs * self.per_sequence() + step_tokens // self.block_size <= self.num_slots

    def _take(self, block: int) -> int:
        if block not in self.stage_of:
            if not self._free:  # room_for keeps admission within the slots: a broken invariant
                raise RuntimeError("StagingSlots: staging slots exhausted despite admission's check")
            self.stage_of[block] = self._free.pop()
        return self.stage_of[block]

    def _unowned(self) -> list[int]:
        return [b for b in self.stage_of if self._blocks[b].ref_count == 0]

    def release_unowned(self) -> tuple[tuple[int, int], ...]:
        """Gives back now the slots of blocks no sequence owns any more (a finished or aborted
        one's), so an idle engine holds none. Returns the (slot, block) seals of the cached (full)
        ones, to apply at once, so that they serve later prefix hits from their codes: the slots
        are not reused before."""
        unowned = self._unowned()
        seals = tuple((self.stage_of[b], b) for b in unowned if self._blocks[b].hash is not None)
        self._free.extend(self.stage_of.pop(b) for b in unowned)
        return seals

    def plan(self, spans: Iterable[tuple[list[int], int, int]], copies: Iterable[tuple[int, int]]) -> StagingPlan:
        """spans: (block table, tokens already in the pool, tokens after this step), in batch
        order; copies: the step's copy-on-write (source, destination) blocks."""
        bs = self.block_size
        # First, before a source can lose its slot below (its last owner preempted this step):
        # its slot stays intact until the copy, since freed slots are not reused within a step.
        stage_copies = tuple((self.stage_of[s], self._take(d)) for s, d in copies if s in self.stage_of)
        seal: dict[int, int] = {}  # block -> the staging slot it is encoded from after attention
        freed: list[int] = []
        # Blocks nobody owns: a cached (full) one is sealed, so it can serve a later prefix hit;
        # any other holds nothing reusable.
        for block in self._unowned():
            if self._blocks[block].hash is not None:
                seal[block] = self.stage_of[block]
            freed.append(self.stage_of.pop(block))
        staged: list[tuple[int, int, int]] = []
        offset = 0
        for table, start, end in spans:
            window = end - self.residual  # tokens before this position are out of the window
            for i in range(start // bs, -(-end // bs)):
                # A block all new and already out of the window reuses any slot left from its
                # previous owner, and is sealed below like any other that left the window.
                block, lo = table[i], i * bs
                first, last = max(lo, start), min(lo + bs, end)
                staged.append((offset + first - start, self._take(block) * bs + first - lo, last - first))
            # Staged blocks of this sequence that have left the window.
            for block in table[:max(window, 0) // bs]:
                if block in self.stage_of:
                    seal[block] = self.stage_of.pop(block)
                    freed.append(seal[block])
            offset += end - start
        self._free.extend(freed)
        # This step still reads the sealed ones from staging.
        return StagingPlan(tuple(staged), tuple(seal.items()), tuple({**self.stage_of, **seal}.items()), stage_copies)
