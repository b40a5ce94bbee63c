"""How many blocks a sequence's tables take in each KV cache group: arithmetic on the groups'
specs, the block size and a step's most tokens, apart from which blocks they are (the block
manager's concern).

A full group's table covers every slot. A sliding group's (cache/kv_groups.py) needs real blocks
only from its window's start, and with chunked prefill (`step_tokens`) only up to where the next
step's tokens can end, so its entries stop there.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.cache.kv_groups import KVSpec


@dataclass(frozen=True)
class TableWidths:
    specs: tuple[KVSpec, ...]  # each KV cache group's
    block_size: int
    step_tokens: int | None    # the most tokens a step runs of one sequence; None: a prompt runs whole

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def width(self, spec: KVSpec, num_slots: int, num_computed: int) -> int:
        """Table entries a group needs for `num_slots` slots, `num_computed` of them computed: a
        sliding group's stop where the next step's tokens can end."""
        if spec.window is not None and self.step_tokens is not None:
            num_slots = min(num_slots, num_computed + self.step_tokens)
        return self.blocks_for(num_slots)

    def peak(self, num_tokens: int) -> int:
        """The most blocks a sequence holds at once on its way to `num_tokens` tokens (a sliding
        group: its window and a step's tokens)."""
        span = num_tokens if self.step_tokens is None else self.step_tokens
        return sum(self.blocks_for(num_tokens) if spec.window is None else
                   min(self.blocks_for(num_tokens), -(-(spec.window - 1 + span) // self.block_size) + 1)
                   for spec in self.specs)

    def held(self, num_tokens: int) -> int:
        """Blocks a sequence of `num_tokens` tokens holds while it decodes, every group together."""
        if not num_tokens:
            return 0
        last = (num_tokens - 1) // self.block_size
        return sum(last + 1 - spec.first_needed(num_tokens - 1) // self.block_size for spec in self.specs)
